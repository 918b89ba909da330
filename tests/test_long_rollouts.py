"""Memory bounded in the rollout length (issue 40): attention over query chunks, the RL loss over column
chunks, and the RL update in micro-batches under a token budget, each equal to the whole-batch path.

Shape suffixes: B batch, T time, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_model import random_params
from test_rl_loop import _wrong_then_right
from tiny import TINY

from composer_jax import configs, model, optim, rl, sharding, train
from composer_jax.model import attention_kernels
from composer_jax.rl import batch as rl_batch_lib
from composer_jax.rl import chat
from composer_jax.rl import step as rl_step
from composer_jax.rl.envs import toy
from composer_jax.rl.loss import LossSettings
from composer_jax.train.batch import place
from composer_jax.train.step import gradients

B, T = 2, 32


def _rows():
  """Two rows of packed documents (positions restart per document) with right padding (segment 0)."""
  rng = np.random.default_rng(7)
  tokens_BT = rng.integers(1, TINY.vocab_size, (B, T)).astype(np.int32)
  seg_BT = np.repeat(np.array([[1, 2, 3, 0], [1, 2, 2, 3]], np.int32), [9, 11, 7, 5], axis=1)
  pos_BT = np.concatenate([np.arange(n) for n in (9, 11, 7, 5)])[None].repeat(B, 0).astype(np.int32)
  return tokens_BT, pos_BT, seg_BT


@pytest.mark.parametrize("impl", ["xla", "absorbed"])
def test_query_chunks_give_the_whole_attention_and_its_gradients(impl):
  """Chunks of 8 (4 chunks) and of 12 (T = 32: 4 chunks of 8, the fewest that divide) against one pass."""
  params = random_params(TINY, seed=11)
  tokens_BT, pos_BT, seg_BT = _rows()

  def loss(p, chunk):
    cfg = dataclasses.replace(TINY, attention_impl=impl, attention_chunk=chunk)
    logits_BTV, aux = model.apply(p, cfg, tokens_BT, pos_BT, segment_ids=seg_BT)
    return (logits_BTV.astype(np.float32) ** 2).mean(), (logits_BTV, aux["max_logit"])

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (want, (logits_w, max_w)), g_w = grad(params, 0)
  assert np.abs(np.asarray(logits_w)).max() > 0.1
  for chunk in (8, 12):
    (got, (logits_g, max_g)), g_g = grad(params, chunk)
    np.testing.assert_allclose(logits_g, logits_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(max_g, max_w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_g, g_w)


def test_chunk_count_divides_the_length():
  assert attention_kernels.chunk_count(2048, 512) == 4
  assert attention_kernels.chunk_count(512, 512) == 1
  assert attention_kernels.chunk_count(1152, 512) == 3  # 384 each
  assert attention_kernels.chunk_count(1088, 512) == 4  # 1088 = 4 x 272
  assert attention_kernels.chunk_count(100, 0) == 1


# --- the RL update in micro-batches ---------------------------------------------------------------

RL_CFG = dataclasses.replace(TINY, vocab_size=272, max_position_embeddings=512)


def _right_only(prob_seed: int):
  """A toy rollout that calls the right tool at once (nothing for the detectors to flag)."""
  env = toy.ToyEnv()
  traj = rl.envs.begin(env, prob_seed)
  op, a, b, _ = env.problem.steps[0]
  ids = chat.assistant_ids(call=(op, str(a), str(b)))
  rl.envs.advance(env, traj, ids, [-0.5] * len(ids))
  return rl.envs.finish(env, traj)


def _rl_batch(rows: int = 16):
  """`rows` toy rollouts in groups of 4, a third of them with a flagged wrong-tool turn, rewards that
  differ within each group."""
  trajs = [_wrong_then_right(s) if s % 3 == 0 else _right_only(s) for s in range(rows)]
  infos = [toy.ToyEnv().info()] * rows
  b = rl_batch_lib.rl_batch(trajs, [i // 4 for i in range(rows)], infos, with_feedback=True, rows_cap=8)
  rewards = np.random.default_rng(0).choice([0.0, 0.5, 1.0], rows).astype(np.float32)
  return b.replace(rewards=rewards)


def _grads(meshes, batch, params, rc):
  """(gradients, loss, metrics) of the RL loss on `batch` with a frozen teacher (= the params)."""
  ocfg = configs.stage_optimizer(
    configs.OptimizerConfig(), configs.ScheduleConfig(steps=10), lr=1e-2, min_lr_ratio=1.0
  )
  tx = rl_step.teacher_optimizer(optim.build_optimizer(RL_CFG, ocfg, meshes), rc)
  if meshes is not None:
    params = jax.device_put(params, sharding.param_shardings(model.logical_axes(RL_CFG), params, meshes))
  state = train.create_state(RL_CFG, tx, jax.random.key(0), meshes, params=params)
  loss_fn = rl_step.loss_fn(RL_CFG, LossSettings.of(rc), meshes)
  g, loss, la = jax.jit(lambda s, b: gradients(loss_fn, s, b))(state, place(batch, meshes))
  metrics = {k: s / max(c, 1.0) for k, (s, c) in jax.device_get(la.metrics).items()}
  return jax.device_get(g), float(loss), metrics


@pytest.mark.parametrize("devices, objective", [(1, "grpo"), (8, "drgrpo")])
def test_micro_batches_give_the_whole_batch_gradient(meshes, devices, objective):
  """16 rollouts (groups of 4 split across micro-batches, feedback rows on some) in one pass vs 4
  micro-batches of 4: same loss, metrics and gradients to fp32 tolerance, on one device and on 8."""
  rc = configs.RLConfig(
    env="toy", max_turns=2, max_turn_tokens=8, lambda_feedback=1.0, feedback_rows=8, feedback_tokens="turn",
    objective=objective, advantage="grpo" if objective == "grpo" else "drgrpo",
  )  # fmt: skip
  m = meshes if devices == 8 else None
  params = jax.device_get(model.init(RL_CFG, jax.random.key(3)))
  whole = _rl_batch()
  split = rl_batch_lib.micro_batched(whole, 4)
  assert split.micro_batches == 4 and int(np.sum(whole.feedback.teacher_lengths > 0)) == 6
  g1, loss1, m1 = _grads(m, whole, params, rc)
  g4, loss4, m4 = _grads(m, split, params, rc)
  assert m1["feedback_tokens"] > 0 and abs(m1["feedback_kl"]) > 0 and abs(loss1) > 1e-4
  np.testing.assert_allclose(loss4, loss1, atol=1e-7)  # a sum of terms ~1e-3 that nearly cancel
  for k in ("policy_loss", "feedback_loss", "feedback_kl", "feedback_tokens", "entropy", "kept_rollouts"):
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
  scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(g1))
  assert scale > 1e-4
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g4), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path))


def test_micro_rows_fit_the_budget_and_the_devices():
  assert rl_batch_lib.micro_rows(64, 2048, 0) == 64
  assert rl_batch_lib.micro_rows(64, 2048, 16384) == 8
  assert rl_batch_lib.micro_rows(64, 2048, 10000, multiple=4) == 4
  assert rl_batch_lib.micro_rows(64, 2048, 1000) == 1  # one rollout over the budget still runs
  assert rl_batch_lib.micro_rows(48, 512, 8192, multiple=4) == 16
