"""The RL step on both meshes (8 devices: dense (4, 1, 2), expert (8, 1), sharded Muon, frozen teacher in the
optimizer state) equals the same step on one device: loss, metrics and updated params, with and without the
feedback branch. The batch is real rollouts of the toy env with wrong-tool turns the detector flags."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rl_loop import _wrong_then_right
from tiny import TINY

from composer_jax import configs, model, optim, sharding, train
from composer_jax.rl import batch as rl_batch_lib
from composer_jax.rl import step as rl_step
from composer_jax.rl.envs import toy
from composer_jax.rl.loss import LossSettings
from composer_jax.train.batch import place
from composer_jax.train.step import make_step

# The shared test model on the byte vocabulary; capacity_factor = n_experts keeps every EP send buffer
# dropless, so the sharded forward computes exactly what the one-device one does.
CFG = dataclasses.replace(TINY, vocab_size=272, max_position_embeddings=512)
# Feedback on all of turn k's tokens: at a random init teacher and student never part by a whole nat.
RC = configs.RLConfig(
  env="toy", max_turns=2, max_turn_tokens=8, lambda_feedback=1.0, teacher="frozen", feedback_rows=8,
  feedback_tokens="turn", router_bias_rate=1e-3,
)  # fmt: skip


def _batch(with_feedback: bool) -> rl_batch_lib.RLBatch:
  trajs = [_wrong_then_right(s) for s in range(8)]
  rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0, 0.0], np.float32)  # signal within each group
  infos = [toy.ToyEnv().info()] * len(trajs)
  b = rl_batch_lib.rl_batch(
    trajs, [i // 2 for i in range(8)], infos, with_feedback=with_feedback, rows_cap=RC.feedback_rows
  )
  return b.replace(rewards=rewards)


def _run(meshes, batch, params):
  # AdamW's first step is lr·g/(|g| + eps): with eps 1e-8 a vocabulary row the batch barely touches (|g|
  # ~1e-8) turns float-order differences of its gradient into lr-sized ones. What is under test is the
  # sharding, so eps sits well above that noise floor.
  ocfg = configs.OptimizerConfig(adam_eps=1e-4)
  ocfg = configs.stage_optimizer(ocfg, configs.ScheduleConfig(steps=10), lr=1e-2, min_lr_ratio=1.0)
  tx = rl_step.teacher_optimizer(optim.build_optimizer(CFG, ocfg, meshes), RC)
  if meshes is not None:
    params = jax.device_put(params, sharding.param_shardings(model.logical_axes(CFG), params, meshes))
  params = jax.tree.map(jnp.copy, params)  # the step donates its state
  state = train.create_state(CFG, tx, jax.random.key(0), meshes, params=params)
  step = make_step(
    rl_step.loss_fn(CFG, LossSettings.of(RC), meshes), tx, CFG, schedule=optim.lr_schedule(ocfg),
    meshes=meshes, state_sharding=train.state.state_shardings(state) if meshes is not None else None,
    router_bias_rate=RC.router_bias_rate,
  )  # fmt: skip
  state, m = step(state, place(batch, meshes))
  return jax.device_get(state.params), jax.device_get(m)


@pytest.mark.parametrize("with_feedback", [False, True], ids=["rl", "rl+feedback"])
def test_rl_step_on_both_meshes_equals_one_device(meshes, with_feedback):
  params = jax.device_get(model.init(CFG, jax.random.key(3)))
  batch = _batch(with_feedback)
  assert (batch.feedback is not None) == with_feedback
  p1, m1 = _run(None, batch, params)
  p8, m8 = _run(meshes, batch, params)
  assert m1["skipped"] == 0 and m8["skipped"] == 0
  if with_feedback:
    assert m1["feedback_tokens"] > 0 and m1["feedback_kl"] > 0  # the teacher branch really ran
  for k in (
    "loss",
    "policy_loss",
    "feedback_kl",
    "feedback_tokens",
    "grad_norm",
    "entropy",
    "muon_update_rms",
  ):
    np.testing.assert_allclose(m8[k], m1[k], rtol=2e-5, atol=1e-7, err_msg=k)
  moved = max(
    float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params), strict=True)
  )
  assert moved > 1e-4  # the update is not trivially zero
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p1), jax.tree.leaves(p8), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
