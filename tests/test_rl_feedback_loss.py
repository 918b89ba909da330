"""The feedback loss of issue 13 against independent references: first-divergence token selection on a
constructed example; the loss form's total = (policy sum + λ·Σ clipped divergence on the selected tokens)
/ the policy count, computed by hand from fresh forwards; the advantage form's clipped log-ratio; the frozen
teacher (still the starting weights after updates, and its logits equal the live teacher's at the start);
the null-hint arm's teacher input."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rl_loop import CFG, RC, _batch, _loss, _rows, _state, _step, _wrong_then_right

from composer_jax import model
from composer_jax.rl import batch as rl_batch_lib
from composer_jax.rl import chat, feedback
from composer_jax.rl import loss as rl_loss_lib
from composer_jax.rl import step as rl_step
from composer_jax.rl.envs import toy
from composer_jax.train.state import create_state

TOY = toy.ToyEnv().info()


def test_first_divergence_on_a_constructed_turn():
  gap = np.array(
    [
      [0.1, 0.2, 3.0, 0.1, 5.0, 9.0],  # first above 1.0 at 2 (position 5 is padding)
      [0.1, 0.2, 0.3, 0.0, 7.0, 7.0],  # none among the 4 real tokens: nothing selected
      [2.0, 0.1, 0.0, 0.0, 0.0, 0.0],  # the first token already diverges
      [0.0, -4.0, 0.5, 1.0, 1.5, 0.0],  # strictly above the threshold; a negative gap is no divergence
    ],
    np.float32,
  )
  mask = np.array(
    [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], np.float32
  )
  want = np.array([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], bool)
  np.testing.assert_array_equal(np.asarray(rl_loss_lib.first_divergence(gap, mask, 1.0)), want)


def _log_softmax64(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _by_hand(params, trajs):
  """Per flagged row: sampled ids, student and teacher log-softmax at turn k's tokens (fresh forwards)."""
  fwd = jax.jit(lambda p, t: model.apply(p, CFG, t)[0])
  rows = []
  for traj in trajs:
    k, kind = feedback.detect(traj, TOY)[0]
    ti = feedback.teacher_inputs(traj, k, feedback.hint_ids(feedback.hint_for(kind, TOY)))
    ls = _log_softmax64(fwd(params, jnp.asarray(traj.tokens)[None])[0])[ti.student_positions - 1]
    lt = _log_softmax64(fwd(params, jnp.asarray(ti.tokens)[None])[0])[ti.teacher_positions - 1]
    y = np.asarray(traj.tokens)[ti.student_positions]
    rows.append((y, ls, lt))
  return rows


@pytest.mark.parametrize("mode", ["loss", "advantage"])
def test_selected_clipped_feedback_on_the_policy_scale(mode):
  params = model.init(CFG, jax.random.key(3))
  params = {**params, "lm_head": params["lm_head"] * 30}  # sharper: the hint moves nats, not micro-nats
  trajs = [_wrong_then_right(5), _wrong_then_right(6)]
  batch = _batch(trajs)
  rows = _by_hand(params, trajs)
  ar = np.arange(len(rows[0][0]))
  gap0 = rows[0][1][ar, rows[0][0]] - rows[0][2][ar, rows[0][0]]
  j = int(np.argmax(gap0))
  tau = float(gap0[j]) - 1e-3  # row 0's first divergence is its largest gap: tokens 0..j selected
  y0, ls0, lt0 = rows[0]
  d0 = (np.exp(lt0) * (lt0 - ls0)).sum(-1)[: j + 1]
  clip, lam = float(np.median(d0)), 0.7  # some selected tokens above the cap, some below
  rc = dataclasses.replace(
    RC, divergence="forward_kl", feedback_tokens="first_divergence", divergence_threshold=tau,
    feedback_clip=clip, feedback_mode=mode,
  )  # fmt: skip
  loss_fn = jax.jit(
    lambda p, b, lam: _loss(p, b, dataclasses.replace(rc, lambda_feedback=lam), True), static_argnums=2
  )
  (l1, (m1, _)), (l0, _) = loss_fn(params, batch, lam), loss_fn(params, batch, 0.0)
  total_d = total_adv = n_sel = 0.0
  for y, ls, lt in rows:
    ar = np.arange(len(y))
    gap = ls[ar, y] - lt[ar, y]
    hits = np.flatnonzero(gap > tau)
    sel = ar <= hits[0] if len(hits) else np.zeros(len(y), bool)
    d = (np.exp(lt) * (lt - ls)).sum(-1)  # forward KL(teacher ‖ student)
    total_d += np.minimum(d, clip)[sel].sum()
    total_adv += lam * np.clip(-gap, -clip, clip)[sel].sum()
    n_sel += sel.sum()
  assert j > 0 and float(m1["feedback_kl"][1]) == n_sel
  assert float(m1["feedback_kl"][0]) == pytest.approx(total_d, rel=1e-4)
  if mode == "loss":  # Dr. GRPO: Σ / (max_len · rows), the policy loss's own normaliser
    max_len = rc.max_turns * rc.max_turn_tokens
    assert float(l1 - l0) == pytest.approx(lam * total_d / (max_len * 2), rel=1e-4)
  else:
    assert float(m1["feedback_advantage"][0]) == pytest.approx(total_adv, rel=1e-4, abs=1e-6)


def test_frozen_teacher_stays_and_starts_equal_to_the_live_one():
  rc = dataclasses.replace(RC, teacher="frozen", router_bias_rate=0.0, divergence="forward_kl")
  _, tx, schedule = _state()
  tx = rl_step.teacher_optimizer(tx, rc)
  state = create_state(CFG, tx, jax.random.key(1), None)
  start = jax.tree.map(np.asarray, state.params)
  batch = _batch([_wrong_then_right(31), _wrong_then_right(32)])
  L = batch.feedback.teacher_tokens.shape[1]
  live = jax.jit(
    lambda p: rl_loss_lib.teacher_logits(
      p, CFG, rl_loss_lib.student_forward(p, CFG, _rows(batch), L)[1]["cache"], batch
    )
  )
  frozen = jax.jit(lambda p, t: rl_loss_lib.teacher_logits(p, CFG, None, batch, t))
  n = np.asarray(batch.feedback.fb_mask) > 0
  np.testing.assert_allclose(
    np.asarray(frozen(state.params, state.opt_state.teacher))[n], np.asarray(live(state.params))[n], atol=1e-5
  )
  step = _step(tx, schedule, rc)
  for _ in range(2):
    state, m = step(state, batch)
    assert float(m["skipped"]) == 0
  moved = [
    float(np.max(np.abs(np.asarray(a) - b)))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(start), strict=True)
  ]
  assert max(moved) > 0
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, state.opt_state.teacher), start)


def test_null_hint_arm_inserts_the_neutral_note():
  trajs = [_wrong_then_right(41)]
  b = rl_batch_lib.rl_batch(trajs, [0], [TOY], with_feedback=True, variant="null")
  note = feedback.hint_ids(feedback.NULL_NOTE)
  assert b.feedback.teacher_tokens[0, : len(note)].tolist() == note
  task = rl_batch_lib.rl_batch(trajs, [0], [TOY], with_feedback=True)
  hint = feedback.hint_ids(feedback.hint_for("unknown_tool", TOY))
  assert task.feedback.teacher_tokens[0, : len(hint)].tolist() == hint
  # The same turn tokens follow either message, aligned with the same student columns.
  n = int(b.feedback.fb_mask[0].sum())
  np.testing.assert_array_equal(b.feedback.fb_cols[0, :n], task.feedback.fb_cols[0, :n])
  assert chat.BYTE_TOKENIZER.decode(b.feedback.teacher_tokens[0, len(note) :].tolist()).startswith(
    "<|assistant|>"
  )
