"""DeepSeek-V3 MoE: sigmoid router with aux-loss-free bias, shared + routed SwiGLU experts.

Shape suffixes: B batch, T time (or flattened tokens), D d_model, E experts, K top-k,
F expert hidden, G router groups, C capacity slots per expert.

Routing (DeepSeek-V3 §2.1.2, HF `DeepseekV3TopkRouter`): s = sigmoid(x·W) in float32; the bias
b is added for *selection only* (group-limited top-k); combine weights are the unbiased s of
the chosen experts, renormalised and × routed_scaling_factor. b gets no gradient: it is nudged
after each step by `update_router_bias` towards equal load (§2.1.2, "auxiliary-loss-free").
Routing replay (R3, arXiv 2510.11370) swaps the selection for given expert ids (in [0, E)) and
keeps the weight computation, so an RL trainer can use the experts its sampler chose.

Expert compute has two interchangeable paths (`cfg.expert_impl`):
- "ragged": sort assignments by expert → `jax.lax.ragged_dot` grouped matmuls → unsort. Dropless.
  XLA:CPU lowers ragged_dot as a masked dense matmul over all E groups (E× the work).
- "capacity": gather assignments into [E, C, D] buckets → batched einsum → gather back.
  Assignments past C slots are dropped *and counted* (`aux["overflow"]`). Equal to "ragged"
  whenever nothing overflows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import MLP, RouterBias, param, project


class Routing(NamedTuple):
  expert_ids_TK: jax.Array  # int32
  weights_TK: jax.Array  # float32, unbiased, normalised, scaled
  scores_TE: jax.Array  # float32 sigmoid scores (for the balance loss)


def route(
  logits_TE: jax.Array, bias_E: jax.Array, cfg: ModelConfig, forced_ids_TK: jax.Array | None = None
) -> Routing:
  """Group-limited top-k over biased scores; combine weights from unbiased scores.

  forced_ids_TK (routing replay, R3 arXiv 2510.11370): the experts to use instead of this top-k
  choice, e.g. the ones the inference engine chose for the same token. A token whose row holds a
  negative id keeps its own choice. The weights are computed from the scores at the used ids
  exactly as for an own choice, so the router still gets its gradient through them.
  """
  T, E = logits_TE.shape
  scores_TE = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
  choice_TE = scores_TE + bias_E.astype(jnp.float32)[None, :]
  if cfg.n_group > 1:
    choice_TGe = choice_TE.reshape(T, cfg.n_group, E // cfg.n_group)
    group_score_TG = jax.lax.top_k(choice_TGe, 2)[0].sum(-1)
    _, keep_groups_Tg = jax.lax.top_k(group_score_TG, cfg.topk_group)
    group_mask_TG = jnp.zeros_like(group_score_TG, bool).at[jnp.arange(T)[:, None], keep_groups_Tg].set(True)
    choice_TE = jnp.where(jnp.repeat(group_mask_TG, E // cfg.n_group, axis=1), choice_TE, -jnp.inf)
  _, expert_ids_TK = jax.lax.top_k(choice_TE, cfg.top_k)
  if forced_ids_TK is not None:
    replay_T1 = jnp.all(forced_ids_TK >= 0, axis=-1, keepdims=True)
    expert_ids_TK = jnp.where(replay_T1, forced_ids_TK.astype(expert_ids_TK.dtype), expert_ids_TK)
  weights_TK = jnp.take_along_axis(scores_TE, expert_ids_TK, axis=1)
  if cfg.norm_topk_prob:
    weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
  return Routing(expert_ids_TK.astype(jnp.int32), weights_TK * cfg.routed_scaling_factor, scores_TE)


def expert_load(expert_ids_TK: jax.Array, n_experts: int) -> jax.Array:
  """Assignments per expert [E] (float32)."""
  return jnp.zeros((n_experts,), jnp.float32).at[expert_ids_TK.reshape(-1)].add(1.0)


def sequence_balance_loss(scores_BTE: jax.Array, ids_BTK: jax.Array, n_experts: int) -> jax.Array:
  """DeepSeek-V3 eq. 17-20 per sequence: Σ_i f_i·P_i, f_i = E/(K·T)·count_i, P_i = mean_t s'_i."""
  B, T, K = ids_BTK.shape
  counts_BE = jax.vmap(lambda ids: expert_load(ids, n_experts))(ids_BTK)
  f_BE = counts_BE * n_experts / (K * T)
  p_BE = (scores_BTE / scores_BTE.sum(-1, keepdims=True)).mean(1)
  return (f_BE * p_BE).sum(-1).mean()


def update_router_bias(params: dict, expert_load_LE: jax.Array, rate: float) -> dict:
  """b ← b + rate·sign(mean_load − load) per MoE layer, outside the gradient (returns new params).

  `expert_load_LE` is `aux["expert_load"]` of a forward pass (one row per MoE layer, in order).
  """
  new_layers, moe_index = dict(params["layers"]), 0
  for name in sorted(params["layers"], key=int):
    layer = params["layers"][name]
    if "router_bias" not in layer.get("mlp", {}):
      continue
    load_E = expert_load_LE[moe_index]
    bias_E = layer["mlp"]["router_bias"]
    new_bias = bias_E + rate * jnp.sign(load_E.mean() - load_E).astype(bias_E.dtype)
    new_layers[name] = {**layer, "mlp": {**layer["mlp"], "router_bias": new_bias}}
    moe_index += 1
  return {**params, "layers": new_layers}


def capacity(n_assignments: int, n_experts: int, factor: float) -> int:
  """Slots per expert: ceil(assignments/E · factor), never more than all assignments."""
  return max(1, min(n_assignments, math.ceil(n_assignments / n_experts * factor)))


def sort_by_expert(expert_ids_A: jax.Array, n_experts: int):
  """Stable order of assignments by expert, group sizes [E], and each assignment's rank in its group."""
  expert_ids_A = jnp.asarray(expert_ids_A)
  order_A = jnp.argsort(expert_ids_A, stable=True)
  sizes_E = jnp.zeros((n_experts,), jnp.int32).at[expert_ids_A].add(1, mode="drop")
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  sorted_ids_A = expert_ids_A[order_A]
  rank_sorted_A = jnp.arange(expert_ids_A.shape[0]) - starts_E[jnp.clip(sorted_ids_A, 0, n_experts - 1)]
  rank_A = jnp.zeros_like(rank_sorted_A).at[order_A].set(rank_sorted_A)
  return order_A, sizes_E, starts_E, rank_A


def experts_ragged(x_AD, expert_ids_A, w_gate_EDF, w_up_EDF, w_down_EFD, dtype) -> jax.Array:
  """Dropless grouped SwiGLU: one row per assignment in, one out. Ids outside [0, E) give zeros."""
  E, F = w_gate_EDF.shape[0], w_gate_EDF.shape[2]
  order_A, sizes_E, _, _ = sort_by_expert(expert_ids_A, E)
  x_sorted = x_AD[order_A].astype(dtype)

  def grouped(x, w):
    return jax.lax.ragged_dot(x, w.astype(dtype), sizes_E, preferred_element_type=jnp.float32).astype(dtype)

  gate_up = grouped(x_sorted, jnp.concatenate([w_gate_EDF, w_up_EDF], axis=-1))  # one matmul, not two
  y_sorted = grouped(jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:], w_down_EFD)
  return jnp.zeros_like(y_sorted).at[order_A].set(y_sorted)


def experts_capacity(x_AD, expert_ids_A, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, slots: int):
  """Bucketed SwiGLU over [E, C, D]; returns (y_AD, dropped assignments). Ids outside [0, E) → 0."""
  E, A = w_gate_EDF.shape[0], x_AD.shape[0]
  order_A, sizes_E, starts_E, rank_A = sort_by_expert(expert_ids_A, E)
  # Slot (e, c) holds the c-th assignment of expert e, if there is one.
  slot_EC = starts_E[:, None] + jnp.arange(slots)[None, :]
  filled_EC = jnp.arange(slots)[None, :] < sizes_E[:, None]
  source_EC = order_A[jnp.clip(slot_EC, 0, A - 1)]
  x_ECD = jnp.where(filled_EC[..., None], x_AD[source_EC], 0).astype(dtype)
  F = w_gate_EDF.shape[2]
  gate_up_ECF = project("ecd,edf->ecf", x_ECD, jnp.concatenate([w_gate_EDF, w_up_EDF], axis=-1), dtype)
  y_ECD = project("ecf,efd->ecd", jax.nn.silu(gate_up_ECF[..., :F]) * gate_up_ECF[..., F:], w_down_EFD, dtype)
  valid_A = (expert_ids_A >= 0) & (expert_ids_A < E)
  kept_A = valid_A & (rank_A < slots)
  flat_slot_A = jnp.clip(expert_ids_A, 0, E - 1) * slots + jnp.clip(rank_A, 0, slots - 1)
  y_AD = jnp.where(kept_A[:, None], y_ECD.reshape(E * slots, -1)[flat_slot_A], 0)
  return y_AD, jnp.sum(valid_A & ~kept_A)


@jax.custom_vjp
def blocked_matmul(
  x_NbI: jax.Array, w_EIO: jax.Array, expert_N: jax.Array, used_blocks: jax.Array
) -> jax.Array:
  """y[n] = x[n] @ w[expert[n]] for the first `used_blocks` row blocks (the rest are zeros).

  One matmul per scan step; blocks past `used_blocks` (the static bound's slack) skip the
  matmul. A custom VJP so the weight gradient accumulates in place into one [E, I, O] buffer;
  plain autodiff of `w[expert[n]]` inside a scan materialises a [blocks, I, O] stack per layer.
  """
  return _blocked_forward(x_NbI, w_EIO, expert_N, used_blocks)


def _zeros_of_product(a_bK: jax.Array, b_KO: jax.Array) -> jax.Array:
  """Zeros shaped like a @ b that also carry both operands' shard_map (varying) type, so a
  `cond` branch that skips the matmul type-checks inside `shard_map` (the EP dispatch)."""
  return a_bK[:, :1] * b_KO[:1, :] * 0


def _blocked_forward(x_NbI, w_EIO, expert_N, used_blocks):

  def step(n, block):
    x_bI, expert = block
    y_bO = jax.lax.cond(
      n < used_blocks,
      lambda: jnp.dot(x_bI, w_EIO[expert], preferred_element_type=jnp.float32).astype(x_bI.dtype),
      lambda: _zeros_of_product(x_bI, w_EIO[expert]),
    )
    return n + 1, y_bO

  return jax.lax.scan(step, 0, (x_NbI, expert_N))[1]


def _blocked_fwd(x_NbI, w_EIO, expert_N, used_blocks):
  return _blocked_forward(x_NbI, w_EIO, expert_N, used_blocks), (x_NbI, w_EIO, expert_N, used_blocks)


def _blocked_bwd(residuals, dy_NbO):
  x_NbI, w_EIO, expert_N, used_blocks = residuals

  def step(carry, block):
    n, dw_EIO = carry
    x_bI, dy_bO, expert = block

    def grads():
      dx_bI = jnp.dot(dy_bO, w_EIO[expert].T, preferred_element_type=jnp.float32).astype(x_bI.dtype)
      return dx_bI, dw_EIO.at[expert].add(jnp.dot(x_bI.T, dy_bO, preferred_element_type=jnp.float32))

    skip = lambda: (_zeros_of_product(dy_bO, w_EIO[expert].T), dw_EIO)  # noqa: E731
    dx_bI, dw_EIO = jax.lax.cond(n < used_blocks, grads, skip)
    return (n + 1, dw_EIO), dx_bI

  init = (0, jnp.zeros_like(w_EIO, dtype=jnp.float32))
  (_, dw_EIO), dx_NbI = jax.lax.scan(step, init, (x_NbI, dy_NbO, expert_N))
  return dx_NbI, dw_EIO.astype(w_EIO.dtype), None, None


blocked_matmul.defvjp(_blocked_fwd, _blocked_bwd)


def experts_blocked(x_AD, expert_ids_A, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, block: int) -> jax.Array:
  """Dropless SwiGLU over row blocks that each belong to one expert.

  Assignments are sorted by expert and each expert's rows padded to a multiple of `block`, so
  the padding is < E·block rows (not a capacity factor's worth) and nothing is ever dropped.
  Each block multiplies by its own expert's weights (`blocked_matmul`). This is the CPU
  default: XLA:CPU runs `ragged_dot` as a dense masked matmul over all E groups. Ids outside
  [0, E) give zeros.
  """
  E, A, F = w_gate_EDF.shape[0], x_AD.shape[0], w_gate_EDF.shape[2]
  n_blocks = -(-A // block) + E  # Σ_e ceil(size_e/block) ≤ A/block + E
  order_A, sizes_E, starts_E, rank_A = sort_by_expert(expert_ids_A, E)
  padded_E = -(-sizes_E // block) * block
  padded_ends_E = jnp.cumsum(padded_E)
  padded_starts_E = padded_ends_E - padded_E
  # Row r of the padded layout belongs to expert e_r and holds that expert's (r - start)-th assignment.
  rows = jnp.arange(n_blocks * block)
  expert_R = jnp.minimum(jnp.searchsorted(padded_ends_E, rows, side="right"), E - 1)
  within_R = rows - padded_starts_E[expert_R]
  filled_R = (within_R < sizes_E[expert_R]) & (rows < padded_ends_E[-1])
  source_R = order_A[jnp.clip(starts_E[expert_R] + within_R, 0, A - 1)]
  x_NbD = jnp.where(filled_R[:, None], x_AD[source_R], 0).astype(dtype).reshape(n_blocks, block, -1)
  expert_N = expert_R[::block]
  w_gate_up_EDF = jnp.concatenate([w_gate_EDF, w_up_EDF], axis=-1).astype(dtype)  # one matmul for both
  used_blocks = padded_ends_E[-1] // block
  gate_up_NbF = blocked_matmul(x_NbD, w_gate_up_EDF, expert_N, used_blocks)
  h_NbF = jax.nn.silu(gate_up_NbF[..., :F]) * gate_up_NbF[..., F:]
  y_RD = blocked_matmul(h_NbF, w_down_EFD.astype(dtype), expert_N, used_blocks).reshape(n_blocks * block, -1)
  valid_A = (expert_ids_A >= 0) & (expert_ids_A < E)
  dest_A = padded_starts_E[jnp.clip(expert_ids_A, 0, E - 1)] + rank_A
  return jnp.where(valid_A[:, None], y_RD[jnp.clip(dest_A, 0, n_blocks * block - 1)], 0)


def experts_local(x_AD, expert_ids_A, w_gate, w_up, w_down, cfg: ModelConfig, slots: int):
  """The configured expert path on one device's assignments; returns (y_AD, dropped)."""
  if cfg.expert_impl == "ragged":
    return experts_ragged(x_AD, expert_ids_A, w_gate, w_up, w_down, cfg.dtype), jnp.zeros((), jnp.int32)
  if cfg.expert_impl == "blocked":
    y_AD = experts_blocked(x_AD, expert_ids_A, w_gate, w_up, w_down, cfg.dtype, cfg.expert_block)
    return y_AD, jnp.zeros((), jnp.int32)
  return experts_capacity(x_AD, expert_ids_A, w_gate, w_up, w_down, cfg.dtype, slots)


def combine(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
  """Σ_k w_k·y_k in float32 (weights stay fp32 as in the reference)."""
  return jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weights_TK)


def _expert_parallel(meshes, n_tokens: int) -> bool:
  """EP dispatch when there is an expert axis and the tokens split over all devices; otherwise
  (single device, or e.g. a decode step with fewer tokens than devices) the local path runs and
  XLA's sharding propagation moves the expert weights instead."""
  return meshes is not None and meshes.expert_parallelism > 1 and n_tokens % len(meshes.devices) == 0


class MoE(nnx.Module):
  """Shared experts (dense mesh) + routed experts (expert mesh) + router (dense mesh, fp32)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    E, D, F = cfg.n_experts, cfg.d_model, cfg.moe_mlp_dim
    self.router = nnx.Param(
      cfg.init_std * jax.random.normal(rngs.params(), (D, E), jnp.float32), out_sharding=("embed", None)
    )
    self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
    self.w_gate = param(rngs, cfg, (E, D, F), ("expert", "embed", "expert_mlp"))
    self.w_up = param(rngs, cfg, (E, D, F), ("expert", "embed", "expert_mlp"))
    self.w_down = param(rngs, cfg, (E, F, D), ("expert", "expert_mlp", "embed"))
    if cfg.n_shared_experts:
      self.shared = MLP(cfg, F * cfg.n_shared_experts, rngs)
    self.cfg = cfg

  def __call__(
    self, x_BTD: jax.Array, meshes=None, routed_experts_BTK: jax.Array | None = None
  ) -> tuple[jax.Array, dict]:
    """(y_BTD, aux); routed_experts_BTK replays a routing (see `route`); aux["routed_experts"] holds
    the experts used [B, T, K]."""
    from composer_jax.model import expert_parallel  # noqa: PLC0415  (cycle: it imports this module)

    cfg = self.cfg
    B, T, D = x_BTD.shape
    x_TD = x_BTD.reshape(B * T, D)
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), self.router[...].astype(jnp.float32))
    forced_TK = None if routed_experts_BTK is None else routed_experts_BTK.reshape(B * T, cfg.top_k)
    r = route(logits_TE, jax.lax.stop_gradient(self.router_bias[...]), cfg, forced_TK)
    weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
    if _expert_parallel(meshes, B * T):
      y_TKD, dropped = expert_parallel.dispatch(x_TD, r.expert_ids_TK, weights, cfg, meshes)
    else:
      A = B * T * cfg.top_k
      x_AD = jnp.repeat(x_TD, cfg.top_k, axis=0)
      slots = capacity(A, cfg.n_experts, cfg.capacity_factor)
      y_AD, dropped = experts_local(x_AD, r.expert_ids_TK.reshape(-1), *weights, cfg, slots)
      y_TKD = y_AD.reshape(B * T, cfg.top_k, D)
    y_BTD = combine(y_TKD, r.weights_TK).reshape(B, T, D).astype(x_BTD.dtype)
    if cfg.n_shared_experts:
      y_BTD = y_BTD + self.shared(x_BTD)
    aux = {
      "expert_load": expert_load(r.expert_ids_TK, cfg.n_experts),
      "overflow": dropped.astype(jnp.float32),
      "balance_loss": sequence_balance_loss(
        r.scores_TE.reshape(B, T, -1), r.expert_ids_TK.reshape(B, T, -1), cfg.n_experts
      ),
      "routed_experts": r.expert_ids_TK.reshape(B, T, cfg.top_k),
    }
    return y_BTD, aux
