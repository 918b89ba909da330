"""DeepSeek-V3 MoE: sigmoid router with aux-loss-free bias, shared + routed SwiGLU experts.

Shape suffixes: B batch, T time (or flattened tokens), D d_model, E experts, K top-k,
F expert hidden, G router groups, C capacity slots per expert.

Routing (DeepSeek-V3 §2.1.2, HF `DeepseekV3TopkRouter`): s = sigmoid(x·W) in float32; the bias
b is added for *selection only* (group-limited top-k); combine weights are the unbiased s of
the chosen experts, renormalised and × routed_scaling_factor. b gets no gradient: it is nudged
after each step by `update_router_bias` towards equal load (§2.1.2, "auxiliary-loss-free").
Routing replay (R3, arXiv 2510.11370) swaps the selection for given expert ids (in [0, E)) and
keeps the weight computation, so an RL trainer can use the experts its sampler chose.

Expert compute (`cfg.expert_impl`: blocked / ragged / capacity) lives in `experts.py`; with an
expert axis the tokens travel to their experts' devices first (`expert_parallel.dispatch`).
In the stacked layout (transformer.py) the router bias of all MoE layers is one [L, E] leaf.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax import backend, sharding
from composer_jax.model import expert_parallel
from composer_jax.model.config import ModelConfig
from composer_jax.model.experts import W_DOWN_AXES, W_GATE_AXES, W_UP_AXES, capacity, experts_local
from composer_jax.model.layers import MLP, RouterBias, param


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
  """b ← b + rate·sign(mean_load − load) for every MoE layer at once, outside the gradient.

  `expert_load_LE` is `aux["expert_load"]` of a forward pass: one row per MoE layer, in the order of
  the stacked `moe_layers` leaf whose router bias [L, E] this moves. Returns new params.
  """
  if "moe_layers" not in params:
    return params
  moe = params["moe_layers"]
  bias_LE = moe["mlp"]["router_bias"]
  load_LE = expert_load_LE.astype(jnp.float32)
  step_LE = jnp.sign(load_LE.mean(-1, keepdims=True) - load_LE)
  new_bias = bias_LE + (rate * step_LE).astype(bias_LE.dtype)
  return {**params, "moe_layers": {**moe, "mlp": {**moe["mlp"], "router_bias": new_bias}}}


def combine(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
  """Σ_k w_k·y_k in float32 (weights stay fp32 as in the reference)."""
  return jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weights_TK)


def _expert_parallel(meshes, n_tokens: int) -> bool:
  """EP dispatch when there is an expert axis and the tokens split over all devices; otherwise
  (single device, or e.g. a decode step with fewer tokens than devices) the local path runs and
  XLA's sharding propagation moves the expert weights instead."""
  return (
    meshes is not None and meshes.expert_parallelism > 1 and n_tokens % sharding.degrees(meshes).devices == 0
  )


def padded_length(meshes, rows: int, length: int) -> int:
  """The sequence length to pad a call's tokens to so that the EP path takes them: `length` itself when
  it does (or no EP is possible), else the next one whose rows × length split over every device and
  whose positions split over the context axis. A decode step has one token per row: Kimi's 256 rollouts
  on 1024 chips otherwise take the local path, which all-gathers every expert's weights (270 GB per chip
  per token in XLA:TPU's count); padded to 4 positions they are one token per chip."""
  if meshes is None or meshes.expert_parallelism <= 1 or _expert_parallel(meshes, rows * length):
    return length
  deg = sharding.degrees(meshes)
  devices, context = deg.devices, deg.seq
  for padded in range(length + 1, length + devices + 1):
    if (rows * padded) % devices == 0 and padded % context == 0:
      return padded
  return length


def resolve(cfg: ModelConfig, meshes, expert_parallel_path: bool) -> ModelConfig:
  """`cfg` with `expert_impl` resolved for this call (`backend.expert_impl`). tokamax's Mosaic kernels
  run only inside `shard_map` (the EP dispatch) or on one device; elsewhere they fall back to "ragged"."""
  impl = backend.expert_impl(cfg.expert_impl, meshes)
  if impl == "tokamax" and meshes is not None and not expert_parallel_path:
    impl = "ragged"
  backend.chosen("expert_impl", impl)
  return cfg if impl == cfg.expert_impl else dataclasses.replace(cfg, expert_impl=impl)


class MoE(nnx.Module):
  """Shared experts (dense mesh) + routed experts (expert mesh) + router (dense mesh, fp32)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    E, D, F = cfg.n_experts, cfg.d_model, cfg.moe_mlp_dim
    self.router = nnx.Param(
      cfg.init_std * jax.random.normal(rngs.params(), (D, E), jnp.float32), out_sharding=("embed", None)
    )
    self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
    self.w_gate = param(rngs, cfg, (E, D, F), W_GATE_AXES)
    self.w_up = param(rngs, cfg, (E, D, F), W_UP_AXES)
    self.w_down = param(rngs, cfg, (E, F, D), W_DOWN_AXES)
    if cfg.n_shared_experts:
      self.shared = MLP(cfg, F * cfg.n_shared_experts, rngs)
    self.cfg = cfg

  def __call__(
    self, x_BTD: jax.Array, meshes=None, routed_experts_BTK: jax.Array | None = None
  ) -> tuple[jax.Array, dict]:
    """(y_BTD, aux); routed_experts_BTK replays a routing (see `route`); aux["routed_experts"] holds
    the experts used [B, T, K]."""
    cfg = self.cfg
    B, T_real, D = x_BTD.shape
    T = padded_length(meshes, B, T_real)
    if T > T_real:  # padding positions: routed like any token, their outputs and experts dropped below
      x_BTD = jnp.pad(x_BTD, ((0, 0), (0, T - T_real), (0, 0)))
      if routed_experts_BTK is not None:
        routed_experts_BTK = jnp.pad(
          routed_experts_BTK, ((0, 0), (0, T - T_real), (0, 0)), constant_values=-1
        )
    ep = _expert_parallel(meshes, B * T)
    if ep:  # tokens in the order the expert mesh takes them: each device's own tokens, contiguous
      flatten = functools.partial(expert_parallel.device_major, meshes=meshes)
      unflatten = functools.partial(expert_parallel.from_device_major, batch=B, meshes=meshes)
    else:
      flatten = lambda x_BT: x_BT.reshape(B * T, *x_BT.shape[2:])  # noqa: E731
      unflatten = lambda x_T: x_T.reshape(B, T, *x_T.shape[1:])  # noqa: E731
    x_TD = flatten(x_BTD)
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), self.router[...].astype(jnp.float32))
    forced_TK = None if routed_experts_BTK is None else flatten(routed_experts_BTK)
    r = route(logits_TE, jax.lax.stop_gradient(self.router_bias[...]), cfg, forced_TK)
    weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
    cfg = resolve(cfg, meshes, ep)
    if ep:
      y_TKD, dropped = expert_parallel.dispatch(x_TD, r.expert_ids_TK, weights, cfg, meshes)
    else:
      A = B * T * cfg.top_k
      slots = capacity(A, cfg.n_experts, cfg.capacity_factor)
      where = backend.platform(meshes)
      y_AD, dropped = experts_local(x_TD, r.expert_ids_TK.reshape(-1), *weights, cfg, slots, cfg.top_k, where)
      y_TKD = y_AD.reshape(B * T, cfg.top_k, D)
    y_BTD = unflatten(combine(y_TKD, r.weights_TK)).astype(x_BTD.dtype)
    if cfg.n_shared_experts:
      y_BTD = y_BTD + self.shared(x_BTD)
    ids_BTK, scores_BTE = unflatten(r.expert_ids_TK)[:, :T_real], unflatten(r.scores_TE)[:, :T_real]
    aux = {
      "expert_load": expert_load(ids_BTK.reshape(-1, cfg.top_k), cfg.n_experts),
      "overflow": dropped.astype(jnp.float32),
      "balance_loss": sequence_balance_loss(scores_BTE, ids_BTK, cfg.n_experts),
      "routed_experts": ids_BTK,
    }
    return y_BTD[:, :T_real], aux
