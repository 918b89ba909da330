"""Finer padding of the RL batch (`rl.batch_multiple`): the padded length changes no loss or gradient, and
the lengths it picks (`rl.batch.padded_length`).

Shape suffixes: B batch, T time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rl_loop import _wrong_then_right
from tiny import TINY

from composer_jax import configs, model
from composer_jax.rl import batch as rl_batch_lib
from composer_jax.rl.envs import toy
from composer_jax.rl.loss import LossSettings, rl_loss

CFG = dataclasses.replace(TINY, vocab_size=272, max_position_embeddings=512)


def test_padded_length_is_a_power_of_two_or_a_multiple():
  assert rl_batch_lib.padded_length(300, 256) == 512
  assert rl_batch_lib.padded_length(300, 256, multiple=64) == 320
  assert rl_batch_lib.padded_length(100, 256, multiple=64) == 256
  assert rl_batch_lib.padded_length(1100, 64, multiple=128) == 1152


@pytest.mark.parametrize("objective", ["drgrpo", "grpo"])
def test_the_padded_length_changes_no_loss_or_gradient(objective):
  """The same 8 rollouts padded to a multiple of 40 and to 256 (the power-of-two minimum):
  Dr. GRPO's normaliser is the constant token budget, GRPO's the per-row token count, so padding columns
  (masked out) change nothing."""
  trajs = [_wrong_then_right(s) for s in range(8)]
  infos = [toy.ToyEnv().info()] * len(trajs)
  rc = configs.RLConfig(env="toy", max_turns=2, max_turn_tokens=8, lambda_feedback=1.0, objective=objective,
                        feedback_tokens="turn")  # fmt: skip
  ls = LossSettings.of(rc)
  rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0, 0.0], np.float32)
  params = model.init(CFG, jax.random.key(5))

  def loss(p, b):
    num, la = rl_loss(p, b, p, cfg=CFG, ls=ls)
    return num / jnp.maximum(la.count, 1.0)

  out = []
  for min_len, multiple in ((40, 40), (256, 0)):
    b = rl_batch_lib.rl_batch(
      trajs, [i // 2 for i in range(8)], infos, with_feedback=True, min_len=min_len, multiple=multiple
    ).replace(rewards=rewards)
    out.append((b.tokens.shape[1], *jax.jit(jax.value_and_grad(loss))(params, b)))
  (t_short, l_short, g_short), (t_long, l_long, g_long) = out
  assert (t_short, t_long) == (120, 256)  # the longest rollout has 106 tokens
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(g_short)) > 1e-4  # a real gradient
  np.testing.assert_allclose(l_short, l_long, rtol=1e-5, atol=1e-8)
  for a, b in zip(jax.tree.leaves(g_short), jax.tree.leaves(g_long), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
