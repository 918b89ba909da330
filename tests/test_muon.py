"""Sharded Muon equals optax's full-matrix Muon, keeps shardings, splits NS work; build_optimizer routing.

Shape suffixes as in composer_jax/optim/muon.py. Meshes: dense (replica=2, fsdp=4, context=1) so
that fsdp really shards, expert (expert=8, expert_fsdp=1).
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

from composer_jax import model, optim, sharding
from composer_jax.optim import newton_schulz

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tiny import TINY  # noqa: E402

DN = {"q_DHK": MDN(0, 2), "experts_EDF": MDN(1, 2), "w_DF": MDN(0, 1)}
SHAPES = {"q_DHK": (16, 4, 8), "experts_EDF": (8, 16, 12), "w_DF": (16, 24)}


@pytest.fixture(scope="module")
def fsdp_meshes() -> sharding.Meshes:
  return sharding.build_meshes((2, 4, 1), (8, 1))


def _params(shapes, seed=0):
  # numpy, not jax.random: one eager random program per shape would cost more compiles than the tests.
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.standard_normal(s, np.float32)) for k, s in sorted(shapes.items())}


def _grads(params, t):
  return jax.tree.map(lambda x: jnp.sin((t + 1) * x) + 0.1 * t, params)


def _stepper(tx):
  """One jitted (grads → update → apply) step, so a test compiles one program per transform."""

  @jax.jit
  def step(params, state, t):
    updates, state = tx.update(_grads(params, t), state, params)
    return optax.apply_updates(params, updates), state, updates

  return step


def _shardings(meshes, layout):
  dense, expert = ("fsdp", "expert") if layout == "sharded" else (None, None)
  return {
    "q_DHK": NamedSharding(meshes.dense, P(dense)),
    "experts_EDF": NamedSharding(meshes.expert, P(expert)),
    "w_DF": NamedSharding(meshes.dense, P(dense)),
  }


def _max_abs_diff(a, b):
  return jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)


def _run_both(tx, ref, params_ref, params, steps):
  """`steps` updates of both transforms; the max |Δ| per leaf, the last sharded updates and params."""
  state_ref, state = ref.init(params_ref), tx.init(params)
  step_ref, step = _stepper(ref), _stepper(tx)
  worst = jax.tree.map(lambda _: 0.0, params)
  for t in range(steps):
    params_ref, state_ref, u_ref = step_ref(params_ref, state_ref, t)
    params, state, u = step(params, state, t)
    worst = jax.tree.map(max, worst, _max_abs_diff(u_ref, u))
  return worst, u, params


def test_matches_optax_muon_and_keeps_shardings(fsdp_meshes):
  # Both layouts in one program (one compile each for ours and optax's); DN is a prefix per layout.
  layouts = ("replicated", "sharded")
  shard = {layout: _shardings(fsdp_meshes, layout) for layout in layouts}
  dn = {layout: DN for layout in layouts}
  params_ref = {layout: _params(SHAPES, seed=i) for i, layout in enumerate(layouts)}
  params = jax.tree.map(jax.device_put, params_ref, shard)
  kw = {"weight_decay": 0.01, "beta": 0.9}
  ref = optax.contrib.muon(0.05, muon_weight_dimension_numbers=dn, consistent_rms=0.2, nesterov=True, **kw)
  tx = optim.sharded_muon(0.05, dimension_numbers=dn, meshes=fsdp_meshes, shardings=shard, **kw)
  worst, updates, new_params = _run_both(tx, ref, params_ref, params, steps=3)
  for layout in layouts:
    print(f"max |Δ| vs optax ({layout}):", worst[layout])
    assert max(worst[layout].values()) <= 1e-5, (layout, worst[layout])
    for k, shape in SHAPES.items():
      want = shard[layout][k]
      assert updates[layout][k].sharding.is_equivalent_to(want, len(shape)), (layout, k)
      assert new_params[layout][k].sharding.is_equivalent_to(want, len(shape)), (layout, k)


def test_uneven_counts_and_other_layouts(fsdp_meshes):
  # a, b: 5 + 2 = 7 heads [16 × 8], rows over fsdp=4 ⇒ one padding matrix, two leaves in one group.
  # mk: 3 heads [16 × 24], rows over fsdp and columns over replica ⇒ 8 devices, 5 padding matrices.
  # k: columns over fsdp; merged: reduction (0, 1) merged from two sharded dims.
  shapes = {"a": (16, 5, 8), "b": (16, 2, 8), "mk": (16, 3, 24), "k": (24, 16), "merged": (2, 8, 16, 6)}
  dn = {"a": MDN(0, 2), "b": MDN(0, 2), "mk": MDN(0, 2), "k": MDN(0, 1), "merged": MDN((0, 1), 2)}
  specs = {"a": P("fsdp"), "b": P("fsdp"), "mk": P("fsdp", None, "replica"), "k": P(None, "fsdp")}
  specs["merged"] = P("replica", "fsdp")
  shard = {k: NamedSharding(fsdp_meshes.dense, spec) for k, spec in specs.items()}
  params_ref = _params(shapes, seed=1)
  params = jax.tree.map(jax.device_put, params_ref, shard)
  ref = optax.contrib.muon(0.05, muon_weight_dimension_numbers=dn, consistent_rms=0.2, nesterov=True)
  tx = optim.sharded_muon(0.05, dimension_numbers=dn, meshes=fsdp_meshes, shardings=shard)
  worst, updates, _ = _run_both(tx, ref, params_ref, params, steps=1)
  print("max |Δ| vs optax (uneven counts, other layouts):", worst)
  assert max(worst.values()) <= 1e-5, worst
  for k in params:
    assert updates[k].sharding.is_equivalent_to(shard[k], len(shapes[k])), (k, updates[k].sharding)


def _compiled(tx, params, shard):
  params = jax.tree.map(jax.device_put, params, shard)
  state = tx.init(params)
  return jax.jit(tx.update).lower(params, state, params).compile()


@pytest.mark.parametrize("spec", [P("fsdp"), P()], ids=["fsdp_rows", "replicated"])
def test_ns_flops_split_over_devices(fsdp_meshes, spec):
  """Per-device NS FLOPs ≤ 1.1 × (one device doing all of them ÷ 8 devices).

  16 per-head matrices [256 × 128], large enough that the elementwise momentum and scaling (done on
  every copy of a replicated leaf) stay a few % of the NS matmuls. Rows over fsdp=4: all_to_all
  gives each device 4 whole matrices and the 2 replicas split those; replicated: the 8 copies take
  2 matrices each.
  """
  shapes, dn = {"q": (256, 16, 128)}, {"q": MDN(0, 2)}
  params = _params(shapes)
  sharded = {"q": NamedSharding(fsdp_meshes.dense, spec)}
  tx = optim.sharded_muon(0.1, dimension_numbers=dn, meshes=fsdp_meshes, shardings=sharded)
  flops = _compiled(tx, params, sharded).cost_analysis()["flops"]
  single = {"q": NamedSharding(fsdp_meshes.dense, P())}
  plain = optim.sharded_muon(0.1, dimension_numbers=dn)  # meshes=None: every device does all 16
  flops_ref = _compiled(plain, params, single).cost_analysis()["flops"]
  ratio = flops / (flops_ref / fsdp_meshes.dense.size)
  print(f"per-device FLOPs {flops:.0f} vs replicated {flops_ref:.0f}: ratio to ideal 1/8 = {ratio:.3f}")
  assert ratio <= 1.1, ratio


def test_all_to_all_only_for_matrix_sharded_groups(fsdp_meshes):
  params = _params({"w_DF": SHAPES["w_DF"], "experts_EDF": SHAPES["experts_EDF"]})
  shard = _shardings(fsdp_meshes, "sharded")
  counts = {}
  for k in params:
    tx = optim.sharded_muon(0.1, dimension_numbers={k: DN[k]}, meshes=fsdp_meshes, shardings={k: shard[k]})
    counts[k] = _compiled(tx, {k: params[k]}, {k: shard[k]}).as_text().count("all-to-all(")
  assert counts == {"w_DF": 2, "experts_EDF": 0}, counts


def test_none_leaves_pass_through_and_options():
  params = {"w": jnp.ones((4, 6)), "norm": jnp.ones((6,))}
  tx = optim.sharded_muon(0.1, dimension_numbers={"w": MDN(), "norm": None})
  grads = {"w": jnp.arange(24.0).reshape(4, 6), "norm": jnp.full((6,), 3.0)}
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["norm"], grads["norm"])
  with pytest.raises(ValueError, match="rms_scale"):
    optim.sharded_muon(0.1, dimension_numbers=MDN(), rms_scale="other")
  with pytest.raises(ValueError, match="shardings"):
    optim.sharded_muon(0.1, dimension_numbers=MDN(), meshes=object())


def test_jordan_scale_matches_optax_default():
  params = _params({"w": (8, 24)})
  ref = optax.contrib.muon(0.1, muon_weight_dimension_numbers={"w": MDN()}, consistent_rms=None)
  tx = optim.sharded_muon(0.1, dimension_numbers={"w": MDN()}, rms_scale="jordan")
  g = _grads(params, 0)
  u_ref, _ = ref.update(g, ref.init(params), params)
  u, _ = tx.update(g, tx.init(params), params)
  np.testing.assert_allclose(u["w"], u_ref["w"], atol=1e-5)


@pytest.mark.parametrize("name", ["quintic", "polar_express"])
def test_newton_schulz_orthogonalizes(name):
  x_NMK = jnp.asarray(np.random.default_rng(3).standard_normal((2, 24, 40), np.float32))
  coeffs, scale = newton_schulz.coefficients(name, 5)
  s = np.linalg.svd(np.asarray(newton_schulz.orthogonalize(x_NMK, coeffs, scale)), compute_uv=False)
  assert 0.6 < s.min() and s.max() < 1.25, (s.min(), s.max())


def test_build_optimizer_routing():
  dns, labels = optim.dimension_numbers(TINY), optim.labels(TINY)
  # Stacked leaves: the leading `layers` axis is a batch axis, so every index shifts by one.
  moe, dense = labels["moe_layers"]["mlp"], labels["dense_layers"]
  assert labels["embed"] == labels["lm_head"] == labels["final_norm"] == "adam"
  assert moe["router"] == "adam" and moe["router_bias"] == "frozen"
  assert dense["input_norm"] == dense["attn"]["q_a_norm"] == "adam"
  attn = dns["dense_layers"]["attn"]
  assert attn["q_b_proj"] == MDN(1, 3) and attn["kv_b_proj"] == MDN(1, 3) and attn["o_proj"] == MDN(2, 3)
  assert attn["q_a_proj"] == attn["kv_a_proj"] == MDN(1, 2)
  assert (
    dns["dense_layers"]["mlp"]["gate_proj"] == dns["moe_layers"]["mlp"]["shared"]["down_proj"] == MDN(1, 2)
  )
  assert all(dns["moe_layers"]["mlp"][k] == MDN(2, 3) for k in ("w_gate", "w_up", "w_down"))
  assert dns["embed"] is None and dns["moe_layers"]["mlp"]["router_bias"] is None
  decay = optim.decay_mask(TINY)  # AdamW decays matrices (embedding, head, router), never a stacked norm
  assert decay["embed"] and decay["lm_head"] and decay["moe_layers"]["mlp"]["router"]
  assert (
    not decay["final_norm"]
    and not decay["dense_layers"]["input_norm"]
    and not decay["moe_layers"]["attn"]["q_a_norm"]
  )


def test_matrix_optimizer_adamw_is_plain_adamw_on_matrices():
  """The ablation switch: a matrix leaf's first update equals optax.adamw's (sign-like −lr·g/|g|)."""
  params = model.init(TINY, jax.random.key(0))
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  cfg = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=5, min_lr_ratio=1.0)
  cfg = dataclasses.replace(cfg, weight_decay=0.0, grad_clip=0.0, matrix_optimizer="adamw")
  tx = optim.build_optimizer(TINY, cfg, None)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["dense_layers"]["attn"]["q_b_proj"], -1e-2, rtol=1e-5)
  with pytest.raises(ValueError, match="matrix_optimizer"):
    optim.build_optimizer(TINY, dataclasses.replace(cfg, matrix_optimizer="sgd"), None)


def test_adamw_decays_matrices_not_stacked_norms():
  """Zero gradients: AdamW's update is −lr·wd·param on decayed leaves and exactly 0 on the rest; the
  stacked norms [L, D] (two axes, one of them `layers`) must not be decayed."""
  params = model.init(TINY, jax.random.key(0))
  cfg = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=5, min_lr_ratio=1.0)
  tx = optim.build_optimizer(TINY, cfg, None)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  for name in ("input_norm", "post_attn_norm"):
    assert params["dense_layers"][name].ndim == 2
    np.testing.assert_array_equal(updates["dense_layers"][name], 0)
  np.testing.assert_array_equal(updates["final_norm"], 0)
  for leaf in (updates["embed"], updates["moe_layers"]["mlp"]["router"]):
    assert np.abs(np.asarray(leaf)).max() > 0
  np.testing.assert_allclose(updates["embed"], -1e-2 * cfg.weight_decay * params["embed"], rtol=1e-5)


def test_build_optimizer_step_on_model_params(meshes):
  # The suite's meshes (same init program as test_sharding, so one compile per suite run): dense
  # leaves replicated (fsdp=1) and experts over 8 devices; fsdp-sharded groups are tested above.
  params = model.init(TINY, jax.random.key(0), meshes)
  cfg = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10)
  tx = optim.build_optimizer(TINY, cfg, meshes)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01) + 0.01 * x, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  new, _ = step(params, state)
  bias = params["moe_layers"]["mlp"]["router_bias"]
  np.testing.assert_array_equal(new["moe_layers"]["mlp"]["router_bias"], bias)
  assert not np.allclose(new["moe_layers"]["mlp"]["w_up"], params["moe_layers"]["mlp"]["w_up"])

  assert not np.allclose(new["embed"], params["embed"])
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(new), strict=True):
    assert b.sharding.is_equivalent_to(a.sharding, a.ndim), (
      jax.tree_util.keystr(path),
      a.sharding,
      b.sharding,
    )
    assert np.isfinite(np.asarray(b)).all(), jax.tree_util.keystr(path)


@pytest.mark.parametrize("clip_muon", [False, True])
def test_clip_scales_adam_and_muon_only_with_clip_muon(clip_muon):
  """grad_clip uses the norm of all gradients. AdamW's leaves get optax.clip_by_global_norm's factor;
  Muon's gradients are left alone unless clip_muon, so a huge gradient elsewhere (norm 1e4, clip 1)
  changes the Muon momentum (hence step 2's update) only with clip_muon."""
  params = model.init(TINY, jax.random.key(0))
  cfg = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=5, min_lr_ratio=1.0)
  cfg = dataclasses.replace(cfg, grad_clip=1.0, clip_muon=clip_muon, weight_decay=0.0)
  tx = optim.build_optimizer(TINY, cfg, None)
  small = jax.tree.map(lambda x: 1e-3 * jnp.cos(x), params)
  other = jax.tree.map(lambda x: 1e-3 * jnp.sin(3 * x), params)  # step 2: another direction
  huge = {**small, "embed": small["embed"] + 1e4 / np.sqrt(small["embed"].size)}
  step = jax.jit(tx.update)
  runs = {}
  for name, first in (("small", small), ("huge", huge)):
    u1, state = step(first, tx.init(params), params)
    u2, _ = step(other, state, params)
    runs[name] = (u1, u2)
  q_b = lambda u: np.asarray(u["dense_layers"]["attn"]["q_b_proj"])  # noqa: E731  (a Muon leaf)
  moved = np.abs(q_b(runs["huge"][1]) - q_b(runs["small"][1])).max()
  assert (moved > 1e-4) if clip_muon else (moved == 0.0), moved
  # AdamW's embedding update on the huge step: Adam of the clipped gradient, as optax computes it.
  adam = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
  )
  g = {"all": huge}
  ref, _ = adam.update(g, adam.init({"all": params}), {"all": params})
  np.testing.assert_allclose(runs["huge"][0]["final_norm"], ref["all"]["final_norm"], rtol=1e-5, atol=1e-9)
