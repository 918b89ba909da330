"""The RL loop: the prefix-KV teacher against a fresh forward, the feedback term's algebra inside the step,
SFT lowering its loss, one RL step end to end on the toy env, and a failing env that never stops a step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import model, optim
from composer_jax.model import ModelConfig, RopeConfig
from composer_jax.rl import chat, feedback, sft
from composer_jax.rl import train as rl_train
from composer_jax.rl.envs import toy
from composer_jax.train.state import create_state

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
RC = rl_train.RLConfig(
  steps=1,
  problems_per_step=2,
  group_size=2,
  max_turns=2,
  max_turn_tokens=8,
  cache_len=192,
  lambda_feedback=1.0,
)


@pytest.fixture(scope="module")
def params():
  return model.init(CFG, jax.random.key(0))


def _wrong_then_right(prob_seed: int) -> chat.Trajectory:
  """A toy rollout with an unknown tool in turn 1 (detected), then a valid call; logprobs -1."""
  env = toy.ToyEnv()
  traj = rl_train.envs.begin(env, prob_seed)
  p = env.problem
  op, a, b, _ = p.steps[0]
  for call in [("sum", str(a), str(b)), (op, str(a), str(b))]:
    ids = chat.assistant_ids(call=call)
    rl_train.envs.advance(env, traj, ids, [-1.0] * len(ids))
  return rl_train.envs.finish(env, traj)


def _batch(trajs, with_feedback=True):
  infos = [toy.ToyEnv().info()] * len(trajs)
  b = rl_train.rl_batch(trajs, list(range(len(trajs))), infos, with_feedback=with_feedback)
  return {k: jnp.asarray(v) for k, v in b.items()}


def test_prefix_kv_teacher_equals_fresh_forward(params):
  trajs = [_wrong_then_right(3), _wrong_then_right(11)]
  batch = _batch(trajs)
  L = batch["teacher_tokens"].shape[1]

  @jax.jit
  def run(params, batch):
    logits_BTV, aux = rl_train.student_forward(params, CFG, batch, L)
    plain_BTV, _ = model.apply(
      params, CFG, batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"]
    )
    return logits_BTV, plain_BTV, rl_train.teacher_logits(params, CFG, aux["cache"], batch)

  logits_BTV, plain_BTV, t_BTV = map(np.asarray, run(params, batch))
  m = np.asarray(batch["segment_ids"]) > 0
  np.testing.assert_allclose(logits_BTV[m], plain_BTV[m], atol=1e-5)
  forward = jax.jit(lambda p, t: model.apply(p, CFG, t)[0])
  for b, traj in enumerate(trajs):
    k, kind = feedback.detect(traj, toy.ToyEnv().info())[0]
    assert kind == "unknown_tool"
    ti = feedback.teacher_inputs(traj, k, feedback.hint_ids(feedback.hint_for(kind, toy.ToyEnv().info())))
    fresh_TV = forward(params, jnp.asarray(ti.tokens)[None])
    cols = np.flatnonzero(np.asarray(batch["fb_mask"][b]))
    np.testing.assert_array_equal(cols, ti.student_positions - 1)
    np.testing.assert_allclose(t_BTV[b, cols], np.asarray(fresh_TV[0, ti.teacher_positions - 1]), atol=1e-5)


def _loss_terms(params, batch, lam=1.0):
  rc = dataclasses.replace(RC, lambda_feedback=lam)
  loss, (m, _) = jax.jit(lambda p, b: rl_train.rl_loss(p, CFG, b, rc, True))(params, batch)
  return loss, m


def test_empty_hint_gives_zero_feedback_and_only_turn_k_counts(params):
  trajs = [_wrong_then_right(5)]
  batch = dict(_batch(trajs))
  # Teacher context = student context: drop the hint from the extension (turn k's tokens only).
  b = rl_train.rl_batch(trajs, [0], [toy.ToyEnv().info()], with_feedback=True)
  k = feedback.detect(trajs[0], toy.ToyEnv().info())[0][0]
  ti = feedback.teacher_inputs(trajs[0], k, [])
  ext = ti.tokens[ti.hint_start :]
  tt = np.zeros_like(b["teacher_tokens"])
  tt[0, : len(ext)] = ext
  batch |= {
    "teacher_tokens": jnp.asarray(tt),
    "teacher_lengths": jnp.asarray([len(ext)], jnp.int32),
    "teacher_index": jnp.asarray(
      np.where(b["fb_mask"] > 0, np.arange(b["fb_mask"].shape[1]) - ti.hint_start, 0)
    ),
  }
  _, m = _loss_terms(params, batch)
  assert float(m["feedback_kl"][0]) == pytest.approx(0.0, abs=1e-5)
  # The feedback mask covers exactly turn k's sampled tokens (shifted by one: logits predict the next).
  s, e = trajs[0].spans[k]
  want = [p - 1 for p in range(s, e) if trajs[0].loss_mask[p]]
  np.testing.assert_array_equal(np.flatnonzero(b["fb_mask"][0]), want)
  assert float(m["feedback_kl"][1]) == len(want)


def test_feedback_gradient_only_via_student_on_turn_k(params):
  trajs = [_wrong_then_right(7)]
  batch = _batch(trajs)
  T, L = batch["tokens"].shape[1], batch["teacher_tokens"].shape[1]

  @jax.jit
  def both(p):
    logits, aux = rl_train.student_forward(p, CFG, batch, L)
    return logits, aux["cache"], rl_train.teacher_logits(p, CFG, aux["cache"], batch)

  logits, cache, t_logits = both(params)

  # No gradient reaches the teacher: not through its weights, not through the reused prefix KV.
  @jax.jit
  def via_teacher(p, kv):
    c = {**cache, **kv}
    s, n = rl_train.feedback_loss(logits, rl_train.teacher_logits(p, CFG, c, batch), batch["fb_mask"])
    return s / n

  kv = {"latent": cache["latent"], "k_rope": cache["k_rope"]}
  g_params, g_cache = jax.grad(via_teacher, argnums=(0, 1))(params, kv)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves((g_params, g_cache)))

  # Only turn k's columns of the student contribute, and the hint changes the teacher (loss > 0).
  def on_logits(lg):
    s, n = rl_train.feedback_loss(lg, t_logits, batch["fb_mask"])
    return s / n

  assert float(on_logits(logits)) > 0
  g_TV = np.asarray(jax.grad(on_logits)(logits))[0]
  touched = np.flatnonzero(np.abs(g_TV).sum(-1) > 0)
  cols = np.flatnonzero(np.asarray(batch["fb_mask"][0]))
  assert len(touched) > 0 and set(touched) <= set(cols) and len(cols) < T


def test_lambda_zero_or_no_detection_gives_exactly_zero(params):
  trajs = [_wrong_then_right(9)]
  batch = dict(_batch(trajs))
  base, _ = jax.jit(lambda p, b: rl_train.rl_loss(p, CFG, b, RC, False))(params, batch)
  rc0 = dataclasses.replace(RC, lambda_feedback=0.0)
  with_fb = jax.jit(lambda p, b: rl_train.rl_loss(p, CFG, b, rc0, True))
  loss0, (m0, _) = with_fb(params, batch)
  assert float(m0["feedback_kl"][0]) > 0 and float(loss0) == pytest.approx(float(base), abs=1e-6)
  batch["fb_mask"] = jnp.zeros_like(batch["fb_mask"])  # no detected turn
  _, (m1, _) = with_fb(params, batch)
  assert float(m1["feedback_kl"][0]) == 0.0 and float(m1["feedback_kl"][1]) == 0.0


def _state(lr=3e-3, steps=10):
  ocfg = optim.OptimizerConfig(learning_rate=lr, warmup_steps=1, total_steps=steps, weight_decay=0.0)
  tx = optim.build_optimizer(
    ocfg, jax.eval_shape(lambda: model.init(CFG, jax.random.key(0))), None, model_cfg=CFG
  )
  return create_state(CFG, tx, jax.random.key(1), None), tx, optim.lr_schedule(ocfg)


def test_sft_steps_lower_the_loss():
  state, tx, schedule = _state(lr=1e-2, steps=8)
  demos = toy.demonstrations(16, seed=0)
  step = sft.make_sft_step(CFG, tx, schedule, router_bias_rate=1e-3)
  batch = sft.sft_batch(demos, sft.pad_length(max(len(d) for d in demos)))
  losses = []
  for _ in range(8):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
  assert losses[-1] < losses[0] - 0.3, losses


def test_one_rl_step_end_to_end_and_env_failure_marks_rollout():
  state, tx, schedule = _state()
  steps = {fb: rl_train.make_rl_step(CFG, tx, schedule, RC, with_feedback=fb) for fb in (False, True)}
  base = rl_train.toy_envs(RC)

  class Exploding(toy.ToyEnv):
    def step(self, call):
      raise RuntimeError("sandbox died")

  def make(step):
    env_list, seeds, groups = base(step)
    env_list[0] = Exploding(env_list[0].cfg)
    return env_list, seeds, groups

  logs = []
  state, summary = rl_train.fit(state, steps, make, CFG, RC, log=logs.append)
  assert summary["failed_steps"] == 0 and len(summary["history"]) == 1 and int(state.step) == 1, logs
  h = summary["history"][0]
  assert h["failed_rollouts"] >= 1
  for k in ("reward", "invalid_call_rate", "entropy", "clip_frac", "logp_abs_diff", "feedback_kl", "loss"):
    assert np.isfinite(h[k]), (k, h[k])
  assert h["logp_abs_diff"] < 1e-4  # the sampler's logprobs are the trainer's
