"""Expert parallelism: tokens travel to the devices that own their experts and back.

Shape suffixes: T local tokens, K top-k, A local assignments (T·K), D d_model, P devices along
the `expert` axis, C slots per destination, E experts (local: El = E/P).

Runs inside `jax.shard_map` over the expert mesh. Each device routes its own token shard, sends
every assignment to the device holding its expert, computes its local experts, and sends results
back. Two transports behind `cfg.dispatch`:
- "all_to_all": fixed-capacity padded buffers [P, C, D] and `jax.lax.all_to_all`. Works on every
  backend (XLA:CPU included). Assignments past C are dropped and counted.
- "ragged_all_to_all": exact-size chunks with `jax.lax.ragged_all_to_all` into a receive buffer of
  `capacity_factor`·A rows. Rows past the buffer are counted. XLA:CPU has no ragged-all-to-all: on a
  CPU mesh the same exchange runs through `cpu_collectives.ragged_all_to_all` (all_to_all of padded
  chunks, typed like the native op), chosen by the platform of the mesh's devices.
Buffer sizes are the bound on drops: `capacity_factor` > 0 sizes them to that multiple of a balanced
share (drops possible, counted in the `overflow` metric); `capacity_factor` = 0 makes them dropless,
sized for the worst case (`worst_case_rows`: every token of every device sending min(K, E/P) of its
assignments to one device; P/K·min(K, E/P) times a balanced share, e.g. 4× on the tiny meshes).
Tokens are not copied K times: each send slot gathers its row from the token it belongs to.
When the expert weights' d_model is sharded too (FSDP within experts), they are gathered first, in the
compute dtype (half the bytes of fp32 parameters).
Every mesh axis and spec comes from `sharding.expert_layout` (the rules of `sharding.py`) and the
weights' logical axes (`experts.W_*_AXES`); nothing here names a mesh axis.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from composer_jax import backend, sharding
from composer_jax.model import cpu_collectives, varying
from composer_jax.model.config import ModelConfig
from composer_jax.model.experts import (
  W_DOWN_AXES,
  W_GATE_AXES,
  W_UP_AXES,
  capacity,
  experts_local,
  sort_by_expert,
)

_WEIGHT_AXES = (W_GATE_AXES, W_UP_AXES, W_DOWN_AXES)


def dispatch(x_TD, expert_ids_TK, weights, cfg: ModelConfig, meshes):
  """Routed-expert outputs [T, K, D] for every assignment, and the dropped-assignment count.

  The tokens split over the expert mesh in order, each device taking one contiguous run: flatten a
  batch with `device_major`, so that these runs are the tokens each device already holds.
  """
  ep = sharding.expert_layout(meshes)
  n_devices, n_ep = ep.size(ep.tokens), ep.size(ep.experts)
  if x_TD.shape[0] % n_devices:
    raise ValueError(f"{x_TD.shape[0]} tokens do not split over the {n_devices} devices of the expert mesh.")
  if cfg.n_experts % n_ep:
    raise ValueError(f"n_experts={cfg.n_experts} is not divisible by expert parallelism {n_ep}.")
  body = _all_to_all_body if cfg.dispatch == "all_to_all" else _ragged_body
  tokens = ep.token_spec()
  fn = jax.shard_map(
    lambda x, ids, *ws: body(x, ids, _gather_fsdp(ws, ep, cfg.dtype), cfg, ep),
    mesh=ep.mesh,
    in_specs=(tokens, tokens, *(ep.param_spec(axes) for axes in _WEIGHT_AXES)),
    out_specs=(tokens, jax.sharding.PartitionSpec()),
    # tokamax's Pallas calls declare their outputs without a varying-axes type, which check_vma=True
    # refuses ("manual_axis_type ... must not be None"); the check is off for that path only.
    check_vma=cfg.expert_impl != "tokamax",
  )
  return fn(x_TD, expert_ids_TK, *weights)


def device_major(x_BT, meshes):
  """[B, T, ...] → [B·T, ...] with each dense-mesh device's tokens (B/R rows of its batch shard, T/C
  positions of its context shard) one contiguous run, in device order.

  A plain flatten matches the dense layout only with one row per device or no context split; otherwise
  the tokens must move before the expert mesh can take them, and on kimi_k25_1t with 2 rows per chip
  (512 chips) GSPMD replicated the attention instead (3.7 TB of temporaries). Splitting B and T into
  (shards, local) first keeps every step of the reorder local to a device.
  """
  B, T, rest = x_BT.shape[0], x_BT.shape[1], x_BT.shape[2:]
  deg = sharding.degrees(meshes)
  r, c = deg.batch, deg.seq
  if B % r or T % c:
    return x_BT.reshape(B * T, *rest)
  return x_BT.reshape(r, B // r, c, T // c, *rest).swapaxes(1, 2).reshape(B * T, *rest)


def from_device_major(x_T, batch: int, meshes):
  """The inverse of `device_major`: [B·T, ...] → [B, T, ...] for B = `batch` rows."""
  T, rest = x_T.shape[0] // batch, x_T.shape[1:]
  deg = sharding.degrees(meshes)
  r, c = deg.batch, deg.seq
  if batch % r or T % c:
    return x_T.reshape(batch, T, *rest)
  return x_T.reshape(r, c, batch // r, T // c, *rest).swapaxes(1, 2).reshape(batch, T, *rest)


def _gather_fsdp(weights, ep: sharding.ExpertLayout, dtype):
  """Each expert weight whole along d_model (its `embed` axis), gathered over the expert-FSDP axes in the
  compute dtype (the expert matmuls cast to it anyway)."""
  if ep.size(ep.fsdp) == 1:
    return weights
  return tuple(
    jax.lax.all_gather(w.astype(dtype), ep.fsdp, axis=axes.index("embed"), tiled=True)
    for w, axes in zip(weights, _WEIGHT_AXES, strict=True)
  )


def worst_case_rows(tokens: int, cfg: ModelConfig, n_ep: int) -> int:
  """The most assignment rows one device can send to one device: each of its tokens, min(K, E/P) of
  its K experts living there."""
  return tokens * min(cfg.top_k, cfg.n_experts // n_ep)


def _platform(ep: sharding.ExpertLayout) -> str:
  return (
    "gpu" if ep.mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm") else ep.mesh.devices.flat[0].platform
  )


def _all_to_all_body(x_TD, ids_TK, weights, cfg: ModelConfig, ep: sharding.ExpertLayout):
  n_ep = ep.size(ep.experts)
  T, K = ids_TK.shape
  A, local_experts = T * K, cfg.n_experts // n_ep
  ids_A = ids_TK.reshape(A)
  dropless = cfg.capacity_factor <= 0
  send_slots = worst_case_rows(T, cfg, n_ep) if dropless else capacity(A, n_ep, cfg.capacity_factor)

  # Pack: slot (p, c) of the send buffer holds the c-th assignment bound for device p.
  dest_A = ids_A // local_experts
  order_A, sizes_P, starts_P, rank_A = sort_by_expert(dest_A, n_ep)
  slot_PC = starts_P[:, None] + jnp.arange(send_slots)[None, :]
  filled_PC = jnp.arange(send_slots)[None, :] < sizes_P[:, None]
  source_PC = order_A[jnp.clip(slot_PC, 0, A - 1)]
  send_x = jnp.where(filled_PC[..., None], x_TD[source_PC // K], 0).reshape(n_ep * send_slots, -1)
  # Empty slots carry expert id `local_experts` (out of range): the expert paths give them zeros.
  send_ids = jnp.where(filled_PC, ids_A[source_PC] % local_experts, local_experts).reshape(-1)

  recv_x = jax.lax.all_to_all(send_x, ep.experts, 0, 0, tiled=True)
  recv_ids = jax.lax.all_to_all(send_ids, ep.experts, 0, 0, tiled=True)
  local_slots = n_ep * send_slots
  if not dropless:
    local_slots = min(local_slots, math.ceil(A / local_experts * cfg.capacity_factor))
  y_recv, dropped_local = experts_local(
    recv_x, recv_ids, *weights, cfg, max(local_slots, 1), 1, _platform(ep), A
  )
  y_send = jax.lax.all_to_all(y_recv, ep.experts, 0, 0, tiled=True)

  # Unpack: assignment a comes back in slot (dest_a, rank_a) unless it was past the capacity.
  kept_A = rank_A < send_slots
  y_AD = jnp.where(kept_A[:, None], y_send[dest_A * send_slots + jnp.clip(rank_A, 0, send_slots - 1)], 0)
  dropped = jnp.sum(~kept_A) + dropped_local
  return y_AD.reshape(T, K, -1), jax.lax.psum(dropped, ep.tokens)


def ragged_offsets(sizes_SP: jax.Array, buffer_rows: int):
  """For a send-count matrix [source, dest]: where each chunk lands and how much of it fits.

  Returns (output_offsets_SP, clamped_sizes_SP): chunk (s, p) starts at Σ_{s'<s} sizes[s', p] in
  device p's receive buffer; sizes are clipped so no chunk writes past `buffer_rows`.
  """
  offsets_SP = jnp.cumsum(sizes_SP, axis=0) - sizes_SP
  clamped_SP = jnp.clip(jnp.minimum(sizes_SP, buffer_rows - offsets_SP), 0, None)
  return jnp.minimum(offsets_SP, buffer_rows), clamped_SP


def _ragged_body(x_TD, ids_TK, weights, cfg: ModelConfig, ep: sharding.ExpertLayout):
  n_ep = ep.size(ep.experts)
  T, K = ids_TK.shape
  A, local_experts = T * K, cfg.n_experts // n_ep
  if cfg.capacity_factor <= 0:  # dropless: every device may send its worst case here
    rows = n_ep * worst_case_rows(T, cfg, n_ep)
  else:
    rows = max(1, min(n_ep * A, math.ceil(A * cfg.capacity_factor)))
  if cfg.expert_chunks > 1:  # whole row chunks (`experts.row_chunked_swiglu`)
    rows = -(-rows // cfg.expert_chunks) * cfg.expert_chunks
  ids_A = ids_TK.reshape(A)
  dest_A = ids_A // local_experts
  order_A, sizes_P, starts_P, _ = sort_by_expert(dest_A, n_ep)
  me = jax.lax.axis_index(ep.experts)
  sizes_SP = jax.lax.all_gather(sizes_P, ep.experts)  # every device's send counts
  out_offsets_SP, sent_SP = ragged_offsets(sizes_SP, rows)

  native = backend.native_ragged_all_to_all(_platform(ep))
  ragged_all_to_all = jax.lax.ragged_all_to_all if native else cpu_collectives.ragged_all_to_all

  def exchange(operand, output, in_offsets, send_sizes, out_offsets, recv_sizes):
    return ragged_all_to_all(
      operand, output, in_offsets, send_sizes, out_offsets, recv_sizes, axis_name=ep.experts
    )

  x_sorted = x_TD[order_A // K]
  ids_sorted = (ids_A % local_experts)[order_A]
  # The output buffers hold other devices' rows: typed varying (`varying.vary_like`), or the backward
  # pass would sum the received rows' gradient over the expert axes.
  recv_x = exchange(
    x_sorted,
    varying.vary_like(jnp.zeros((rows, x_TD.shape[1]), x_TD.dtype), x_sorted, *weights),
    starts_P,
    sent_SP[me],
    out_offsets_SP[me],
    sent_SP[:, me],
  )
  recv_ids = exchange(
    ids_sorted,
    varying.vary_like(jnp.full((rows,), local_experts, ids_sorted.dtype), ids_sorted),
    starts_P,
    sent_SP[me],
    out_offsets_SP[me],
    sent_SP[:, me],
  )
  # On average a device receives as many rows as it sends (A): the row chunks' expected share. The
  # received rows fill the buffer from row 0; with one local expert they are already grouped, and only
  # they are sent back.
  y_recv, dropped_local = experts_local(
    recv_x, recv_ids, *weights, cfg, rows, 1, _platform(ep), A, presorted=local_experts == 1
  )
  # Back: my received chunk from s sits at out_offsets[s, me]; it returns to s's sorted rows.
  starts_SP = jax.lax.all_gather(starts_P, ep.experts)
  y_sorted = exchange(
    y_recv,
    varying.vary_like(jnp.zeros_like(x_sorted), x_sorted, y_recv),
    out_offsets_SP[:, me],
    sent_SP[:, me],
    starts_SP[:, me],
    sent_SP[me],
  )
  y_AD = jnp.zeros_like(y_sorted).at[order_A].set(y_sorted)
  dropped = jnp.sum(sizes_P - sent_SP[me]) + dropped_local
  return y_AD.reshape(T, K, -1), jax.lax.psum(dropped, ep.tokens)
