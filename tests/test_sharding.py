"""The two meshes, the logical-axis tables, and sharded ≡ single-device forward.

Shape suffixes: B batch, T time, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tiny import TINY

from composer_jax import model, sharding
from composer_jax.model import ModelConfig

CFG = TINY
B, T = 4, 16  # batch splits over replica=4, time over context=2, B·T tokens over expert=8


def _is_axes(x) -> bool:
  return isinstance(x, tuple)


# --- building meshes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "dense, expert, numbers",
  [((4, 1, 1), (8, 1), ("4", "8")), ((4, 1, 2), (4, 1), ("4", "8")), ((2, 2, 4), (8, 1), ("16", "8"))],
)
def test_build_meshes_rejects_wrong_device_count(dense, expert, numbers):
  with pytest.raises(sharding.MeshMismatch) as err:  # run.py prints it as one line, exit 2
    sharding.build_meshes(dense, expert)
  message = str(err.value)
  assert "--config.mesh.dense=(" in message and "--config.mesh.expert=(" in message
  # the mesh it names fits the 8 devices there are
  dense, expert = (
    tuple(int(x) for x in m.split("(")[1].split(")")[0].split(",")) for m in message.split("=")[1:3]
  )
  assert np.prod(dense) == np.prod(expert) == 8, message
  for n in numbers:
    assert f"{n} devices" in message or f"{n} are available" in message, message


@pytest.mark.parametrize("dense, expert", [((8, 1), (8, 1)), ((4, 1, 2), (8,)), ((4, 1, 2), (2, 2, 2))])
def test_build_meshes_rejects_wrong_number_of_axes(dense, expert):
  with pytest.raises(ValueError, match="needs"):
    sharding.build_meshes(dense, expert)


def test_meshes_share_one_device_order(meshes):
  assert list(meshes.dense.devices.flat) == list(meshes.expert.devices.flat) == jax.devices()
  assert meshes.dense.axis_names == sharding.DENSE_AXES and meshes.expert.axis_names == sharding.EXPERT_AXES
  shuffled = [jax.devices()[i] for i in (3, 1, 7, 0, 5, 2, 6, 4)]
  custom = sharding.build_meshes((2, 2, 2), (4, 2), devices=shuffled)
  assert list(custom.dense.devices.flat) == list(custom.expert.devices.flat) == shuffled


def test_make_meshes_reads_the_experiment_config():
  config = ml_collections.ConfigDict()
  config.mesh = ml_collections.ConfigDict()
  config.mesh.dense = (2, 2, 2)
  config.mesh.expert = (4, 2)
  meshes = sharding.make_meshes(config)
  assert dict(meshes.dense.shape) == {"replica": 2, "fsdp": 2, "context": 2}
  assert dict(meshes.expert.shape) == {"expert": 4, "expert_fsdp": 2}
  assert meshes.expert_parallelism == 4
  config.mesh.expert = (16, 1)
  with pytest.raises(ValueError, match="16"):
    sharding.make_meshes(config)


# --- logical axes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "cfg",
  [CFG, ModelConfig(q_lora_rank=0, tie_word_embeddings=True, n_shared_experts=0, first_k_dense=0)],
  ids=["tiny", "q_proj_tied_no_shared"],
)
def test_every_param_axis_has_a_rule(cfg, meshes):
  abstract = jax.eval_shape(functools.partial(model.init, cfg), jax.random.key(0))
  axes = model.logical_axes(cfg)
  for (path, names), leaf in zip(
    jax.tree_util.tree_leaves_with_path(axes, is_leaf=_is_axes), jax.tree.leaves(abstract), strict=True
  ):
    table = sharding.EXPERT_PARAM_RULES if "expert" in names else sharding.DENSE_PARAM_RULES
    for name in names:
      where = (jax.tree_util.keystr(path), name)
      assert name is None or (name in sharding.PARAM_AXES and name in table), where
    sharding.param_sharding(names, meshes, leaf.shape)  # resolves without KeyError
  expert_leaves = [names for names in jax.tree.leaves(axes, is_leaf=_is_axes) if "expert" in names]
  assert len(expert_leaves) == 3 * (cfg.n_moe_layers > 0)  # gate, up, down: one stacked leaf each
  assert all(names[0] == "layers" for names in expert_leaves)


# --- parameters on the two meshes --------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_params(meshes):
  return model.init(CFG, jax.random.key(0), meshes)


def test_init_places_expert_params_on_expert_mesh(sharded_params, meshes):
  axes = model.logical_axes(CFG)
  n_expert = 0
  axes_leaves = jax.tree_util.tree_leaves_with_path(axes, is_leaf=_is_axes)
  for (path, names), leaf in zip(axes_leaves, jax.tree.leaves(sharded_params), strict=True):
    where = jax.tree_util.keystr(path)
    if "expert" in names:
      n_expert += 1
      assert leaf.sharding.mesh == meshes.expert, where
      dim = names.index("expert")  # 1: the stacked layers come first, unsharded
      assert leaf.sharding.spec[dim] == "expert" and leaf.sharding.spec[0] is None, where
      # One expert per device: the expert axis really splits over all 8.
      assert {s.data.shape[dim] for s in leaf.addressable_shards} == {CFG.n_experts // 8}, where
    else:
      assert leaf.sharding.mesh == meshes.dense, where
      assert leaf.sharding.spec == sharding.param_sharding(names, meshes, leaf.shape).spec, where
  assert n_expert == 3


def _random_like(params, seed: int):
  """O(1) random values (so the MoE matters to the logits) with the given arrays' shardings."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = path[-1].key
    scale = 1.0 if name == "embed" else 0.05 if name == "router_bias" else 0.2
    value = rng.standard_normal(leaf.shape) * scale + (1.0 if name.endswith("norm") else 0.0)
    return value.astype(leaf.dtype)

  host = jax.tree_util.tree_map_with_path(draw, params)
  return host, jax.device_put(host, jax.tree.map(lambda p: p.sharding, params))


def test_sharded_forward_matches_single_device(sharded_params, meshes):
  host_params, params = _random_like(sharded_params, seed=3)
  tokens_BT = np.random.default_rng(4).integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  sharded_BTV, sharded_aux = jax.jit(lambda p, t: model.apply(p, CFG, t, meshes=meshes))(params, tokens_BT)
  single_BTV, single_aux = jax.jit(lambda p, t: model.apply(p, CFG, t))(host_params, tokens_BT)
  assert len(single_BTV.sharding.device_set) == 1 and len(sharded_BTV.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(sharded_BTV), np.asarray(single_BTV), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(sharded_aux["expert_load"], single_aux["expert_load"])
  assert float(sharded_aux["overflow"]) == float(single_aux["overflow"]) == 0
  np.testing.assert_allclose(float(sharded_aux["balance_loss"]), float(single_aux["balance_loss"]), rtol=1e-5)


def test_heads_take_the_fsdp_axis_before_embed():
  """Per-head weights are split by whole heads (Muon then orthogonalises each head where it lives); a
  mesh axis shards one dim only, and embed takes fsdp when the heads don't divide it."""
  meshes = sharding.abstract_meshes((2, 4, 1), (8, 1))
  o_HVD, q_DHK, q_b_QHK = (
    ("heads", "head_dim", "embed"),
    ("embed", "heads", "head_dim"),
    ("q_lora", "heads", "head_dim"),
  )
  assert sharding.param_sharding(o_HVD, meshes, (8, 16, 64)).spec == P("fsdp", None, None)
  assert sharding.param_sharding(q_DHK, meshes, (64, 8, 24)).spec == P(None, "fsdp", None)
  assert sharding.param_sharding(q_b_QHK, meshes, (32, 8, 24)).spec == P(None, "fsdp", None)
  assert sharding.param_sharding(o_HVD, meshes, (6, 16, 64)).spec == P(None, None, "fsdp")  # 6 % 4 ≠ 0


def test_device_major_token_order_matches_the_dense_layout(meshes):
  """A [8, 16] batch on dense (replica=4, fsdp=1, context=2): after `device_major`, run d of the 8
  equal runs holds exactly device d's tokens (rows 2·(d//2), +1; positions 8·(d%2)..+8)."""
  from composer_jax.model import expert_parallel  # noqa: PLC0415

  rows, cols = 8, 16
  ids_BT = np.arange(rows * cols).reshape(rows, cols)
  ordered = np.asarray(expert_parallel.device_major(jnp.asarray(ids_BT), meshes))
  for d, run in enumerate(ordered.reshape(8, -1)):
    r, c = divmod(d, 2)
    np.testing.assert_array_equal(run, ids_BT[2 * r : 2 * r + 2, 8 * c : 8 * c + 8].reshape(-1))
  back = expert_parallel.from_device_major(jnp.asarray(ordered), rows, meshes)
  np.testing.assert_array_equal(np.asarray(back), ids_BT)


def test_sharded_forward_with_two_rows_per_device(sharded_params, meshes):
  """8 rows over replica=4 and 16 positions over context=2: the tokens reach the expert mesh in
  device-major order and come back in place; logits equal the single-device forward."""
  host_params, params = _random_like(sharded_params, seed=5)
  tokens_BT = np.random.default_rng(6).integers(0, CFG.vocab_size, (8, T)).astype(np.int32)
  sharded_BTV, aux = jax.jit(lambda p, t: model.apply(p, CFG, t, meshes=meshes))(params, tokens_BT)
  single_BTV, single_aux = jax.jit(lambda p, t: model.apply(p, CFG, t))(host_params, tokens_BT)
  np.testing.assert_allclose(np.asarray(sharded_BTV), np.asarray(single_BTV), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(aux["routed_experts"], single_aux["routed_experts"])


def test_kv_cache_rows_split_over_the_dense_mesh(meshes):
  """The sampler's cache is created on its devices, rows over replica·fsdp (4 here); a decode step's
  layout adds context (8 ways) where the rows divide; 6 rows, divisible by neither, stay replicated."""
  from composer_jax.rl import engine

  cache = engine.empty_cache(CFG, 8, 16, meshes)
  for key, rows_dim in (("latent", 1), ("k_rope", 1), ("positions", 0), ("segments", 0)):
    shard_rows = {s.data.shape[rows_dim] for s in cache[key].addressable_shards}
    assert shard_rows == {2}, (key, shard_rows)
  decode = sharding.cache_shardings(cache, meshes, decode=True)
  assert decode["latent"].spec == P(None, ("replica", "fsdp", "context"), None, None)
  odd = sharding.cache_shardings(jax.eval_shape(lambda: model.init_cache(CFG, 6, 16)), meshes, decode=True)
  assert odd["positions"].spec == P(None, None) and odd["index"].spec == P()


def test_a_decode_sized_call_takes_the_expert_parallel_path_and_matches_one_device(sharded_params, meshes):
  """4 rows × 1 token is fewer tokens than the 8 devices: the MoE pads the positions so that the EP
  dispatch takes them (the local path all-gathers every expert's weights), and drops the padding again:
  logits, routing and expert load equal the single-device forward's."""
  from composer_jax.model import moe

  assert moe.padded_length(meshes, 4, 1) == 2 and moe.padded_length(meshes, B, T) == T
  kimi = sharding.abstract_meshes((16, 16, 4), (128, 8))
  assert moe.padded_length(kimi, 256, 1) == 4 and moe.padded_length(kimi, 1024, 1) == 1
  tokens = jax.random.randint(jax.random.key(3), (4, 1), 0, CFG.vocab_size)
  single = jax.device_get(sharded_params)
  want, want_aux = jax.jit(functools.partial(model.apply, cfg=CFG))(single, tokens=tokens)
  sharded = jax.jit(functools.partial(model.apply, cfg=CFG, meshes=meshes))
  got, aux = sharded(sharded_params, tokens=tokens)
  hlo = sharded.lower(sharded_params, tokens=tokens).compile().as_text()
  assert "all-to-all" in hlo, "the tokens did not travel to their experts (the local path ran)"
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(aux["routed_experts"]), np.asarray(want_aux["routed_experts"]))
  np.testing.assert_array_equal(np.asarray(aux["expert_load"]), np.asarray(want_aux["expert_load"]))
