"""Scale planner: what each device holds and sends in one train step of a config on N devices.

Shape suffixes are not used here: everything is a count of elements or bytes *per device*. Symbols
in docstrings: b rows and t positions of the batch per device (dense mesh), S sequence length,
D d_model, H heads, C kv_lora_rank, R qk_rope_head_dim, Q q_lora_rank, E experts, K top_k,
P expert parallelism (size of the `expert` axis), W an MLP's hidden width, V vocab.

Everything is computed from shapes: parameter shapes come from `jax.eval_shape(model.init)`, each
leaf's per-device shard from `sharding.param_sharding` on abstract meshes (the same rule that places
real parameters), the optimizer branch of each leaf from `optim.labels`, and the Newton–Schulz work
split from the sharded Muon's own view/grouping code (`optim.muon`). No array is allocated, so a 1T
plan runs on a laptop. Bytes are exact for parameters, optimizer state and batch (they match XLA's
`memory_analysis().argument_size_in_bytes`, tests/test_plan.py); activations and collective volumes
are models of the code paths, documented where they are computed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from optax.contrib import MuonDimensionNumbers

from composer_jax import model, optim, sharding
from composer_jax.model.config import ModelConfig
from composer_jax.model.moe import capacity
from composer_jax.optim import muon as muon_lib
from composer_jax.optim import newton_schulz

# The Composer 2.5 write-up: "0.2 s optimizer steps on trillion-parameter models" (notes/muon.md §2).
REPORTED_MUON_STEP_S = 0.2
_BATCH_FIELDS = 3  # tokens, segment_ids, positions: int32 [B, S] each


@dataclasses.dataclass(frozen=True)
class Layout:
  """Mesh shapes the plan is for; `derived` says they were scaled from the config's to `devices`."""

  dense: tuple[int, int, int]  # (replica, fsdp, context)
  expert: tuple[int, int]  # (expert, expert_fsdp)
  derived: bool = False
  note: str = ""

  @property
  def devices(self) -> int:
    return math.prod(self.dense)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device bytes (memory, collectives per step), Newton–Schulz FLOPs and time."""

  variant: str
  layout: Layout
  tokens_per_step: int
  grad_accum: int
  params_total: int  # parameter count, all devices together
  memory: dict[str, dict[str, int]]  # {"dense"|"expert"|"other": {term: bytes}}
  activations: dict[str, int]  # term → bytes, one micro-batch, remat honoured
  peak_bytes: int
  collectives: dict[str, int]  # name → bytes sent per device per step
  muon: dict[str, Any]
  hbm_bytes: int | None
  notes: tuple[str, ...]

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------
# Meshes


def derive_layout(dense: tuple, expert: tuple, devices: int | None, n_experts: int) -> Layout:
  """The config's meshes, or for another device count: keep fsdp, context and expert_fsdp (they
  stay inside a node), put the remaining factor into replica (dense) and expert (expert mesh)."""
  dense, expert = tuple(int(s) for s in dense), tuple(int(s) for s in expert)
  if len(dense) != 3 or len(expert) != 2:
    raise ValueError(f"mesh.dense needs 3 sizes and mesh.expert 2; got {dense} and {expert}.")
  if math.prod(dense) != math.prod(expert):
    raise ValueError(f"mesh.dense {dense} and mesh.expert {expert} cover different device counts.")
  if devices is None or devices == math.prod(dense):
    layout = Layout(dense, expert)
  else:
    _, fsdp, context = dense
    expert_fsdp = expert[1]
    if devices < 1 or devices % (fsdp * context) or devices % expert_fsdp:
      raise ValueError(
        f"devices={devices} is not a multiple of fsdp·context = {fsdp * context} and of expert_fsdp = "
        f"{expert_fsdp}; the planner keeps those axes and scales replica and expert."
      )
    layout = Layout(
      (devices // (fsdp * context), fsdp, context),
      (devices // expert_fsdp, expert_fsdp),
      derived=True,
      note=f"meshes derived for {devices} devices from dense {dense} / expert {expert}: fsdp, context and "
      "expert_fsdp kept, replica and expert scaled",
    )
  if n_experts % layout.expert[0]:
    raise ValueError(
      f"n_experts={n_experts} is not divisible by expert parallelism {layout.expert[0]} "
      f"(expert mesh {layout.expert}); pick a device count whose expert axis divides {n_experts}."
    )
  return layout


def abstract_meshes(layout: Layout) -> sharding.Meshes:
  """Both meshes as `AbstractMesh`es: shardings and shard shapes without any devices."""
  auto = AxisType.Auto
  dense = AbstractMesh(layout.dense, sharding.DENSE_AXES, axis_types=(auto,) * 3)
  expert = AbstractMesh(layout.expert, sharding.EXPERT_AXES, axis_types=(auto,) * 2)
  return sharding.Meshes(dense=dense, expert=expert)


# ---------------------------------------------------------------------------------------------------
# Parameters and optimizer state


@dataclasses.dataclass(frozen=True)
class Leaf:
  path: str
  shape: tuple[int, ...]
  itemsize: int
  axes: tuple
  where: NamedSharding
  label: str  # muon | adam | frozen
  dn: Any  # MuonDimensionNumbers or None

  @property
  def mesh(self) -> str:
    return "expert" if sharding.is_expert_param(self.axes) else "dense"

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def local_size(self) -> int:
    return math.prod(self.where.shard_shape(self.shape))


@functools.lru_cache(maxsize=8)
def param_shapes(cfg: ModelConfig) -> Any:
  """The parameter tree as ShapeDtypeStructs (traced once per config)."""
  return jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))


def leaves(cfg: ModelConfig, layout: Layout) -> list[Leaf]:
  """Every parameter with its per-device sharding and optimizer branch."""
  meshes = abstract_meshes(layout)
  is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
  flat_axes = jax.tree_util.tree_flatten_with_path(model.logical_axes(cfg), is_leaf=is_axes)[0]
  shapes = jax.tree.leaves(param_shapes(cfg))
  labels = jax.tree.leaves(optim.labels(cfg))
  is_dn = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # noqa: E731
  dns = jax.tree.leaves(optim.dimension_numbers(cfg), is_leaf=is_dn)
  out = []
  for (path, axes), shape, label, dn in zip(flat_axes, shapes, labels, dns, strict=True):
    where = sharding.param_sharding(axes, meshes, shape.shape)
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    out.append(Leaf(name, tuple(shape.shape), shape.dtype.itemsize, axes, where, label, dn))
  return out


def state_memory(params: list[Leaf], grad_accum: int) -> dict[str, dict[str, int]]:
  """Bytes per device on each mesh: params, optimizer state, gradients (+ fp32 accumulator).

  Optimizer state as `optim.build_optimizer` stores it: sharded Muon keeps one momentum buffer
  (`zeros_like` the param: same dtype, same sharding), optax AdamW two (mu, nu, param dtype), frozen
  leaves none; plus four int32 step counters (Muon, Adam, Adam's schedule, the train state's step).
  Gradients have the params' dtype and sharding; grad_accum > 1 adds the fp32 sum of `grads_and_aux`.
  """
  out = {m: {"params": 0, "opt_state": 0, "grads": 0, "grad_accum_f32": 0} for m in ("dense", "expert")}
  for p in params:
    b = p.local_size * p.itemsize
    row = out[p.mesh]
    row["params"] += b
    row["opt_state"] += {"muon": b, "adam": 2 * b, "frozen": 0}[p.label]
    row["grads"] += b
    if grad_accum > 1:
      row["grad_accum_f32"] += p.local_size * 4
  out["dense"]["opt_state"] += 3 * 4  # Muon, scale_by_adam and scale_by_schedule counts
  out["dense"]["step"] = 4
  return out


# ---------------------------------------------------------------------------------------------------
# Activations


@dataclasses.dataclass(frozen=True)
class _Tokens:
  """Per-device token counts of one micro-batch."""

  b: int  # rows (batch over replica·fsdp)
  t: int  # query positions (seq over context)
  seq: int  # key positions (keys are gathered over context)
  n_expert: int  # tokens per device on the expert mesh (all devices)
  total: int  # tokens of the micro-batch, all devices

  @property
  def n(self) -> int:
    return self.b * self.t


def _tokens(layout: Layout, micro_batch: int, seq_len: int) -> _Tokens:
  replica, fsdp, context = layout.dense
  if micro_batch % (replica * fsdp):
    raise ValueError(
      f"micro-batch {micro_batch} (train.batch_size / grad_accum) is not divisible by replica·fsdp = "
      f"{replica * fsdp}; raise the batch or grad_accum, or use fewer devices."
    )
  if seq_len % context:
    raise ValueError(f"seq_len {seq_len} is not divisible by context = {context}.")
  b, t = micro_batch // (replica * fsdp), seq_len // context
  total = micro_batch * seq_len
  return _Tokens(b=b, t=t, seq=seq_len, n_expert=total // layout.devices, total=total)


def _mlp_elems(rows: int, d: int, width: int) -> int:
  """SwiGLU residuals: input, gate·up (2W), sigmoid, silu, product (3W), hidden (W), output."""
  return rows * (2 * d + 6 * width)


def _attention_elems(cfg: ModelConfig, tok: _Tokens) -> tuple[int, int]:
  """(compute-dtype elements, fp32 elements) saved by one absorbed-MLA layer (attention.py).

  Token rows (n = b·t): both RMSNorms' input and normalised output, the residual sum and the block
  output (6D), q-LoRA latent and its norm (2Q), q (H·(N+R)), its rotated part (H·R), q·W_k (H·C), the
  concatenated query (H·(C+R)), the latent and rope key (C+2R), attention out (H·C), W_v out (H·V).
  Keys and values are gathered over `context`: b·S·(2C+R). Three fp32 [b, t, H, S] buffers: scores,
  probabilities, and the probabilities laid out for the second matmul's backward (XLA keeps both).
  """
  d, h, c, r = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  per_token = 6 * d + 2 * cfg.q_lora_rank + h * (cfg.qk_head_dim + r + 2 * c + (c + r) + cfg.v_head_dim)
  per_token += c + 2 * r
  act = tok.n * per_token + tok.b * tok.seq * (2 * c + r)
  f32 = 3 * tok.b * tok.t * h * tok.seq
  return act, f32


def _moe_elems(cfg: ModelConfig, layout: Layout, tok: _Tokens) -> tuple[int, int, dict[str, int]]:
  """(compute-dtype elements, fp32 elements, row counts) saved by the routed experts of one layer.

  Assignments A = tokens·K per device. Expert parallelism (moe.py, expert_parallel.py):
  "all_to_all" sends fixed buffers of P·capacity(A, P, cf) rows and saves send, receive and both
  result buffers (4 buffers); "ragged_all_to_all" receives ceil(A·cf) rows and saves receive,
  result and the sorted send/return rows (2 buffers + 2·A). The expert MLP runs on the received rows,
  padded per expert to `expert_block` on the "blocked" path. Router scores fp32 [n, E] ×3 and the
  fp32 combine [A, D].
  """
  p = layout.expert[0]
  local_experts = cfg.n_experts // p
  a = tok.n_expert * cfg.top_k
  d = cfg.d_model
  ep = p > 1 and tok.total % layout.devices == 0  # else moe.py runs the local path
  if ep and cfg.dispatch == "all_to_all":
    recv = p * capacity(a, p, cfg.capacity_factor)
    buffers = 4 * recv * d
  elif ep:
    recv = max(1, min(p * a, math.ceil(a * cfg.capacity_factor)))
    buffers = 2 * recv * d + 2 * a * d
  else:
    recv, buffers = a, 0
  if cfg.expert_impl == "blocked":
    rows = (-(-recv // cfg.expert_block) + local_experts) * cfg.expert_block
  elif cfg.expert_impl == "ragged":
    rows = recv
  elif not ep:  # capacity path: [E, slots] buckets, slots as moe.MoE / expert_parallel compute them
    rows = cfg.n_experts * capacity(a, cfg.n_experts, cfg.capacity_factor)
  elif cfg.dispatch == "all_to_all":
    rows = local_experts * max(1, min(recv, math.ceil(a / local_experts * cfg.capacity_factor)))
  else:
    rows = local_experts * recv
  act = a * d + buffers + _mlp_elems(rows, d, cfg.moe_mlp_dim)
  f32 = 3 * tok.n * cfg.n_experts + a * d
  return act, f32, {"assignments": a, "received_rows": recv, "expert_rows": rows}


def _weights_elems(cfg: ModelConfig, params: list[Leaf], layout: Layout) -> tuple[int, int]:
  """(all layers, largest layer) elements of weight copies the backward pass keeps.

  Every SwiGLU concatenates gate and up ([D, 2W]; the local experts after the expert_fsdp gather);
  absorbed MLA slices kv_b into W_k and W_v and folds heads of q_b and o_proj into matrix rows
  (C·H·(N+V) + Q·H·(N+R) + H·V·D, copies on XLA:CPU); when dense weights are FSDP-sharded or cast to
  another compute dtype, the gathered / cast copy of each dense matrix is saved too (the dot's operand).
  """
  e_local, fsdp = cfg.n_experts // layout.expert[0], layout.dense[1]
  moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
  dense_layers = cfg.n_layers - moe_layers
  concat = {
    "dense": cfg.d_model * 2 * cfg.dense_mlp_dim,
    "moe": cfg.d_model * 2 * (cfg.moe_mlp_dim * cfg.n_shared_experts + e_local * cfg.moe_mlp_dim),
  }
  copies = {"dense": 0, "moe": 0}
  if fsdp > 1 or cfg.dtype != cfg.param_dtype:
    for p in params:
      if p.mesh == "dense" and len(p.shape) >= 2 and p.label != "frozen" and p.path.startswith("layers/"):
        kind = "moe" if cfg.is_moe_layer(int(p.path.split("/")[1])) else "dense"
        copies[kind] += p.size
    copies = {k: v // max(1, {"dense": dense_layers, "moe": moe_layers}[k]) for k, v in copies.items()}
  h = cfg.n_heads
  absorbed = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * cfg.d_model
  absorbed += cfg.q_lora_rank * h * cfg.qk_head_dim
  per_layer = {k: concat[k] + copies[k] + absorbed for k in concat}
  total = dense_layers * per_layer["dense"] + moe_layers * per_layer["moe"]
  largest = max(per_layer["dense"] if dense_layers else 0, per_layer["moe"] if moe_layers else 0)
  return total, largest


def activation_memory(
  cfg: ModelConfig, layout: Layout, params: list[Leaf], micro_batch: int, seq_len: int
) -> tuple[dict[str, int], dict[str, int]]:
  """Bytes per device saved for the backward pass of one micro-batch, at the end of the forward pass.

  remat "none": every layer's residuals (the sums below). "full": each block's input (b·t·D) for all
  layers plus one block's residuals, recomputed in the backward pass. "dots"/"dots_with_batch": the
  matmul outputs of every layer (approximated as half of "none"'s per-layer residuals, scores kept by
  "dots_with_batch" only) plus one block recomputed. The LM head's fp32 logits, log-softmax and its
  gradient ([b·t, V] ×3) and the final norm are always live.
  """
  tok = _tokens(layout, micro_batch, seq_len)
  act_b = np.dtype(cfg.dtype).itemsize
  attn_act, attn_f32 = _attention_elems(cfg, tok)
  moe_act, moe_f32, rows = _moe_elems(cfg, layout, tok)
  n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
  n_dense = cfg.n_layers - n_moe
  dense_mlp = _mlp_elems(tok.n, cfg.d_model, cfg.dense_mlp_dim)
  shared = (
    _mlp_elems(tok.n, cfg.d_model, cfg.moe_mlp_dim * cfg.n_shared_experts) if cfg.n_shared_experts else 0
  )
  w_all, w_layer = _weights_elems(cfg, params, layout)
  layer = {
    "dense": (attn_act + dense_mlp) * act_b + attn_f32 * 4,
    "moe": (attn_act + shared + moe_act) * act_b + (attn_f32 + moe_f32) * 4,
  }
  head = 3 * tok.n * cfg.vocab_size * 4 + 2 * tok.n * cfg.d_model * act_b
  terms = {
    "attention": cfg.n_layers * (attn_act * act_b + attn_f32 * 4),
    "dense_mlp": n_dense * dense_mlp * act_b,
    "shared_experts": n_moe * shared * act_b,
    "routed_experts": n_moe * (moe_act * act_b + moe_f32 * 4),
    "weight_copies": w_all * act_b,
    "head": head,
  }
  largest = max(layer["dense"] if n_dense else 0, layer["moe"] if n_moe else 0) + w_layer * act_b
  if cfg.remat == "full":
    terms = {"block_inputs": cfg.n_layers * tok.n * cfg.d_model * act_b, "one_block": largest, "head": head}
  elif cfg.remat in ("dots", "dots_with_batch"):
    keep = cfg.n_layers * tok.n * cfg.d_model * act_b
    per_layer = sum(v for k, v in terms.items() if k not in ("head", "weight_copies")) // 2
    if cfg.remat == "dots":
      per_layer -= cfg.n_layers * attn_f32 * 4 // 2
    terms = {"block_inputs": keep, "matmul_outputs": per_layer, "one_block": largest, "head": head}
  terms["total"] = sum(terms.values())
  return terms, rows


# ---------------------------------------------------------------------------------------------------
# Collectives


def _ring(n: int) -> float:
  """Fraction of a buffer each device sends in a ring all-gather / reduce-scatter over n devices."""
  return (n - 1) / n if n > 1 else 0.0


def collective_bytes(
  cfg: ModelConfig, layout: Layout, params: list[Leaf], tok: _Tokens, grad_accum: int, rows: dict
) -> dict[str, int]:
  """Bytes sent per device per optimizer step (ring algorithms; all-reduce = 2·(n−1)/n of the buffer).

  - FSDP: dense params sharded over `fsdp` are all-gathered (param dtype) in the forward pass and
    again in the backward pass when remat recomputes the block; gradients reduce-scatter; per
    micro-batch. Expert weights over `expert_fsdp` likewise (`expert_parallel._gather_fsdp`).
    Assumed for every sharded dense matrix, embedding and LM head included (GSPMD may choose to
    move activations instead for those two).
  - HSDP: dense gradient shards are all-reduced over the devices holding the same shard
    (replica·context), per micro-batch (the accumulation is constrained to the param sharding).
  - EP: per MoE layer, dispatch + combine all-to-alls of routed tokens (compute dtype; the padded
    buffers on "all_to_all", the expected A·(P−1)/P rows on "ragged_all_to_all"), forward, backward,
    and again in the backward pass under remat.
  """
  fsdp = layout.dense[1]
  p_ep, e_fsdp = layout.expert
  recompute = 2 if cfg.remat != "none" else 1
  act_b = np.dtype(cfg.dtype).itemsize
  full = {"dense": 0, "expert": 0}
  all_reduce = 0.0
  for p in params:
    if p.mesh == "dense":
      full["dense"] += p.size * p.itemsize if fsdp > 1 and p.local_size < p.size else 0
      # a gradient is summed over every device that holds the same shard: replica·context, or all
      # devices for a dense param the fsdp axis does not shard (e.g. q_b/kv_b: no `embed` axis)
      copies = layout.devices * p.local_size // p.size
      all_reduce += 2 * _ring(copies) * p.local_size * p.itemsize
    elif e_fsdp > 1:
      full["expert"] += p.size * p.itemsize // p_ep
  out = {
    "fsdp_all_gather": int(grad_accum * recompute * _ring(fsdp) * full["dense"]),
    "fsdp_reduce_scatter": int(grad_accum * _ring(fsdp) * full["dense"]),
    "hsdp_all_reduce": int(grad_accum * all_reduce),
    "expert_fsdp_all_gather": int(grad_accum * recompute * _ring(e_fsdp) * full["expert"]),
    "expert_fsdp_reduce_scatter": int(grad_accum * _ring(e_fsdp) * full["expert"]),
  }
  n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
  if cfg.dispatch == "all_to_all":
    one_way = _ring(p_ep) * rows["received_rows"] * (cfg.d_model * act_b + 4)  # + int32 expert ids
  else:
    one_way = _ring(p_ep) * rows["assignments"] * cfg.d_model * act_b
  # forward: dispatch + combine; backward: their transposes; remat: the forward once more.
  out["ep_all_to_all"] = int(grad_accum * n_moe * one_way * 2 * (1 + recompute))
  return out


# ---------------------------------------------------------------------------------------------------
# Muon


def _axes_size(mesh: Any, names: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in names)


def muon_work(params: list[Leaf], ns_steps: int) -> dict[str, Any]:
  """Newton–Schulz FLOPs and all-to-all bytes per device, as `optim.muon` splits the work.

  Leaves are viewed as [B, M, K] stacks and grouped exactly as `sharded_muon` does (same view and
  group key); per group and device: local matrices padded to a multiple of (devices sharding M, K)
  × (copies), NS on 1/(that) of them, all-to-alls over the M and K axes there and back, and an
  all-gather of the NS results over the copy axes (mesh axes that shard none of B, M, K). Padding
  matrices are zeros but cost full NS FLOPs and buffer space: a group with fewer matrices than
  devices × copies makes every device orthogonalise (and hold) whole matrices of it.
  """
  groups: dict[tuple, list[tuple[Leaf, Any]]] = {}
  for p in params:
    if p.label != "muon":
      continue
    view = muon_lib._view(p.shape, p.dn, p.where)
    groups.setdefault((view.mesh, view.axes, view.shape[1:], p.itemsize), []).append((p, view))
  flops_dev = flops_total = a2a = gather = stack_max = stack_sum = 0
  per_mesh = {"dense": 0.0, "expert": 0.0}
  for (mesh, axes, (m, k), itemsize), members in groups.items():
    b_axes, m_axes, k_axes = axes
    size = functools.partial(_axes_size, mesh)
    local_n = sum(view.shape[0] // size(b_axes) for _, view in members)
    devices, copies = size(m_axes + k_axes), size(muon_lib._copy_axes(members[0][1]))
    padded = local_n + (-local_n % (devices * copies))
    one = newton_schulz.flops(m, k, ns_steps)
    mine = padded // (devices * copies) * one
    flops_dev += mine
    per_mesh[members[0][0].mesh] += mine
    flops_total += sum(view.shape[0] for _, view in members) * one
    local_bytes = padded * (m // size(m_axes)) * (k // size(k_axes)) * itemsize
    stack_max, stack_sum = max(stack_max, local_bytes), stack_sum + local_bytes
    a2a += int(2 * (_ring(size(m_axes)) + _ring(size(k_axes))) * local_bytes)
    gather += int(_ring(copies) * padded // devices * m * k * itemsize)
  return {
    "ns_flops_per_device": int(flops_dev),
    "ns_flops_per_device_by_mesh": {k: int(v) for k, v in per_mesh.items()},
    "ns_flops_total": int(flops_total),
    "groups": len(groups),
    "all_to_all_bytes": a2a,
    "all_gather_bytes": gather,
    # the zero-padded local stack of a group (and as large again after its all-to-all)
    "largest_group_stack_bytes": stack_max,
    "all_groups_stack_bytes": stack_sum,
  }


# ---------------------------------------------------------------------------------------------------
# The plan


def make_plan(config: Any) -> Plan:
  """The plan of an experiment config (`experiments/composer25.py`, its `plan` section included)."""
  from composer_jax import configs  # noqa: PLC0415

  typed = configs.from_config(config)  # a Config or an experiment's ConfigDict
  cfg, config = typed.model, configs.to_config_dict(typed)
  pcfg = config.get("plan") or {}
  devices = pcfg.get("devices")
  layout = derive_layout(tuple(config.mesh.dense), tuple(config.mesh.expert), devices, cfg.n_experts)
  batch, seq, accum = int(config.train.batch_size), int(config.train.seq_len), int(config.train.grad_accum)
  if accum < 1 or batch % accum:
    raise ValueError(f"train.batch_size {batch} is not divisible by train.grad_accum {accum}.")
  micro = batch // accum
  tok = _tokens(layout, micro, seq)  # checks the batch split before any tracing
  params = leaves(cfg, layout)
  memory = state_memory(params, accum)
  acts, rows = activation_memory(cfg, layout, params, micro, seq)
  memory["other"] = {"batch": _BATCH_FIELDS * batch * seq * 4 // layout.devices}
  state = sum(v for mesh in ("dense", "expert") for k, v in memory[mesh].items() if k != "grads")
  grads = sum(memory[m]["grads"] for m in ("dense", "expert"))
  coll = collective_bytes(cfg, layout, params, tok, accum, rows)
  ocfg = config.optim
  muon = muon_work(params, int(ocfg.ns_steps))
  # Peak: the state plus the larger of the forward residuals (with a micro-batch's gradients when
  # accumulating) and the update: gradients, new params, and Muon's largest padded group twice.
  update = 2 * grads + 2 * muon["largest_group_stack_bytes"]
  peak = state + memory["other"]["batch"] + max(acts["total"] + (grads if accum > 1 else 0), update)
  coll["muon_all_to_all"] = muon["all_to_all_bytes"]
  coll["muon_all_gather"] = muon["all_gather_bytes"]
  peak_flops = pcfg.get("peak_flops") or float(config.train.peak_flops)
  muon["peak_flops"] = peak_flops
  muon["ns_seconds"] = muon["ns_flops_per_device"] / peak_flops
  muon["ns_dtype"] = cfg.param_dtype  # NS runs in the momentum's dtype = the param dtype
  notes = [layout.note] if layout.note else []
  if cfg.param_dtype == "float32":
    notes.append("Newton–Schulz runs in the momentum's dtype (float32): compare with an fp32/tf32 peak")
  if ocfg.matrix_optimizer != "muon":
    notes.append("optim.matrix_optimizer is not 'muon': the Muon figures describe the Muon configuration")
  hbm = pcfg.get("hbm_gib")
  return Plan(
    variant=str(config.get("variant", "")),
    layout=layout,
    tokens_per_step=batch * seq,
    grad_accum=accum,
    params_total=sum(p.size for p in params),
    memory=memory,
    activations=acts,
    peak_bytes=int(peak),
    collectives=coll,
    muon=muon,
    hbm_bytes=int(hbm * 2**30) if hbm else None,
    notes=tuple(notes),
  )


def _gib(x: float) -> str:
  return f"{x / 2**30:10.3f} GiB"


def _gb(x: float) -> str:
  return f"{x / 1e9:10.3f} GB"


def format_plan(plan: Plan) -> str:
  """Readable tables: memory (GiB) per mesh, collectives (GB), Newton–Schulz (TFLOP, seconds)."""
  lay = plan.layout
  lines = [
    f"plan {plan.variant}: {lay.devices} devices, dense (replica, fsdp, context) = {lay.dense}, "
    f"expert (expert, expert_fsdp) = {lay.expert}",
    f"  {plan.params_total / 1e9:.2f}B params, {plan.tokens_per_step:,} tokens/step, "
    f"grad_accum {plan.grad_accum}",
  ]
  lines += [f"  note: {n}" for n in plan.notes]
  lines.append("")
  lines.append(f"  {'memory per device':<28}{'dense mesh':>14}{'expert mesh':>14}{'total':>14}")
  for term in ("params", "opt_state", "grads", "grad_accum_f32"):
    d, e = plan.memory["dense"].get(term, 0), plan.memory["expert"].get(term, 0)
    lines.append(f"  {term:<28}{_gib(d):>14}{_gib(e):>14}{_gib(d + e):>14}")
  lines.append(f"  {'batch':<28}{'':>28}{_gib(plan.memory['other']['batch']):>14}")
  lines.append("  activations (one micro-batch, saved for backward):")
  for term, v in plan.activations.items():
    lines.append(f"    {term:<26}{'':>28}{_gib(v):>14}")
  hbm = f" of {plan.hbm_bytes / 2**30:.0f} GiB HBM" if plan.hbm_bytes else ""
  over = " — DOES NOT FIT" if plan.hbm_bytes and plan.peak_bytes > plan.hbm_bytes else ""
  lines.append(f"  {'peak (estimate)':<28}{'':>28}{_gib(plan.peak_bytes):>14}{hbm}{over}")
  lines.append("")
  lines.append(f"  {'collectives per step (sent per device)':<42}{'':>14}")
  for name, v in plan.collectives.items():
    lines.append(f"  {name:<42}{_gb(v):>14}")
  lines.append(f"  {'total':<42}{_gb(sum(plan.collectives.values())):>14}")
  m = plan.muon
  lines += [
    "",
    f"  Newton–Schulz per device: {m['ns_flops_per_device'] / 1e12:.2f} TFLOP "
    f"(dense mesh {m['ns_flops_per_device_by_mesh']['dense'] / 1e12:.2f}, expert mesh "
    f"{m['ns_flops_per_device_by_mesh']['expert'] / 1e12:.2f}); "
    f"all devices {m['ns_flops_total'] / 1e15:.2f} PFLOP "
    f"in {m['groups']} groups; ideal split {m['ns_flops_total'] / lay.devices / 1e12:.2f} TFLOP/device",
    f"  Muon step (NS compute only, in {m['ns_dtype']}) at {m['peak_flops'] / 1e12:.4g} TFLOP/s: "
    f"{m['ns_seconds']:.3f} s vs {REPORTED_MUON_STEP_S} s reported by Composer 2.5 at 1T parameters "
    f"({m['ns_seconds'] / REPORTED_MUON_STEP_S:.2f}x)",
    f"  Muon collectives {(m['all_to_all_bytes'] + m['all_gather_bytes']) / 1e9:.2f} GB/device; padded group "
    f"stacks {m['largest_group_stack_bytes'] / 2**30:.2f} GiB largest, "
    f"{m['all_groups_stack_bytes'] / 2**30:.2f} GiB all groups",
  ]
  return "\n".join(lines)


def run_stage(config: Any, workdir: str) -> dict[str, Any]:
  """The `plan` stage: prints the plan, writes `<workdir>/plan.json`, returns it as a dict."""
  from absl import logging  # noqa: PLC0415

  plan = make_plan(config)
  logging.info("[plan]\n%s", format_plan(plan))
  out = plan.to_dict()
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / "plan.json").write_text(json.dumps(out, indent=1))
  return out
