"""Memory bounded in the rollout length (issue 40): attention over query chunks, the RL loss over column
chunks, and the RL update in micro-batches under a token budget, each equal to the whole-batch path.

Shape suffixes: B batch, T time, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import random_params
from test_rl_loop import _wrong_then_right
from tiny import TINY

from composer_jax import configs, model, optim, rl, sharding, train
from composer_jax.model import attention_kernels
from composer_jax.plan import host
from composer_jax.rl import batch as rl_batch_lib
from composer_jax.rl import chat
from composer_jax.rl import step as rl_step
from composer_jax.rl.envs import toy
from composer_jax.rl.loss import LossSettings
from composer_jax.train import loop as train_loop
from composer_jax.train import losses
from composer_jax.train.batch import place
from composer_jax.train.step import gradients, make_step

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


def test_the_rl_log_probs_in_column_chunks_equal_the_whole_sequence():
  """`losses.chunked_token_logp` with 4 chunks of 8 and 3 of 8 (T = 24) against one pass: the sampled
  tokens' log-probs, their gradients and the entropy, aligned with the tokens."""
  k = jax.random.split(jax.random.key(4), 3)
  for T in (32, 24):
    h_BTD = jax.random.normal(k[0], (3, T, 16))
    w_DV = jax.random.normal(k[1], (16, 40)) * 0.5
    tokens_BT = jax.random.randint(k[2], (3, T), 0, 40)
    logits_BTV = h_BTD @ w_DV
    want_logp = losses.token_logp(logits_BTV, tokens_BT)

    def total(h, w, chunk, tokens_BT=tokens_BT):
      logp_BT, ent_BT = losses.chunked_token_logp(h, lambda x: x @ w, tokens_BT, chunk)
      weights_1T = jnp.arange(logp_BT.shape[1], dtype=jnp.float32)[None]  # every column its own weight
      return (logp_BT * weights_1T).sum(), (logp_BT, ent_BT)

    (_, (logp0, ent0)), g0 = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(h_BTD, w_DV, 0)
    (_, (logp8, ent8)), g8 = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(h_BTD, w_DV, 8)
    np.testing.assert_allclose(logp0, want_logp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logp8, logp0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent8, ent0, rtol=1e-6, atol=1e-6)
    assert float(ent0[:, 1:].min()) > 0 and float(jnp.abs(ent0[:, 0]).max()) == 0
    for a, b in zip(g8, g0, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # float order, columns weighted up to 31


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


@dataclasses.dataclass
class _State:
  step: int = 0


def test_an_update_out_of_memory_ends_the_run_in_one_line():
  """XLA's RESOURCE_EXHAUSTED in a step is not a tolerated failure (the next batch of the shape needs as
  much): `fit` stops at once with one line naming the knobs."""
  calls = []

  def step(state, batch):
    calls.append(batch)
    raise RuntimeError(
      "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 37708888768 bytes.\n..."
    )

  hooks = train_loop.Hooks(next_batch=lambda s, state: (s, {}), tolerate_failures=True)
  schedule = configs.ScheduleConfig(steps=5, log_every=1, eval_every=0, checkpoint_every=0)
  with pytest.raises(train_loop.OutOfMemory) as e:
    train_loop.fit(_State(), step, schedule, hooks, name="rl", eval_at_start=False)
  assert calls == [1]  # not retried as a flaky step
  line = str(e.value)
  assert "\n" not in line and "step 1 ran out of memory" in line and "rl.update_tokens" in line
  assert "37708888768 bytes" in line
  assert train_loop.out_of_memory(ValueError("shapes differ"), "rl", 1) is None


# --- one update of 64 rollouts x 2048 tokens within a memory bound ---------------------------------

LONG_CFG = dataclasses.replace(TINY, vocab_size=272, max_position_embeddings=4096)
LONG_RC = configs.RLConfig(
  env="ledger", max_turns=21, max_turn_tokens=16, cache_len=1872, problems_per_step=8, group_size=8,
  lambda_feedback=1.0, feedback_rows=8, feedback_tokens="turn", update_tokens=8 * 2048,
)  # fmt: skip
# XLA's accounting of the update (arguments + temporaries, all devices) may not exceed this; the same update
# in one pass with whole-sequence attention needs ~9x more (checked below on one device).
UPDATE_BOUND_GIB = 1.0


def _compiled_update(meshes, cfg, rc, batch):
  """(the compiled RL step for `batch`, its state): the step as the rl stage builds it."""
  ocfg = configs.stage_optimizer(configs.OptimizerConfig(), rc.schedule, lr=rc.lr, min_lr_ratio=1.0)
  tx = rl_step.teacher_optimizer(optim.build_optimizer(cfg, ocfg, meshes), rc)
  state = train.create_state(cfg, tx, jax.random.key(0), meshes)
  step = make_step(
    rl_step.loss_fn(cfg, LossSettings.of(rc), meshes), tx, cfg, schedule=optim.lr_schedule(ocfg),
    meshes=meshes, state_sharding=train.state.state_shardings(state) if meshes is not None else None,
  )  # fmt: skip
  placed = place(batch, meshes)
  return step.lower(state, placed).compile(), state, placed


def _xla_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.temp_size_in_bytes


@pytest.mark.parametrize("devices", [1, 8])
def test_an_update_of_64_rollouts_of_2048_tokens_fits_the_bound(meshes, devices):
  m = meshes if devices == 8 else None
  batch = rl_batch_lib.synthetic_batch(64, 2048, flagged=8)
  rows = rl_batch_lib.micro_rows(64, 2048, LONG_RC.update_tokens, multiple=4 if m else 1)
  assert rows == 8
  compiled, state, placed = _compiled_update(
    m, LONG_CFG, LONG_RC, rl_batch_lib.micro_batched(batch, 64 // rows)
  )
  used = _xla_bytes(compiled) * devices
  assert used <= UPDATE_BOUND_GIB * 2**30, f"{used / 2**30:.2f} GiB"
  planned = host.update_bytes(_long_config(devices), rows, 2048)  # the planner, against XLA's own count
  assert 0.7 <= planned / used <= 1.6, (planned / 2**30, used / 2**30)
  _, metrics = compiled(state, placed)
  metrics = jax.device_get(metrics)
  assert np.isfinite(metrics["loss"]) and metrics["skipped"] == 0 and metrics["feedback_tokens"] > 0
  if devices == 1:  # the bound is meaningful: the update in one pass, whole-sequence attention, does not fit
    whole = dataclasses.replace(LONG_CFG, attention_chunk=0)
    before, _, _ = _compiled_update(None, whole, LONG_RC, batch)
    assert _xla_bytes(before) > 4 * UPDATE_BOUND_GIB * 2**30, f"{_xla_bytes(before) / 2**30:.2f} GiB"


def _long_config(devices: int, **rl) -> configs.Config:
  mesh = configs.MeshConfig((4, 1, 2), (8, 1)) if devices == 8 else configs.MeshConfig((1, 1, 1), (1, 1))
  return configs.Config(model=LONG_CFG, rl=dataclasses.replace(LONG_RC, **rl), mesh=mesh)


def test_the_update_is_planned_to_fit_the_host():
  """rl.update_tokens 0: the largest micro-batch whose planned update fits rl.update_memory of the host,
  said in one line; a budget set by hand that does not fit, or a host too small for one rollout: refused
  in one line naming the knob."""
  small_host = 2 * 2**30  # 2 GiB: 0.5 GiB for the update
  whole = host.update_bytes(_long_config(8), 64, 2048)
  assert whole > small_host * 0.25  # the one-pass update does not fit there
  tokens, line = host.resolve_update_tokens(_long_config(8, update_tokens=0), small_host)
  micro = tokens // 2048
  assert 4 <= micro < 64 and 64 % micro == 0 and micro % 4 == 0
  assert host.update_bytes(_long_config(8), micro, 2048) <= 0.25 * small_host
  assert host.update_bytes(_long_config(8), 2 * micro, 2048) > 0.25 * small_host or 2 * micro > 64
  assert (
    "\n" not in line and f"micro-batches of {micro} rollouts" in line and f"rl.update_tokens={tokens}" in line
  )
  assert host.resolve_update_tokens(_long_config(8, update_tokens=0), 64 * 2**30) == (-1, "")  # fits whole
  # fewer rollouts than the devices they are split over (2 on 4): planned as one row per device
  two = _long_config(8, update_tokens=0, problems_per_step=1, group_size=2)
  assert host.resolve_update_tokens(two, 64 * 2**30) == (-1, "")
  with pytest.raises(host.UpdateDoesNotFit, match="rl.update_tokens=-1"):
    host.resolve_update_tokens(_long_config(8, update_tokens=-1), small_host)
  with pytest.raises(host.UpdateDoesNotFit, match="rl.cache_len"):
    host.resolve_update_tokens(_long_config(8, update_tokens=0), 2**26)
