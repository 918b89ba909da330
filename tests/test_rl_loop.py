"""The RL loop: the prefix-KV teacher against a fresh forward, the feedback term's algebra inside the step,
SFT lowering its loss, one RL step end to end on the toy env, and a failing env that never stops a step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import configs, model, optim, rl
from composer_jax.model import ModelConfig, RopeConfig
from composer_jax.rl import batch as rl_batch_lib
from composer_jax.rl import chat, feedback, sft
from composer_jax.rl import loop as rl_loop
from composer_jax.rl import loss as rl_loss_lib
from composer_jax.rl import step as rl_step
from composer_jax.rl.envs import factories, toy
from composer_jax.rl.loss import LossSettings
from composer_jax.train import loop as train_loop
from composer_jax.train.losses import token_logp
from composer_jax.train.state import create_state
from composer_jax.train.step import make_step, next_token_loss

TOK = chat.BYTE_TOKENIZER

# A few-thousand-parameter MoE model on the byte vocabulary: 1 dense + 1 MoE layer, dropless experts
# (a token's output never depends on which other tokens share the batch).
CFG = ModelConfig(
  vocab_size=272,
  d_model=32,
  n_layers=2,
  n_heads=2,
  dense_mlp_dim=64,
  moe_mlp_dim=16,
  n_experts=4,
  top_k=2,
  n_group=1,
  topk_group=1,
  first_k_dense=1,
  q_lora_rank=16,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=4,
  v_head_dim=8,
  max_position_embeddings=512,
  expert_impl="blocked",
  rope=RopeConfig(theta=10000.0),
)
# The whole-turn, reverse-KL, unclipped, live-teacher form: what these tests check the plumbing of
# (tests/test_rl_feedback_loss.py checks the selected, clipped, frozen-teacher form against references).
RC = configs.RLConfig(
  env="toy",
  schedule=configs.ScheduleConfig(steps=1),
  problems_per_step=2,
  group_size=2,
  max_turns=2,
  max_turn_tokens=8,
  cache_len=192,
  lambda_feedback=1.0,
  divergence="reverse_kl",
  feedback_tokens="turn",
  feedback_clip=0.0,
  teacher="live",
)


@pytest.fixture(scope="module")
def params():
  return model.init(CFG, jax.random.key(0))


def _wrong_then_right(prob_seed: int) -> chat.Trajectory:
  """A toy rollout with an unknown tool in turn 1 (detected), then a valid call; logprobs -1."""
  env = toy.ToyEnv()
  traj = rl.envs.begin(env, prob_seed)
  p = env.problem
  op, a, b, _ = p.steps[0]
  for call in [("sum", str(a), str(b)), (op, str(a), str(b))]:
    ids = chat.assistant_ids(call=call)
    rl.envs.advance(env, traj, ids, [-1.0] * len(ids))
  return rl.envs.finish(env, traj)


def _batch(trajs, with_feedback=True):
  infos = [toy.ToyEnv().info()] * len(trajs)
  b = rl_batch_lib.rl_batch(trajs, list(range(len(trajs))), infos, with_feedback=with_feedback)
  return jax.tree.map(jnp.asarray, b)


def _rows(batch):
  return batch.tokens, batch.positions, batch.segment_ids


def _loss(params, batch, rc, with_feedback=True, teacher=None):
  """The RL loss as a mean (numerator / count), its metrics and the model's aux."""
  b = batch if with_feedback else batch.replace(feedback=None)
  num, la = rl_loss_lib.rl_loss(params, b, teacher, cfg=CFG, ls=LossSettings.of(rc))
  return num / jnp.maximum(la.count, 1.0), (la.metrics, la.aux)


def _step(tx, schedule, rc):
  """The RL step as the rl stage builds it (one device)."""
  rl_step.check_config(rc)
  loss = rl_step.loss_fn(CFG, LossSettings.of(rc))
  return make_step(loss, tx, CFG, schedule=schedule, router_bias_rate=rc.router_bias_rate)


def test_prefix_kv_teacher_equals_fresh_forward(params):
  # Row 1 has no mistake: the teacher runs on the flagged rows (0 and 2) only.
  env = toy.ToyEnv()
  clean = rl.envs.begin(env, 4)
  op, a, b, _ = env.problem.steps[0]
  ids = chat.assistant_ids(call=(op, str(a), str(b)))
  rl.envs.advance(env, clean, ids, [-1.0] * len(ids))
  trajs = [_wrong_then_right(3), rl.envs.finish(env, clean), _wrong_then_right(11)]
  batch = _batch(trajs)
  assert batch.feedback.fb_rows.shape[0] == 16 and list(np.asarray(batch.feedback.fb_rows[:2])) == [0, 2]
  assert list(np.asarray(batch.feedback.teacher_lengths[2:])) == [0] * 14  # bucket padding
  L = batch.feedback.teacher_tokens.shape[1]

  @jax.jit
  def run(params, batch):
    logits_BTV, aux = rl_loss_lib.student_forward(params, CFG, _rows(batch), L)
    plain_BTV, _ = model.apply(params, CFG, batch.tokens, batch.positions, segment_ids=batch.segment_ids)
    t_FNV = rl_loss_lib.teacher_logits(params, CFG, aux["cache"], batch)
    return (
      logits_BTV,
      plain_BTV,
      t_FNV,
      rl_loss_lib.student_feedback_logits(params, CFG, aux["hidden"], batch),
    )

  logits_BTV, plain_BTV, t_FNV, s_FNV = map(np.asarray, run(params, batch))
  m = np.asarray(batch.segment_ids) > 0
  np.testing.assert_allclose(logits_BTV[m], plain_BTV[m], atol=1e-5)
  forward = jax.jit(lambda p, t: model.apply(p, CFG, t)[0])
  for f, b in enumerate((0, 2)):
    traj = trajs[b]
    k, kind = feedback.detect(traj, toy.ToyEnv().info())[0]
    assert kind == "unknown_tool"
    ti = feedback.teacher_inputs(traj, k, feedback.hint_ids(feedback.hint_for(kind, toy.ToyEnv().info())))
    fresh_TV = forward(params, jnp.asarray(ti.tokens)[None])
    n = int(np.sum(batch.feedback.fb_mask[f]))
    np.testing.assert_array_equal(np.asarray(batch.feedback.fb_cols[f, :n]), ti.student_positions - 1)
    np.testing.assert_allclose(t_FNV[f, :n], np.asarray(fresh_TV[0, ti.teacher_positions - 1]), atol=1e-5)
    np.testing.assert_allclose(s_FNV[f, :n], logits_BTV[b, ti.student_positions - 1], atol=1e-5)


def _loss_terms(params, batch, lam=1.0, **kw):
  rc = dataclasses.replace(RC, lambda_feedback=lam, **kw)
  loss, (m, _) = jax.jit(lambda p, b: _loss(p, b, rc, True))(params, batch)
  return loss, m


def test_empty_hint_gives_zero_feedback_and_only_turn_k_counts(params):
  trajs = [_wrong_then_right(5)]
  batch = _batch(trajs)
  # Teacher context = student context: drop the hint from the extension (turn k's tokens only).
  k = feedback.detect(trajs[0], toy.ToyEnv().info())[0][0]
  ti = feedback.teacher_inputs(trajs[0], k, [])
  ext = ti.tokens[ti.hint_start :]
  tt = np.zeros_like(batch.feedback.teacher_tokens)
  tt[0, : len(ext)] = ext
  lengths = np.zeros_like(batch.feedback.teacher_lengths)
  lengths[0] = len(ext)
  cols = np.zeros_like(batch.feedback.teacher_cols)
  cols[0, : len(ti.student_positions)] = ti.teacher_positions - 1 - ti.hint_start
  fb = batch.feedback.replace(
    teacher_tokens=jnp.asarray(tt), teacher_lengths=jnp.asarray(lengths), teacher_cols=jnp.asarray(cols)
  )
  batch = batch.replace(feedback=fb)
  _, m = _loss_terms(params, batch)
  assert float(m["feedback_kl"][0]) == pytest.approx(0.0, abs=1e-5)
  _, m_adv = _loss_terms(params, batch, feedback_mode="advantage")
  assert float(m_adv["feedback_advantage"][0]) == pytest.approx(0.0, abs=1e-5)
  # The feedback columns are exactly turn k's sampled tokens (shifted by one: logits predict the next).
  s, e = trajs[0].spans[k]
  want = [p - 1 for p in range(s, e) if trajs[0].loss_mask[p]]
  n = int(np.sum(batch.feedback.fb_mask[0]))
  np.testing.assert_array_equal(np.asarray(batch.feedback.fb_cols[0, :n]), want)
  assert float(m["feedback_kl"][1]) == len(want)


def test_feedback_gradient_only_via_student_on_turn_k(params):
  trajs = [_wrong_then_right(7)]
  batch = _batch(trajs)
  T, L = batch.tokens.shape[1], batch.feedback.teacher_tokens.shape[1]

  @jax.jit
  def both(p):
    _, aux = rl_loss_lib.student_forward(p, CFG, _rows(batch), L)
    return aux["hidden"], aux["cache"], rl_loss_lib.teacher_logits(p, CFG, aux["cache"], batch)

  hidden, cache, t_logits = both(params)
  s_FNV = rl_loss_lib.student_feedback_logits(params, CFG, hidden, batch)

  # No gradient reaches the teacher: not through its weights, not through the reused prefix KV.
  @jax.jit
  def via_teacher(p, kv):
    c = {**cache, **kv}
    s, n = rl.feedback_loss(s_FNV, rl_loss_lib.teacher_logits(p, CFG, c, batch), batch.feedback.fb_mask)
    return s / n

  kv = {"latent": cache["latent"], "k_rope": cache["k_rope"]}
  g_params, g_cache = jax.grad(via_teacher, argnums=(0, 1))(params, kv)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves((g_params, g_cache)))

  # Only turn k's columns of the student contribute, and the hint changes the teacher (loss > 0).
  def on_hidden(h):
    s_FNV = rl_loss_lib.student_feedback_logits(params, CFG, h, batch)
    s, n = rl.feedback_loss(s_FNV, t_logits, batch.feedback.fb_mask)
    return s / n

  assert float(on_hidden(hidden)) > 0
  g_TV = np.asarray(jax.grad(on_hidden)(hidden))[0]
  touched = np.flatnonzero(np.abs(g_TV).sum(-1) > 0)
  n = int(np.sum(batch.feedback.fb_mask[0]))
  cols = np.asarray(batch.feedback.fb_cols[0, :n])
  assert len(touched) > 0 and set(touched) <= set(cols) and len(cols) < T


def test_feedback_advantage_is_sampled_token_log_ratio(params):
  """feedback_mode="advantage": λ·(log q(y) − log p(y)) lands on turn k's tokens (and nowhere else),
  checked against log-probs read off the student and a fresh hinted forward."""
  trajs = [_wrong_then_right(13)]
  batch = _batch(trajs)
  L = batch.feedback.teacher_tokens.shape[1]
  logits, aux = jax.jit(lambda p: rl_loss_lib.student_forward(p, CFG, _rows(batch), L))(params)
  t_FNV = rl_loss_lib.teacher_logits(params, CFG, aux["cache"], batch)
  logp_BT = token_logp(logits, batch.tokens)
  adv_BT = np.asarray(rl_loss_lib.feedback_advantages(t_FNV, logp_BT, batch, 0.5))
  k, kind = feedback.detect(trajs[0], toy.ToyEnv().info())[0]
  ti = feedback.teacher_inputs(trajs[0], k, feedback.hint_ids(feedback.hint_for(kind, toy.ToyEnv().info())))
  fresh = np.asarray(jax.nn.log_softmax(model.apply(params, CFG, jnp.asarray(ti.tokens)[None])[0][0], -1))
  y = ti.tokens[ti.teacher_positions]
  logq = fresh[ti.teacher_positions - 1, y]
  want = np.zeros_like(adv_BT)
  want[0, ti.student_positions] = 0.5 * (logq - np.asarray(logp_BT)[0, ti.student_positions])
  np.testing.assert_allclose(adv_BT, want, atol=1e-5)
  assert np.abs(want).sum() > 0


def test_lambda_zero_or_no_detection_gives_exactly_zero(params):
  trajs = [_wrong_then_right(9)]
  batch = _batch(trajs)
  base, _ = jax.jit(lambda p, b: _loss(p, b, RC, False))(params, batch)
  for mode in rl_step.FEEDBACK_MODES:
    rc0 = dataclasses.replace(RC, lambda_feedback=0.0, feedback_mode=mode)
    with_fb = jax.jit(lambda p, b, rc0=rc0: _loss(p, b, rc0, True))
    loss0, (m0, _) = with_fb(params, batch)
    assert float(m0["feedback_kl"][0]) > 0 and float(loss0) == pytest.approx(float(base), abs=1e-6), mode
    no_fb = batch.replace(feedback=batch.feedback.replace(fb_mask=jnp.zeros_like(batch.feedback.fb_mask)))
    _, (m1, _) = with_fb(params, no_fb)
    assert float(m1["feedback_kl"][0]) == 0.0 and float(m1["feedback_kl"][1]) == 0.0


def test_dynamic_sampling_drops_all_equal_groups(params):
  trajs = [_wrong_then_right(s) for s in (21, 22, 23, 24)]
  batch = _batch(trajs, with_feedback=False).replace(
    group_ids=jnp.asarray([0, 0, 1, 1], jnp.int32),
    rewards=jnp.asarray([1.0, 0.0, 1.0, 1.0], jnp.float32),  # group 1 has no signal
  )
  rc = dataclasses.replace(RC, dynamic_sampling=True, objective="dapo")
  _, (m, _) = jax.jit(lambda p, b: _loss(p, b, rc, False))(params, batch)
  assert float(m["kept_rollouts"][0]) == 2.0
  n_tokens = float(np.sum(np.asarray(batch.loss_mask)[:2]))
  assert float(m["policy_loss"][1]) == n_tokens  # DAPO's token count covers group 0 only


def test_ema_teacher_tracks_params_and_bad_settings_raise():
  # No router-bias nudge: the EMA follows the optimizer's update, the bias moves after it.
  rc = dataclasses.replace(RC, teacher="ema", teacher_ema_rate=0.5, router_bias_rate=0.0)
  _, tx, schedule = _state()
  tx = rl_step.teacher_optimizer(tx, rc)
  state = create_state(CFG, tx, jax.random.key(1), None)
  step = _step(tx, schedule, rc)
  batch = _batch([_wrong_then_right(31), _wrong_then_right(32)])
  before = jax.tree.map(np.asarray, state.params)
  state, m = step(state, batch)
  assert np.isfinite(float(m["feedback_kl"])) and float(m["skipped"]) == 0
  # teacher = 0.5·old + 0.5·new for every leaf
  for t, old, new in zip(
    jax.tree.leaves(state.opt_state.teacher),
    jax.tree.leaves(before),
    jax.tree.leaves(state.params),
    strict=True,
  ):
    np.testing.assert_allclose(np.asarray(t), 0.5 * old + 0.5 * np.asarray(new), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="teacher_optimizer"):
    plain_state, plain_tx, _ = _state()
    _step(plain_tx, schedule, rc)(plain_state, batch)
  with pytest.raises(ValueError, match="feedback_mode"):
    _step(tx, schedule, dataclasses.replace(RC, feedback_mode="bogus"))


def _state(lr=3e-3, steps=10):
  ocfg = optim.OptimizerConfig(learning_rate=lr, warmup_steps=1, total_steps=steps, weight_decay=0.0)
  tx = optim.build_optimizer(CFG, ocfg, None)
  return create_state(CFG, tx, jax.random.key(1), None), tx, optim.lr_schedule(ocfg)


def test_sft_steps_lower_the_loss():
  state, tx, schedule = _state(lr=1e-2, steps=8)
  demos = toy.demonstrations(16, seed=0)
  step = make_step(next_token_loss(CFG, None), tx, CFG, schedule=schedule, router_bias_rate=1e-3)
  batch = sft.sft_batch(demos, sft.pad_length(max(len(d) for d in demos)))
  losses = []
  for _ in range(8):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
  assert losses[-1] < losses[0] - 0.3, losses
  # One program for all 8 steps: a fresh state's scalars are committed like the step's outputs
  # (an uncommitted step counter compiled the step again at step 2).
  assert step._cache_size() == 1


def test_one_rl_step_end_to_end_and_env_failure_marks_rollout():
  state, tx, schedule = _state()
  step = _step(tx, schedule, RC)
  base = factories.toy_envs(RC)

  class Exploding(toy.ToyEnv):
    def step(self, call):
      raise RuntimeError("sandbox died")

  def make(step):
    env_list, seeds, groups = base(step)
    env_list[0] = Exploding(env_list[0].cfg)
    return env_list, seeds, groups

  hooks = rl_loop.hooks(make, CFG, RC, TOK)
  state, result = train_loop.fit(state, step, RC.schedule, hooks, name="rl")
  assert result.failed_steps == 0 and len(result.history) == 1 and int(state.step) == 1, result
  h = result.history[0]
  assert h["failed_rollouts"] >= 1
  for k in ("reward", "invalid_call_rate", "entropy", "clip_frac", "logp_abs_diff", "feedback_kl", "loss"):
    assert np.isfinite(h[k]), (k, h[k])
  assert h["logp_abs_diff"] < 1e-4  # the sampler's logprobs are the trainer's
