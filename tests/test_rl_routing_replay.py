"""Routing replay (R3, arXiv 2510.11370): the model replays given experts; the rollout records, for every
trajectory token, the experts the sampler routed it to; the RL step replays them.

Shape suffixes: L MoE layers, B batch, T time, K top-k.

The model has two MoE layers (the second one's routing depends on the first one's experts) and random
O(1) weights (`test_model.random_params`), so routing is far from uniform and a wrong expert shows.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_model import random_params

from composer_jax import configs, model
from composer_jax.model import ModelConfig, RopeConfig
from composer_jax.rl import batch as rl_batch_lib
from composer_jax.rl import chat, rollout
from composer_jax.rl import loss as rl_loss_lib
from composer_jax.rl import step as rl_step
from composer_jax.rl.engine import KVCacheSampler
from composer_jax.rl.envs import factories
from composer_jax.rl.loss import LossSettings
from composer_jax.train.state import TrainState
from composer_jax.train.step import make_step

CFG = ModelConfig(
  vocab_size=272,  # the byte tokenizer's ids
  d_model=32,
  n_layers=3,
  n_heads=2,
  dense_mlp_dim=64,
  moe_mlp_dim=16,
  n_experts=8,
  top_k=2,
  n_group=2,
  topk_group=1,
  routed_scaling_factor=2.5,
  first_k_dense=1,
  q_lora_rank=16,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=4,
  v_head_dim=8,
  max_position_embeddings=512,
  rope=RopeConfig(theta=10000.0),
)
RC = configs.RLConfig(
  schedule=configs.ScheduleConfig(steps=1),
  problems_per_step=2,
  group_size=2,
  max_turns=2,
  max_turn_tokens=8,
  cache_len=192,
  temperature=0.0,  # greedy: the recorded routing is then a pure function of the weights
  routing_replay=True,
)
B, T = 2, 16


@pytest.fixture(scope="module")
def params():
  return random_params(CFG, seed=5)


@pytest.fixture(scope="module")
def tokens_BT():
  return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T)), jnp.int32)


@jax.jit
def _loss_and_grad(params, tokens_BT, routed_LBTK):
  """Cache-free forward with block remat (the training path) and its gradient."""
  cfg = dataclasses.replace(CFG, remat="full")

  def loss(p):
    logits_BTV, aux = model.apply(p, cfg, tokens_BT, routed_experts=routed_LBTK)
    return jnp.mean(jax.nn.log_softmax(logits_BTV)[..., 0]), (logits_BTV, aux["routed_experts"])

  return jax.value_and_grad(loss, has_aux=True)(params)


@jax.jit
def _own_routing(params, tokens_BT):
  return model.apply(params, CFG, tokens_BT)[1]["routed_experts"]


def test_replaying_the_own_choice_changes_nothing(params, tokens_BT):
  own_LBTK = _own_routing(params, tokens_BT)
  assert own_LBTK.shape == (CFG.n_moe_layers, B, T, CFG.top_k) and own_LBTK.dtype == jnp.int32
  (_, (logits, ids)), grads = _loss_and_grad(params, tokens_BT, None)
  (_, (logits_r, ids_r)), grads_r = _loss_and_grad(params, tokens_BT, own_LBTK)
  np.testing.assert_array_equal(ids, own_LBTK)
  np.testing.assert_array_equal(ids_r, own_LBTK)
  np.testing.assert_array_equal(logits_r, logits)
  chex.assert_trees_all_equal(grads_r, grads)
  # With a KV cache (the trainer's student forward when a teacher reuses the prefix).
  cached = jax.jit(
    lambda p, t, r: model.apply(p, CFG, t, cache=model.init_cache(CFG, B, T + 4), routed_experts=r)
  )
  logits_c, aux_c = cached(params, tokens_BT, own_LBTK)
  np.testing.assert_allclose(logits_c, logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(aux_c["routed_experts"], own_LBTK)


def test_replayed_experts_are_used_and_the_router_learns(params, tokens_BT):
  own_LBTK = np.asarray(_own_routing(params, tokens_BT))
  forced_LBTK = (own_LBTK + 1) % CFG.n_experts  # distinct per token, never the own choice
  forced_LBTK[1, 0, :3] = -1  # layer 2, row 0, first 3 tokens: route themselves
  (_, (logits, ids)), grads = _loss_and_grad(params, tokens_BT, jnp.asarray(forced_LBTK))
  replayed = forced_LBTK[..., 0] >= 0
  np.testing.assert_array_equal(np.asarray(ids)[replayed], forced_LBTK[replayed])
  # Layer 2's own choice for the unforced tokens: the same as with layer 2 unforced altogether (its
  # input only depends on layer 1's experts, forced alike in both runs).
  layer2_free = forced_LBTK.copy()
  layer2_free[1] = -1
  (_, (_, ids_free)), _ = _loss_and_grad(params, tokens_BT, jnp.asarray(layer2_free))
  np.testing.assert_array_equal(np.asarray(ids)[~replayed], np.asarray(ids_free)[~replayed])
  (_, (own_logits, _)), _ = _loss_and_grad(params, tokens_BT, None)
  assert float(jnp.max(jnp.abs(logits - own_logits))) > 1e-2
  mlp = grads["moe_layers"]["mlp"]  # stacked: MoE layers 1 and 2 are rows 0 and 1
  for i in range(mlp["router"].shape[0]):
    assert float(jnp.max(jnp.abs(mlp["router"][i]))) > 0, i
    assert float(jnp.max(jnp.abs(mlp["router_bias"][i]))) == 0.0, i


def test_rejects_routed_experts_of_the_wrong_shape(params, tokens_BT):
  with pytest.raises(ValueError, match="routed_experts"):
    model.apply(params, CFG, tokens_BT, routed_experts=jnp.zeros((1, B, T, CFG.top_k), jnp.int32))


@pytest.fixture(scope="module")
def collected(params):
  """Greedy toy rollouts (2 turns: extend, decode, observation, extend, decode) with routing recorded."""
  env_list, seeds, groups = factories.toy_envs(RC)(1)
  engine = KVCacheSampler(CFG, RC, chat.BYTE_TOKENIZER, None)
  engine.update_weights(params)
  return rollout.collect(engine, env_list, seeds, jax.random.key(0), RC, chat.BYTE_TOKENIZER), groups


def test_collect_records_what_the_training_forward_chooses(params, collected):
  """Every fed token's recorded experts equal the full forward's choice over the finished trajectory;
  the only -1 rows are the tail appended after the last decode (never fed to the sampler)."""
  trajs, groups = collected
  batch = rl_batch_lib.rl_batch(trajs, groups)
  routed_BTLK = batch.routed_experts
  assert routed_BTLK.shape == (*batch.tokens.shape, CFG.n_moe_layers, CFG.top_k)
  full_LBTK = np.asarray(
    jax.jit(lambda p, t, pos, seg: model.apply(p, CFG, t, pos, segment_ids=seg)[1]["routed_experts"])(
      params, batch.tokens, batch.positions, batch.segment_ids
    )
  )
  full_BTLK = np.moveaxis(full_LBTK, 0, 2)
  n_fed = 0
  for b, traj in enumerate(trajs):
    rec_TLK = traj.routed_experts
    assert rec_TLK.shape == (len(traj), CFG.n_moe_layers, CFG.top_k)
    fed_T = rec_TLK[:, 0, 0] >= 0
    assert np.all(fed_T == (rec_TLK >= 0).all(axis=(1, 2)))
    n = int(fed_T.sum())
    assert n > 0 and np.all(fed_T[:n]), "fed tokens are a prefix of the trajectory"
    sampled_T = np.asarray(traj.loss_mask, bool)
    assert np.all(fed_T[sampled_T]), "with feed_last every sampled token was fed"
    np.testing.assert_array_equal(routed_BTLK[b, : len(traj)], rec_TLK)
    assert np.all(routed_BTLK[b, len(traj) :] == -1)
    mismatch = np.mean(np.sort(rec_TLK[:n], -1) != np.sort(full_BTLK[b, :n], -1))
    assert mismatch == 0.0, f"row {b}: {mismatch:.2%} of recorded expert ids differ from the full forward"
    n_fed += n
  assert n_fed > 40


def test_one_rl_step_with_routing_replay(params, collected):
  """The replayed loss equals the self-routed one (the recorded routing is the model's own here) and
  one jitted update runs with finite numbers; without recorded experts the step refuses."""
  trajs, groups = collected
  batch = jax.tree.map(jnp.asarray, rl_batch_lib.rl_batch(trajs, groups))
  plain = dataclasses.replace(RC, routing_replay=False)

  def _loss(p, b, rc):
    num, la = rl_loss_lib.rl_loss(p, b, cfg=CFG, ls=LossSettings.of(rc))
    return num / jnp.maximum(la.count, 1.0)

  loss = jax.jit(_loss, static_argnums=2)
  np.testing.assert_allclose(float(loss(params, batch, RC)), float(loss(params, batch, plain)), rtol=1e-6)
  # One update (plain SGD: this checks the replaying step, not the optimizer), with rewards that differ
  # within each group so the policy gradient is not zero.
  batch = batch.replace(rewards=jnp.asarray([1.0, 0.0] * (len(trajs) // 2), jnp.float32))
  tx = optax.sgd(1e-2)
  fresh = jax.tree.map(jnp.copy, params)  # the step donates its state
  state = TrainState(step=jnp.zeros((), jnp.int32), params=fresh, opt_state=tx.init(fresh))
  step = make_step(rl_step.loss_fn(CFG, LossSettings.of(RC)), tx, CFG, schedule=optax.constant_schedule(1e-2))
  state, m = step(state, batch)
  assert int(state.step) == 1 and int(m["skipped"]) == 0
  assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
  with pytest.raises(ValueError, match="routing_replay"):
    _loss(params, batch.replace(routed_experts=None), RC)
  unrecorded = chat.Trajectory()
  unrecorded.add_prompt([1, 2], chat.USER)
  assert unrecorded.routed_experts is None and rl_batch_lib.rl_batch([unrecorded], [0]).routed_experts is None
