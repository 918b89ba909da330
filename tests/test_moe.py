"""DeepSeek-V3 routing and the expert paths, each against an independent NumPy computation.

Shape suffixes: T tokens, K top-k, E experts, G router groups, D d_model, F expert hidden,
A assignments (T·K), S source devices, P destination devices.

References follow HF `DeepseekV3TopkRouter` / `DeepseekV3MoE` (transformers' modeling_deepseek_v3.py):
sigmoid scores, bias added for selection only, group score = sum of the top 2 per group, keep
`topk_group` groups, weights = unbiased scores of the chosen experts, renormalised, × routed_scaling_factor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax.model import ModelConfig, expert_parallel, experts, moe

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, moe_mlp_dim=16, first_k_dense=1)


def _cfg(**overrides) -> ModelConfig:
  return ModelConfig(**(BASE | overrides))


# --- NumPy references --------------------------------------------------------------------------


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def _silu(x):
  return x * _sigmoid(x)


def np_route(logits_TE, bias_E, cfg: ModelConfig):
  """HF DeepseekV3TopkRouter.get_topk_indices + weights, written from the reference, in float64."""
  T, E = logits_TE.shape
  scores_TE = _sigmoid(logits_TE)
  choice_TE = scores_TE + bias_E[None, :]
  per_group = E // cfg.n_group
  grouped_TGe = choice_TE.reshape(T, cfg.n_group, per_group)
  group_scores_TG = np.sort(grouped_TGe, axis=-1)[..., -2:].sum(-1)
  kept_groups_Tg = np.argsort(-group_scores_TG, axis=-1, kind="stable")[:, : cfg.topk_group]
  group_mask_TG = np.zeros((T, cfg.n_group), bool)
  np.put_along_axis(group_mask_TG, kept_groups_Tg, True, axis=-1)
  masked_TE = np.where(np.repeat(group_mask_TG, per_group, axis=-1), choice_TE, -np.inf)
  ids_TK = np.argsort(-masked_TE, axis=-1, kind="stable")[:, : cfg.top_k]
  weights_TK = np.take_along_axis(scores_TE, ids_TK, axis=-1)
  if cfg.norm_topk_prob:
    weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
  return ids_TK, weights_TK * cfg.routed_scaling_factor


def np_swiglu(x_D, w_gate_DF, w_up_DF, w_down_FD):
  x_D = x_D.astype(np.float64)
  return (_silu(x_D @ w_gate_DF) * (x_D @ w_up_DF)) @ w_down_FD


def np_expert_rows(x_AD, ids_A, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Each assignment through its own expert (no batching, no sorting)."""
  rows = [np_swiglu(x, w_gate_EDF[e], w_up_EDF[e], w_down_EFD[e]) for x, e in zip(x_AD, ids_A, strict=True)]
  return np.stack(rows)


def first_come_kept(ids_A, slots: int, n_experts: int):
  """Capacity semantics: the first `slots` assignments of each expert (in assignment order) run."""
  seen = np.zeros(n_experts, int)
  kept = np.zeros(len(ids_A), bool)
  for a, e in enumerate(ids_A):
    kept[a] = seen[e] < slots
    seen[e] += 1
  return kept


def _sorted_by_id(ids_TK, weights_TK):
  order = np.argsort(ids_TK, axis=-1)
  return np.take_along_axis(ids_TK, order, -1), np.take_along_axis(weights_TK, order, -1)


def _random_expert_weights(rng, E, D, F):
  return tuple(
    (0.3 * rng.standard_normal(shape)).astype(np.float32) for shape in ((E, D, F), (E, D, F), (E, F, D))
  )


# --- routing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "overrides",
  [
    dict(n_experts=8, n_group=1, topk_group=1, top_k=2),
    dict(n_experts=8, n_group=4, topk_group=2, top_k=2, routed_scaling_factor=2.5),
    dict(n_experts=16, n_group=4, topk_group=2, top_k=4, routed_scaling_factor=2.827),
    dict(n_experts=16, n_group=8, topk_group=3, top_k=3, norm_topk_prob=False),
  ],
  ids=["flat", "g4k2", "g4k4", "g8_unnormalised"],
)
def test_route_matches_numpy_reference(overrides):
  cfg = _cfg(**overrides)
  rng = np.random.default_rng(0)
  logits_TE = rng.standard_normal((64, cfg.n_experts)).astype(np.float32)
  bias_E = (0.3 * rng.standard_normal(cfg.n_experts)).astype(np.float32)  # large enough to flip choices
  r = jax.jit(moe.route, static_argnums=2)(logits_TE, bias_E, cfg)
  ids_TK, weights_TK = _sorted_by_id(np.asarray(r.expert_ids_TK), np.asarray(r.weights_TK))
  ref_ids_TK, ref_weights_TK = _sorted_by_id(*np_route(logits_TE, bias_E, cfg))
  np.testing.assert_array_equal(ids_TK, ref_ids_TK)
  np.testing.assert_allclose(weights_TK, ref_weights_TK, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(r.scores_TE), _sigmoid(logits_TE), rtol=1e-6)
  assert r.expert_ids_TK.dtype == jnp.int32 and r.weights_TK.dtype == jnp.float32
  if cfg.n_group > 1:  # the group limit must matter on these inputs, or this test proves nothing
    ungrouped_ids, _ = np_route(logits_TE, bias_E, _cfg(**(overrides | dict(n_group=1, topk_group=1))))
    assert (np.sort(ungrouped_ids, -1) != ref_ids_TK).any()


def test_bias_selects_but_does_not_weight():
  cfg = _cfg(n_experts=8, n_group=1, topk_group=1, top_k=2, routed_scaling_factor=2.5)
  logits_TE = np.array([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]], np.float32)
  route = jax.jit(moe.route, static_argnums=2)
  unbiased = route(logits_TE, np.zeros(8, np.float32), cfg)
  assert sorted(np.asarray(unbiased.expert_ids_TK)[0]) == [0, 1]

  bias_E = np.zeros(8, np.float32)
  bias_E[6] = 2.0  # sigmoid(-3) + 2 beats every unbiased score
  biased = route(logits_TE, bias_E, cfg)
  ids, weights = _sorted_by_id(np.asarray(biased.expert_ids_TK), np.asarray(biased.weights_TK))
  np.testing.assert_array_equal(ids, [[0, 6]])
  s0, s6 = 1 / (1 + math.exp(-3.0)), 1 / (1 + math.exp(3.0))
  np.testing.assert_allclose(weights, [[2.5 * s0 / (s0 + s6), 2.5 * s6 / (s0 + s6)]], rtol=1e-6)


def test_route_replays_forced_ids_with_the_same_weights():
  """Routing replay (R3): the given experts are used, even ones the group limit would exclude, with
  weights from the unbiased scores at those experts; a row holding a negative id keeps its own choice."""
  cfg = _cfg(n_experts=16, n_group=4, topk_group=2, top_k=4, routed_scaling_factor=2.827)
  rng = np.random.default_rng(6)
  T = 32
  logits_TE = rng.standard_normal((T, cfg.n_experts)).astype(np.float32)
  bias_E = (0.3 * rng.standard_normal(cfg.n_experts)).astype(np.float32)
  forced_TK = np.argsort(rng.standard_normal((T, cfg.n_experts)), -1)[:, : cfg.top_k].astype(np.int32)
  forced_TK[:5, 1] = -1
  r = jax.jit(moe.route, static_argnums=2)(logits_TE, bias_E, cfg, forced_TK)
  ids_TK = np.asarray(r.expert_ids_TK)
  own_ids_TK, _ = np_route(logits_TE, bias_E, cfg)
  np.testing.assert_array_equal(ids_TK[5:], forced_TK[5:])
  np.testing.assert_array_equal(np.sort(ids_TK[:5], -1), np.sort(own_ids_TK[:5], -1))
  assert (np.sort(forced_TK[5:], -1) != np.sort(own_ids_TK[5:], -1)).any()
  s_TK = _sigmoid(np.take_along_axis(logits_TE, ids_TK, -1))
  np.testing.assert_allclose(r.weights_TK, 2.827 * s_TK / s_TK.sum(-1, keepdims=True), rtol=1e-6)


# --- the MoE layer against a hand computation ---------------------------------------------------


def _designed_inputs(cfg: ModelConfig, rng):
  """Tokens x [B, T, D] and a router whose logits are exactly `logits_TE` (x has full row rank,
  so W = pinv(x)·L solves x·W = L): token t strongly prefers experts first_T[t] then second_T[t]."""
  Bt, Tt = 2, 8
  n_tokens = Bt * Tt
  x_TD = rng.standard_normal((n_tokens, cfg.d_model)).astype(np.float32)
  first_T = rng.integers(0, cfg.n_experts, n_tokens)
  second_T = (first_T + rng.integers(1, cfg.n_experts, n_tokens)) % cfg.n_experts
  logits_TE = np.full((n_tokens, cfg.n_experts), -6.0)
  logits_TE[np.arange(n_tokens), first_T] = 3.0
  logits_TE[np.arange(n_tokens), second_T] = 1.0
  router_DE = (np.linalg.pinv(x_TD.astype(np.float64)) @ logits_TE).astype(np.float32)
  return x_TD.reshape(Bt, Tt, -1), router_DE, np.stack([first_T, second_T], -1), logits_TE


@pytest.mark.parametrize(
  "impl, capacity_factor",
  [("capacity", 8.0), ("ragged", 8.0), ("blocked", 0.5), ("dense", 0.5), ("capacity", 0.5)],
  ids=["capacity", "ragged", "blocked", "dense", "capacity_overflow"],
)
def test_moe_layer_matches_hand_computation(impl, capacity_factor):
  cfg = _cfg(
    n_experts=8,
    n_group=4,
    topk_group=2,
    top_k=2,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    expert_impl=impl,
    capacity_factor=capacity_factor,
  )
  rng = np.random.default_rng(1)
  x_BTD, router_DE, ids_TK, logits_TE = _designed_inputs(cfg, rng)
  with nnx.use_eager_sharding(False):  # abstract: every value is replaced below
    graphdef, state = nnx.split(nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(0))))
  values = nnx.to_pure_dict(state)
  w_gate, w_up, w_down = _random_expert_weights(rng, cfg.n_experts, cfg.d_model, cfg.moe_mlp_dim)
  shared = {k: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in values["shared"].items()}
  # A bias that is small next to the designed margins: it must not change the choice.
  bias_E = (0.01 * rng.standard_normal(cfg.n_experts)).astype(np.float32)
  values.update(router=router_DE, router_bias=bias_E, w_gate=w_gate, w_up=w_up, w_down=w_down, shared=shared)
  nnx.replace_by_pure_dict(state, values)
  y_BTD, aux = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x_BTD)

  # By hand: weights from the designed logits, experts and shared MLP row by row.
  x_TD = x_BTD.reshape(-1, cfg.d_model)
  scores_TK = _sigmoid(np.take_along_axis(logits_TE, ids_TK, -1))
  weights_TK = cfg.routed_scaling_factor * scores_TK / scores_TK.sum(-1, keepdims=True)
  ids_A = ids_TK.reshape(-1)
  y_AD = np_expert_rows(np.repeat(x_TD, 2, axis=0), ids_A, w_gate, w_up, w_down)
  slots = math.ceil(len(ids_A) / cfg.n_experts * capacity_factor)
  kept_A = first_come_kept(ids_A, slots, cfg.n_experts) if impl == "capacity" else np.ones(len(ids_A), bool)
  # (The blocked path is dropless whatever the capacity factor.)
  y_TKD = (y_AD * kept_A[:, None]).reshape(-1, 2, cfg.d_model)
  expected_TD = np.einsum("tkd,tk->td", y_TKD, weights_TK) + np_swiglu(
    x_TD, shared["gate_proj"], shared["up_proj"], shared["down_proj"]
  )
  np.testing.assert_allclose(np.asarray(y_BTD).reshape(-1, cfg.d_model), expected_TD, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(aux["expert_load"], np.bincount(ids_A, minlength=cfg.n_experts))
  assert float(aux["overflow"]) == np.sum(~kept_A)
  if capacity_factor < 1 and impl == "capacity":
    assert np.sum(~kept_A) > 0  # the small capacity really overflows on these inputs


@pytest.mark.parametrize("impl", ["capacity", "ragged", "blocked", "dense"])
def test_moe_layer_replays_given_experts_and_router_gets_gradient(impl):
  """Forced experts (not the designed choice) against a hand computation, and the router's gradient
  against autodiff of that hand computation's combine weights (expert outputs held fixed)."""
  cfg = _cfg(n_experts=8, top_k=2, routed_scaling_factor=2.5, n_shared_experts=0, expert_impl=impl)
  rng = np.random.default_rng(8)
  x_BTD, router_DE, own_TK, _ = _designed_inputs(cfg, rng)
  forced_TK = (own_TK + 3) % cfg.n_experts  # never the designed choice
  with nnx.use_eager_sharding(False):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(0))))
  values = nnx.to_pure_dict(state)
  w_gate, w_up, w_down = _random_expert_weights(rng, cfg.n_experts, cfg.d_model, cfg.moe_mlp_dim)
  values.update(router_bias=np.zeros(cfg.n_experts, np.float32), w_gate=w_gate, w_up=w_up, w_down=w_down)
  cot_BTD = rng.standard_normal(x_BTD.shape).astype(np.float32)
  forced_BTK = forced_TK.reshape(*x_BTD.shape[:2], cfg.top_k)

  @jax.jit
  def run(router_DE):
    s = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(s, values | {"router": router_DE})
    y_BTD, aux = nnx.merge(graphdef, s)(x_BTD, None, forced_BTK)
    return jnp.sum(y_BTD * cot_BTD), (y_BTD, aux)

  (_, (y_BTD, aux)), g_router = jax.value_and_grad(run, has_aux=True)(router_DE)
  np.testing.assert_array_equal(aux["routed_experts"], forced_BTK)
  x_TD = x_BTD.reshape(-1, cfg.d_model)
  y_TKD = np_expert_rows(np.repeat(x_TD, 2, axis=0), forced_TK.reshape(-1), w_gate, w_up, w_down)
  y_TKD = y_TKD.reshape(-1, 2, cfg.d_model)

  def by_hand(router):
    s_TK = jax.nn.sigmoid(jnp.take_along_axis(jnp.asarray(x_TD) @ router, jnp.asarray(forced_TK), axis=-1))
    w_TK = cfg.routed_scaling_factor * s_TK / s_TK.sum(-1, keepdims=True)
    return jnp.einsum("tkd,tk->td", jnp.asarray(y_TKD, jnp.float32), w_TK)

  np.testing.assert_allclose(
    np.asarray(y_BTD).reshape(-1, cfg.d_model), by_hand(router_DE), rtol=1e-5, atol=1e-5
  )
  want_DE = jax.grad(lambda r: jnp.sum(by_hand(r) * cot_BTD.reshape(-1, cfg.d_model)))(router_DE)
  assert float(jnp.max(jnp.abs(want_DE))) > 1e-3
  np.testing.assert_allclose(g_router, want_DE, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want_DE))))


# --- expert paths ------------------------------------------------------------------------------


_experts_ragged = jax.jit(experts.experts_ragged, static_argnums=5)
_experts_capacity = jax.jit(experts.experts_capacity, static_argnums=(5, 6))
_experts_blocked = jax.jit(experts.experts_blocked, static_argnums=(5, 6))


def test_capacity_and_ragged_paths_match_reference():
  E, D, F, A = 8, 32, 16, 48
  rng = np.random.default_rng(2)
  x_AD = rng.standard_normal((A, D)).astype(np.float32)
  ids_A = rng.integers(0, E, A).astype(np.int32)
  weights = _random_expert_weights(rng, E, D, F)
  expected_AD = np_expert_rows(x_AD, ids_A, *weights)
  y_ragged = _experts_ragged(x_AD, ids_A, *weights, "float32")
  y_capacity, dropped = _experts_capacity(x_AD, ids_A, *weights, "float32", A)
  np.testing.assert_allclose(y_ragged, expected_AD, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y_capacity, expected_AD, rtol=1e-5, atol=1e-5)
  assert int(dropped) == 0


def test_ragged_path_zeroes_rows_a_kernel_leaves_behind():
  """A grouped-matmul kernel (tokamax) may leave the rows past Σ group sizes (ids outside [0, E): empty
  EP slots) as they were; the ragged path must still return zeros there. A stand-in kernel that writes
  garbage there runs the same code on CPU."""
  E, D, F, A = 8, 32, 16, 40
  rng = np.random.default_rng(12)
  x_AD = rng.standard_normal((A, D)).astype(np.float32)
  ids_A = rng.integers(0, E, A).astype(np.int32)
  ids_A[:5] = E
  weights = _random_expert_weights(rng, E, D, F)

  def sloppy(x, w, sizes, preferred_element_type=None):
    y = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=preferred_element_type)
    return jnp.where(jnp.arange(x.shape[0])[:, None] < jnp.sum(sizes), y, 7.0)

  y_AD = jax.jit(lambda *a: experts.experts_ragged(*a, "float32", 1, sloppy))(x_AD, ids_A, *weights)
  expected_AD = np.zeros((A, D))
  expected_AD[5:] = np_expert_rows(x_AD[5:], ids_A[5:], *weights)
  np.testing.assert_allclose(y_AD, expected_AD, rtol=1e-5, atol=1e-5)


def _tokamax_kernel():
  """tokamax's grouped matmul for this platform and the context to trace it in: on CPU the Mosaic TPU
  kernel in Pallas interpret mode, traced for a v5p TensorCore (Mosaic reads the chip's tiling)."""
  pytest.importorskip("tokamax", reason="tokamax is not installed (extra `kernels`)")
  platform = jax.devices()[0].platform
  if platform in ("tpu", "gpu"):
    return experts.tokamax_ragged_dot(platform), contextlib.nullcontext()
  v5p = jax.sharding.AbstractDevice(device_kind="TPU v5", num_cores=1, platform="tpu")
  mesh = jax.sharding.AbstractMesh((1,), ("one",), abstract_device=v5p)
  return experts.tokamax_ragged_dot("tpu", interpret=True), jax.sharding.use_abstract_mesh(mesh)


def test_tokamax_expert_kernel_matches_ragged():
  """tokamax's grouped matmul (Mosaic on TPU, Triton on GPU, Mosaic interpreted on CPU) against
  jax.lax.ragged_dot: values and all four gradients, with out-of-range ids (empty EP slots) whose rows
  the kernel leaves unwritten; and the kernel, not tokamax's XLA fallback, must be what ran."""
  kernel, context = _tokamax_kernel()
  E, D, F, A = 4, 128, 128, 256
  rng = np.random.default_rng(13)
  x_AD = rng.standard_normal((A, D)).astype(np.float32)
  ids_A = rng.integers(0, E, A).astype(np.int32)
  ids_A[:20] = E
  weights = _random_expert_weights(rng, E, D, F)
  cot_AD = rng.standard_normal((A, D)).astype(np.float32)

  def loss(ragged_dot):
    return lambda x, *ws: jnp.sum(experts.experts_ragged(x, ids_A, *ws, "float32", 1, ragged_dot) * cot_AD)

  with context:
    assert "pallas_call" in str(jax.make_jaxpr(loss(kernel))(x_AD, *weights))
    got, got_grads = jax.jit(jax.value_and_grad(loss(kernel), argnums=(0, 1, 2, 3)))(x_AD, *weights)
  want, want_grads = jax.jit(jax.value_and_grad(loss(jax.lax.ragged_dot), argnums=(0, 1, 2, 3)))(
    x_AD, *weights
  )
  np.testing.assert_allclose(got, want, rtol=2e-2)
  for g, w in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())


@pytest.mark.parametrize("used", [0, 13, 24, 48])
def test_row_chunked_ragged_path_equals_one_pass(used):
  """The ragged path in 4 row chunks (`model.expert_chunks`) against one pass: values and all four
  gradients, with the assigned rows ending mid-chunk, at a chunk edge, filling all, or none (a padded
  EP receive buffer: ids outside [0, E) past them); skewed load, an empty expert."""
  E, D, F, A = 4, 32, 16, 48
  rng = np.random.default_rng(21)
  x_AD = rng.standard_normal((A, D)).astype(np.float32)
  ids_A = np.full(A, E, np.int32)
  ids_A[rng.permutation(A)[:used]] = rng.choice(E, used, p=[0.6, 0.3, 0.1, 0.0])
  weights = _random_expert_weights(rng, E, D, F)
  cot_AD = rng.standard_normal((A, D)).astype(np.float32)

  def value_and_grads(chunks):
    def loss(x, *ws):
      return jnp.sum(experts.experts_ragged(x, ids_A, *ws, "float32", 1, jax.lax.ragged_dot, chunks) * cot_AD)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x_AD, *weights)

  want, want_grads = value_and_grads(1)
  got, got_grads = value_and_grads(4)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, w in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(np.abs(w).max(), 1.0))
  if used:
    assert float(np.abs(want_grads[1]).max()) > 1e-3


@pytest.mark.parametrize("chunks", [1, 4])
def test_presorted_rows_skip_the_sort_and_match(chunks):
  """Rows already grouped by expert with the assigned ones first and zeros after (a ragged EP receive
  buffer): the presorted path gives the sorting path's values and gradients on the assigned rows."""
  E, D, F, A, used = 2, 16, 8, 32, 21
  rng = np.random.default_rng(23)
  x_AD = rng.standard_normal((A, D)).astype(np.float32)
  x_AD[used:] = 0
  ids_A = np.full(A, E, np.int32)
  ids_A[:used] = np.sort(rng.integers(0, E, used))
  weights = _random_expert_weights(rng, E, D, F)
  cot_AD = rng.standard_normal((A, D)).astype(np.float32)
  cot_AD[used:] = 0  # the caller reads no row past the assigned ones

  def value_and_grads(presorted):
    def loss(x, *ws):
      y = experts.experts_ragged(x, ids_A, *ws, "float32", 1, jax.lax.ragged_dot, chunks, None, presorted)
      return jnp.sum(y * cot_AD), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x_AD, *weights)

  (_, want_y), want = value_and_grads(False)
  (_, got_y), got = value_and_grads(True)
  np.testing.assert_allclose(
    np.asarray(got_y)[:used], np_expert_rows(x_AD[:used], ids_A[:used], *weights), rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(np.asarray(got_y)[:used], np.asarray(want_y)[:used], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[0])[:used], np.asarray(want[0])[:used], rtol=1e-5, atol=1e-5)
  for g, w in zip(got[1:], want[1:], strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_row_chunks_run_only_the_chunks_holding_rows():
  """The chunk loop's trip count is the chunks that hold assigned rows, forward and backward: a kernel
  that counts its calls (through a host callback) sees ceil(used / rows per chunk) × 2 matmuls forward,
  and again in the backward pass (its recomputed forward) plus the transposes."""
  E, D, F, A, chunks = 2, 8, 8, 64, 8  # 8 rows per chunk
  rng = np.random.default_rng(22)
  x_AD = rng.standard_normal((A, D)).astype(np.float32)
  ids_A = np.full(A, E, np.int32)
  ids_A[:19] = rng.integers(0, E, 19)  # 19 rows: 3 chunks
  weights = _random_expert_weights(rng, E, D, F)
  calls = []

  def counting(x, w, sizes, preferred_element_type=None):
    jax.debug.callback(lambda: calls.append(1))
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=preferred_element_type)

  y = jax.jit(lambda x, *ws: experts.experts_ragged(x, ids_A, *ws, "float32", 1, counting, chunks))(
    x_AD, *weights
  )
  jax.block_until_ready(y)
  assert len(calls) == 3 * 2
  expected_AD = np.zeros((A, D))
  expected_AD[:19] = np_expert_rows(x_AD[:19], ids_A[:19], *weights)
  np.testing.assert_allclose(y, expected_AD, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="must divide"):
    experts.experts_ragged(x_AD[:60], ids_A[:60], *weights, "float32", 1, jax.lax.ragged_dot, chunks)


def test_expected_chunks_for_the_cost_model():
  # A buffer of 2x the balanced share in 16 chunks: the share fills 8, one more for a busier device.
  assert experts.expected_chunks(98304, 196608, 16) == 9
  assert experts.expected_chunks(100, 100, 4) == 4  # no padding: every chunk, nothing added
  assert experts.expected_chunks(10, 400, 4) == 2
  assert experts.expected_chunks(390, 400, 4) == 4  # capped at all chunks


@pytest.mark.parametrize("block", [5, 64])
def test_blocked_path_is_dropless_with_exact_gradients(block):
  """Skewed load (one expert takes half), empty experts and out-of-range ids; values and grads."""
  E, D, F, A = 8, 32, 16, 48
  rng = np.random.default_rng(9)
  x_AD = rng.standard_normal((A, D)).astype(np.float32)
  ids_A = rng.choice(E, A, p=[0.5, 0.2, 0.1, 0.1, 0.1, 0.0, 0.0, 0.0]).astype(np.int32)
  ids_A[:2] = E  # empty EP slots: zeros, no gradient
  weights = _random_expert_weights(rng, E, D, F)
  valid_A = ids_A < E
  expected_AD = np.zeros((A, D))
  expected_AD[valid_A] = np_expert_rows(x_AD[valid_A], ids_A[valid_A], *weights)
  np.testing.assert_allclose(
    _experts_blocked(x_AD, ids_A, *weights, "float32", block), expected_AD, rtol=1e-5, atol=1e-5
  )
  # Gradients against the ragged_dot path (itself checked against NumPy above), same cotangent.
  cot_AD = rng.standard_normal((A, D)).astype(np.float32)

  def grads(fn):
    return jax.jit(
      jax.grad(lambda x, wg, wu, wd: jnp.sum(fn(x, ids_A, wg, wu, wd) * cot_AD), argnums=(0, 1, 2, 3))
    )(x_AD, *weights)

  blocked = grads(lambda *a: experts.experts_blocked(*a, "float32", block))
  ragged = grads(lambda *a: experts.experts_ragged(*a, "float32"))
  for g_blocked, g_ragged in zip(blocked, ragged, strict=True):
    np.testing.assert_allclose(g_blocked, g_ragged, rtol=1e-5, atol=1e-4 * np.abs(g_ragged).max())


def test_capacity_path_drops_and_counts_overflow():
  E, D, F, A, slots = 8, 32, 16, 48, 4
  rng = np.random.default_rng(3)
  x_AD = rng.standard_normal((A, D)).astype(np.float32)
  ids_A = rng.choice(E, A, p=[0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.0]).astype(np.int32)
  ids_A[:3] = E  # out-of-range ids (empty EP slots) give zeros and are not overflow
  weights = _random_expert_weights(rng, E, D, F)
  y_AD, dropped = _experts_capacity(x_AD, ids_A, *weights, "float32", slots)
  valid_A = ids_A < E
  counts_E = np.bincount(ids_A[valid_A], minlength=E)
  assert int(dropped) == np.maximum(counts_E - slots, 0).sum() > 0
  kept_A = np.zeros(A, bool)
  kept_A[valid_A] = first_come_kept(ids_A[valid_A], slots, E)
  expected_AD = np.zeros((A, D))
  expected_AD[kept_A] = np_expert_rows(x_AD[kept_A], ids_A[kept_A], *weights)
  np.testing.assert_allclose(y_AD, expected_AD, rtol=1e-5, atol=1e-5)


# --- load balancing ----------------------------------------------------------------------------


def test_update_router_bias_moves_towards_balance():
  """One stacked [L_moe, E] bias, one load row per MoE layer; every other leaf is passed through."""
  rng = np.random.default_rng(4)
  params = {
    "embed": rng.standard_normal((4, 2)),
    "dense_layers": {"mlp": {"gate_proj": rng.standard_normal((1, 2, 3))}},
    "moe_layers": {
      "mlp": {
        "router": rng.standard_normal((2, 2, 8)),
        "router_bias": np.stack([np.zeros(8, np.float32), np.full(8, 0.5, np.float32)]),
      },
      "attn": {"o_proj": rng.standard_normal((2, 2, 2))},
    },
  }
  load_LE = np.array([[10, 2, 6, 6, 6, 6, 6, 6], [1, 1, 1, 1, 1, 1, 1, 9]], np.float32)  # means 6 and 2
  rate = 1e-2
  new = moe.update_router_bias(params, jnp.asarray(load_LE), rate)
  expected_1 = rate * np.array([-1, 1, 0, 0, 0, 0, 0, 0])  # overloaded down, underloaded up, balanced kept
  expected_2 = 0.5 + rate * np.array([1, 1, 1, 1, 1, 1, 1, -1])
  np.testing.assert_allclose(new["moe_layers"]["mlp"]["router_bias"][0], expected_1, atol=1e-9)
  np.testing.assert_allclose(new["moe_layers"]["mlp"]["router_bias"][1], expected_2, atol=1e-7)
  new_leaves = jax.tree_util.tree_leaves_with_path(new)
  old_leaves = dict(jax.tree_util.tree_leaves_with_path(params))
  assert len(new_leaves) == len(old_leaves)
  for path, leaf in new_leaves:
    if "router_bias" not in jax.tree_util.keystr(path):
      assert leaf is old_leaves[path], jax.tree_util.keystr(path)
  np.testing.assert_array_equal(params["moe_layers"]["mlp"]["router_bias"][0], 0)  # the input is not mutated
  no_moe = {"embed": params["embed"], "dense_layers": params["dense_layers"]}
  assert moe.update_router_bias(no_moe, jnp.zeros((0, 8)), rate) is no_moe


def np_sequence_balance_loss(scores_BTE, ids_BTK, E):
  """DeepSeek-V3 eqs. 17-20, loop by loop: Σ_i f_i·P_i per sequence, averaged over sequences."""
  B, T, K = ids_BTK.shape
  total = 0.0
  for b in range(B):
    f = np.zeros(E)
    for t in range(T):
      for e in ids_BTK[b, t]:
        f[e] += E / (K * T)
    p = (scores_BTE[b] / scores_BTE[b].sum(-1, keepdims=True)).mean(0)
    total += float(f @ p)
  return total / B


def test_sequence_balance_loss_matches_formula():
  E, K = 8, 2
  rng = np.random.default_rng(5)
  scores_BTE = _sigmoid(rng.standard_normal((3, 10, E)))
  ids_BTK = np.argsort(-rng.standard_normal((3, 10, E)), -1)[..., :K].astype(np.int32)
  balance_loss = jax.jit(moe.sequence_balance_loss, static_argnums=2)
  loss = balance_loss(jnp.asarray(scores_BTE, jnp.float32), jnp.asarray(ids_BTK), E)
  np.testing.assert_allclose(float(loss), np_sequence_balance_loss(scores_BTE, ids_BTK, E), rtol=1e-5)
  # Perfect balance with uniform scores gives exactly 1.
  uniform_ids = np.stack([np.arange(8) % E, (np.arange(8) + 4) % E], -1)[None].astype(np.int32)
  balanced = balance_loss(jnp.ones((1, 8, E)), jnp.asarray(uniform_ids), E)
  np.testing.assert_allclose(float(balanced), 1.0, rtol=1e-6)


# --- expert parallelism ------------------------------------------------------------------------


def _ep_inputs(cfg: ModelConfig, n_tokens: int, seed: int):
  rng = np.random.default_rng(seed)
  x_TD = rng.standard_normal((n_tokens, cfg.d_model)).astype(np.float32)
  ids_TK = np.argsort(rng.standard_normal((n_tokens, cfg.n_experts)), -1)[:, : cfg.top_k].astype(np.int32)
  return x_TD, ids_TK, _random_expert_weights(rng, cfg.n_experts, cfg.d_model, cfg.moe_mlp_dim)


def _dispatch_fn(cfg, meshes):
  return jax.jit(lambda x, ids, wg, wu, wd: expert_parallel.dispatch(x, ids, (wg, wu, wd), cfg, meshes))


def test_all_to_all_dispatch_matches_local_path(meshes):
  cfg = _cfg(n_experts=8, top_k=2, capacity_factor=8.0)  # send slots = all local assignments
  x_TD, ids_TK, weights = _ep_inputs(cfg, 64, seed=6)
  y_TKD, dropped = _dispatch_fn(cfg, meshes)(x_TD, ids_TK, *weights)
  x_AD, ids_A = np.repeat(x_TD, 2, 0), ids_TK.reshape(-1)
  local_AD, local_dropped = _experts_capacity(x_AD, ids_A, *weights, "float32", len(ids_A))
  y_AD = np.asarray(y_TKD).reshape(-1, cfg.d_model)
  np.testing.assert_allclose(y_AD, local_AD, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y_AD, np_expert_rows(x_AD, ids_A, *weights), rtol=1e-5, atol=1e-5)
  assert int(dropped) == int(local_dropped) == 0


def test_dropless_all_to_all_dispatch_matches_local_path_under_skew(meshes):
  """capacity_factor 0: buffers sized for the worst case, so even every token of every device choosing
  the same two destination devices drops nothing (a balanced-share buffer of any factor < 4 would)."""
  cfg = _cfg(n_experts=8, top_k=2, capacity_factor=0.0)
  x_TD, _, weights = _ep_inputs(cfg, 64, seed=11)
  ids_TK = np.tile(np.array([[3, 5]], np.int32), (64, 1))  # experts 3 and 5 take all 128 assignments
  y_TKD, dropped = _dispatch_fn(cfg, meshes)(x_TD, ids_TK, *weights)
  x_AD, ids_A = np.repeat(x_TD, 2, 0), ids_TK.reshape(-1)
  np.testing.assert_allclose(
    np.asarray(y_TKD).reshape(-1, cfg.d_model), np_expert_rows(x_AD, ids_A, *weights), rtol=1e-5, atol=1e-5
  )
  assert int(dropped) == 0


def test_dispatch_with_row_chunks_matches_one_pass_under_skew(meshes):
  """The ragged path in row chunks behind the EP dispatch (dropless buffers, mostly empty: the loop
  runs the chunks that got rows): values against NumPy, gradients against one pass."""
  base = _cfg(n_experts=8, top_k=2, capacity_factor=0.0, expert_impl="ragged")
  x_TD, _, weights = _ep_inputs(base, 64, seed=14)
  ids_TK = np.tile(np.array([[3, 5]], np.int32), (64, 1))
  ids_TK[::3] = [[0, 6]]
  cot_TKD = np.random.default_rng(15).standard_normal((64, 2, base.d_model)).astype(np.float32)

  def run(cfg):
    def loss(x, *ws):
      y_TKD, _ = expert_parallel.dispatch(x, ids_TK, ws, cfg, meshes)
      return jnp.sum(y_TKD * cot_TKD), y_TKD

    (_, y_TKD), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x_TD, *weights)
    return y_TKD, grads

  y_TKD, grads = run(dataclasses.replace(base, expert_chunks=4))
  want = np_expert_rows(np.repeat(x_TD, 2, 0), ids_TK.reshape(-1), *weights)
  np.testing.assert_allclose(np.asarray(y_TKD).reshape(-1, base.d_model), want, rtol=1e-5, atol=1e-5)
  _, want_grads = run(base)
  for g, w in zip(grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_all_to_all_dispatch_counts_overflow(meshes):
  cfg = _cfg(n_experts=8, top_k=2, capacity_factor=0.5)
  n_ep, n_tokens = meshes.expert_parallelism, 64
  x_TD, ids_TK, weights = _ep_inputs(cfg, n_tokens, seed=7)
  y_TKD, dropped = _dispatch_fn(cfg, meshes)(x_TD, ids_TK, *weights)
  # Independently: device s holds tokens [s·8, s·8+8); it sends each destination device (one expert
  # each here) at most `slots` assignments, first come first served, and the rest are dropped.
  local_A = n_tokens // n_ep * cfg.top_k
  slots = max(1, math.ceil(local_A / n_ep * cfg.capacity_factor))
  ids_SA = ids_TK.reshape(n_ep, local_A)
  kept_SA = np.stack([first_come_kept(ids_A, slots, cfg.n_experts) for ids_A in ids_SA])
  assert int(dropped) == np.sum(~kept_SA) > 0
  kept_A = kept_SA.reshape(-1)
  expected = np.zeros((n_tokens * cfg.top_k, cfg.d_model))
  expected[kept_A] = np_expert_rows(np.repeat(x_TD, 2, 0)[kept_A], ids_TK.reshape(-1)[kept_A], *weights)
  np.testing.assert_allclose(np.asarray(y_TKD).reshape(-1, cfg.d_model), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("buffer_rows", [1000, 9, 4, 0])
def test_ragged_offsets_simulate_filling_receive_buffers(buffer_rows):
  rng = np.random.default_rng(8)
  sizes_SP = rng.integers(0, 6, (4, 5)).astype(np.int32)
  offsets_SP, sent_SP = map(np.asarray, expert_parallel.ragged_offsets(jnp.asarray(sizes_SP), buffer_rows))
  # Destination p's buffer is filled by sources 0, 1, ... in turn, each chunk after the last.
  for p in range(sizes_SP.shape[1]):
    cursor = 0
    for s in range(sizes_SP.shape[0]):
      assert offsets_SP[s, p] == min(cursor, buffer_rows)
      assert sent_SP[s, p] == max(0, min(sizes_SP[s, p], buffer_rows - cursor))
      cursor += sizes_SP[s, p]
  np.testing.assert_array_equal(sent_SP.sum(0), np.minimum(sizes_SP.sum(0), buffer_rows))
  assert (offsets_SP + sent_SP <= max(buffer_rows, 0)).all()


def np_ragged_kept(ids_TK, n_ep: int, local_experts: int, rows: int):
  """Which assignments the ragged dispatch keeps [T, K]: device s (the s-th contiguous run of tokens)
  sends each device p its assignments bound there, in assignment order; p's receive buffer of `rows`
  rows takes sources 0, 1, ... in turn, each chunk after the last, and keeps what fits."""
  T, K = ids_TK.shape
  dest_SA = (ids_TK // local_experts).reshape(n_ep, -1)
  kept_SA = np.zeros(dest_SA.shape, bool)
  for p in range(n_ep):
    room = rows
    for s in range(n_ep):
      mine = np.flatnonzero(dest_SA[s] == p)
      kept_SA[s, mine[: max(0, min(len(mine), room))]] = True
      room -= len(mine)
  return kept_SA.reshape(T, K)


def np_routed_moe(x_TD, router_DE, ids_TK, weights, cot_TD, kept_TK, cfg: ModelConfig):
  """Routed experts at given expert ids (routing replay: weights from the sigmoid scores there,
  renormalised, × routed_scaling_factor), combined, in float64: the output [T, D] and the gradients of
  Σ output·cot for x, the router and the three expert weights, by hand. A dropped assignment gives zero
  but keeps its share of the weights' normalisation."""
  x, router = x_TD.astype(np.float64), router_DE.astype(np.float64)
  w_gate, w_up, w_down = (w.astype(np.float64) for w in weights)
  (T, K), c = ids_TK.shape, cfg.routed_scaling_factor
  s_TE = _sigmoid(x @ router)
  s_TK = np.take_along_axis(s_TE, ids_TK, -1)
  norm_T1 = s_TK.sum(-1, keepdims=True) + 1e-20
  w_A = (c * s_TK / norm_T1).reshape(-1)
  t_A, e_A, kept_A1 = np.repeat(np.arange(T), K), ids_TK.reshape(-1), kept_TK.reshape(-1, 1)
  x_AD, cot_AD = x[t_A], cot_TD.astype(np.float64)[t_A]
  h_gate, h_up = np.einsum("ad,adf->af", x_AD, w_gate[e_A]), np.einsum("ad,adf->af", x_AD, w_up[e_A])
  sig = _sigmoid(h_gate)
  act_AF = h_gate * sig * h_up
  y_AD = np.einsum("af,afd->ad", act_AF, w_down[e_A]) * kept_A1
  out_TD = (w_A[:, None] * y_AD).reshape(T, K, -1).sum(1)
  # Backward: the expert SwiGLU per assignment, then the combine weights into the router.
  dy_AD = w_A[:, None] * cot_AD * kept_A1
  d_act = np.einsum("ad,afd->af", dy_AD, w_down[e_A])
  d_gate, d_up = d_act * h_up * sig * (1 + h_gate * (1 - sig)), d_act * h_gate * sig
  grads = [np.zeros_like(w) for w in (w_gate, w_up, w_down)]
  np.add.at(grads[0], e_A, np.einsum("ad,af->adf", x_AD, d_gate))
  np.add.at(grads[1], e_A, np.einsum("ad,af->adf", x_AD, d_up))
  np.add.at(grads[2], e_A, np.einsum("af,ad->afd", act_AF, dy_AD))
  dx_TD = np.zeros_like(x)
  np.add.at(
    dx_TD, t_A, np.einsum("af,adf->ad", d_gate, w_gate[e_A]) + np.einsum("af,adf->ad", d_up, w_up[e_A])
  )
  dw_TK = (cot_AD * y_AD).sum(-1).reshape(T, K)
  ds_TK = c * (dw_TK / norm_T1 - (dw_TK * s_TK).sum(-1, keepdims=True) / norm_T1**2)
  dlogits_TE = np.zeros_like(s_TE)
  np.add.at(dlogits_TE, (t_A, e_A), (ds_TK * s_TK * (1 - s_TK)).reshape(-1))
  return out_TD, (dx_TD + dlogits_TE @ router.T, x.T @ dlogits_TE, *grads)


def _routed_step(cfg: ModelConfig, meshes, ids_TK, cot_TD):
  """jit(value_and_grad) of Σ output·cot for (x, router, w_gate, w_up, w_down): routing replay at
  `ids_TK` (the router gets its gradient through the combine weights), the EP dispatch, the combine."""

  def loss(x_TD, router_DE, *ws):
    r = moe.route(x_TD @ router_DE, jnp.zeros((cfg.n_experts,)), cfg, jnp.asarray(ids_TK))
    y_TKD, dropped = expert_parallel.dispatch(x_TD, r.expert_ids_TK, ws, cfg, meshes)
    out_TD = moe.combine(y_TKD, r.weights_TK)
    return jnp.sum(out_TD * cot_TD), (out_TD, dropped)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.parametrize(
  "case",
  [
    # 2 experts per device; dropless buffers; experts 0, 13 (devices 0, 6) and 6, 7 (device 3) take every
    # assignment: 12 experts and 5 devices get none.
    dict(n_experts=16, capacity_factor=0.0, expert_chunks=0, skew=((6, 7), (0, 13)), rows=None),
    # 1 expert per device; receive buffers of 16 rows (capacity factor 1 × 16 local assignments, in 4 row
    # chunks as the pod variants run them): devices 3 and 5 get ~43 rows, 0 and 6 ~21, so rows drop.
    dict(n_experts=8, capacity_factor=1.0, expert_chunks=4, skew=((3, 5), (0, 6)), rows=16),
  ],
  ids=["dropless_skew", "overflow"],
)
def test_ragged_dispatch_runs_on_cpu_with_exact_gradients(meshes, case):
  """The ragged dispatch runs on the CPU mesh through `cpu_collectives.ragged_all_to_all` (XLA:CPU has
  no ragged-all-to-all): output, dropped count and the gradients of x, the router and the expert
  weights against NumPy, under skewed routing with empty experts and devices; without drops also
  against the all_to_all dispatch. A receive buffer typed invariant (no `varying.vary_like`) sums its
  rows' gradients over the devices and fails here."""
  fields = {k: case[k] for k in ("n_experts", "capacity_factor", "expert_chunks")}
  cfg = _cfg(top_k=2, routed_scaling_factor=2.5, expert_impl="ragged", dispatch="ragged_all_to_all", **fields)
  x_TD, _, weights = _ep_inputs(cfg, 64, seed=16)
  rng = np.random.default_rng(17)
  router_DE = (0.3 * rng.standard_normal((cfg.d_model, cfg.n_experts))).astype(np.float32)
  cot_TD = rng.standard_normal((64, cfg.d_model)).astype(np.float32)
  ids_TK = np.tile(np.array([case["skew"][0]], np.int32), (64, 1))
  ids_TK[::3] = case["skew"][1]
  local_experts = cfg.n_experts // meshes.expert_parallelism
  kept_TK = np.ones(ids_TK.shape, bool)
  if case["rows"] is not None:
    kept_TK = np_ragged_kept(ids_TK, meshes.expert_parallelism, local_experts, case["rows"])
  assert len(np.unique(ids_TK)) == 4 and (kept_TK.all() if case["rows"] is None else (~kept_TK).sum() > 10)

  (_, (out_TD, dropped)), grads = _routed_step(cfg, meshes, ids_TK, cot_TD)(x_TD, router_DE, *weights)
  want_TD, want_grads = np_routed_moe(x_TD, router_DE, ids_TK, weights, cot_TD, kept_TK, cfg)
  assert int(dropped) == np.sum(~kept_TK)
  np.testing.assert_allclose(out_TD, want_TD, rtol=1e-5, atol=1e-5 * np.abs(want_TD).max())
  for name, g, w in zip(("x", "router", "w_gate", "w_up", "w_down"), grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max(), err_msg=name)
  if case["rows"] is None:  # the all_to_all dispatch (dropless too) gives the same numbers
    a2a = dataclasses.replace(cfg, dispatch="all_to_all")
    (_, (a2a_TD, _)), a2a_grads = _routed_step(a2a, meshes, ids_TK, cot_TD)(x_TD, router_DE, *weights)
    np.testing.assert_allclose(out_TD, a2a_TD, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, a2a_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())


def test_ragged_dispatch_backward_sums_no_rows_across_devices(meshes):
  """The receive and return buffers of ragged_all_to_all hold per-device rows. Typed invariant (a bare
  `jnp.zeros` inside shard_map), the backward pass would sum their gradient over the expert axes —
  wrong gradients on every TPU/GPU step, invisible on CPU (no lowering to run). No float psum may
  appear in the gradient's program (the dropped count's integer psum is the forward's)."""
  cfg = _cfg(n_experts=8, top_k=2, dispatch="ragged_all_to_all", expert_impl="ragged")
  x_TD, ids_TK, weights = _ep_inputs(cfg, 64, seed=9)

  def loss(x, *ws):
    y_TKD, _ = expert_parallel.dispatch(x, ids_TK, ws, cfg, meshes)
    return jnp.sum(y_TKD)

  eqns = []

  def collect(jaxpr):
    for eqn in jaxpr.eqns:
      eqns.append(eqn)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        collect(sub)

  collect(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x_TD, *weights).jaxpr)
  # On the CPU mesh the stand-in (typed like the native op) is the exchange traced here.
  assert any(e.primitive.name == "cpu_ragged_all_to_all" for e in eqns)
  summed = [
    e for e in eqns if e.primitive.name.startswith("psum") and any(v.aval.dtype.kind == "f" for v in e.invars)
  ]
  assert not summed, [str(e)[:120] for e in summed]
