"""The ledger comparison's arms inside the RL loss: the penalty arm adds −c to the advantage of the first
flagged turn's sampled tokens and nowhere else (value and gradient against a hand-written reference), and
the distill arm has no policy-gradient term (its loss and gradient do not depend on the rewards, and equal
the feedback arm's minus RL alone's)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rl_envs import scripted
from test_rl_loop import CFG, RC, _loss

from composer_jax import model
from composer_jax.rl import batch as rl_batch_lib
from composer_jax.rl import envs
from composer_jax.rl.envs import ledger

CONFIG = ledger.LedgerConfig(k=2, max_turns=5)


def _episode(seed: int, tools: tuple[str, ...]):
  env = ledger.LedgerEnv(CONFIG)
  probe = ledger.LedgerEnv(CONFIG)
  probe.reset(seed)
  calls = [(t, str(a), str(b)) for t, (a, b) in zip(tools, probe.pairs, strict=True)] + [("done",)]
  return envs.rollout(env, seed, scripted(calls), max_turns=CONFIG.max_turns), env.info()


def _seed(want):
  for s in range(10_000):
    e = ledger.LedgerEnv(CONFIG)
    e.reset(s)
    if tuple(ledger.is_risky(*p) for p in e.pairs) == want:
      return s
  raise AssertionError(want)


@pytest.fixture(scope="module")
def trajs():
  """Four rollouts in two groups: two with a wrapping fadd (flagged), two without."""
  rows = [
    _episode(_seed((True, True)), ("fadd", "fadd")),  # flagged at its first turn (and its second)
    _episode(_seed((True, True)), ("add", "add")),
    _episode(_seed((False, True)), ("fadd", "fadd")),  # flagged at its second call only
    _episode(_seed((False, True)), ("fadd", "add")),
  ]
  return [t for t, _ in rows], [i for _, i in rows]


@pytest.fixture(scope="module")
def params():
  return model.init(CFG, jax.random.key(4))


def _batch(trajs, infos, **kw):
  b = rl_batch_lib.rl_batch(trajs, [0, 0, 1, 1], infos, **kw)
  return jax.tree.map(jnp.asarray, b)


def test_flagged_tokens_are_the_first_wrapping_turn_only(trajs):
  ts, infos = trajs
  flagged = np.asarray(_batch(ts, infos, with_penalty=True).flagged)
  for b, t in enumerate(ts):
    k = {0: 1, 2: 3}.get(b)  # turn 1: the first call; turn 3: the second (after its reply)
    want = np.zeros(flagged.shape[1], np.float32)
    if k is not None:
      s, e = t.spans[k]
      want[s:e] = t.loss_mask[s:e]
    np.testing.assert_array_equal(flagged[b], want)
  assert flagged[0].sum() == len("fadd 12 34") + 2  # the call and its two call tokens


def test_penalty_adds_negative_advantage_on_flagged_tokens_only(trajs, params):
  ts, infos = trajs
  batch = _batch(ts, infos, with_penalty=True)
  c = 0.7
  rc0 = dataclasses.replace(RC, lambda_feedback=0.0)
  rcp = dataclasses.replace(rc0, flag_penalty=c)

  def diff(p):
    (lp, (m, _)), (l0, _) = _loss(p, batch, rcp, False), _loss(p, batch, rc0, False)
    return lp - l0, m

  def reference(p):
    """c · Σ_flagged w_t · π/sg(π) / (max_len · rows): the Dr. GRPO term of advantage −c on those tokens,
    with the truncated-IS weight w_t = min(π/μ, 2) against the sampler's log μ = −1."""
    logits = model.apply(p, CFG, batch.tokens, batch.positions, segment_ids=batch.segment_ids)[0]
    logp_all = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
    logp = jnp.take_along_axis(logp_all, batch.tokens[:, 1:, None], -1)[..., 0]
    f = batch.flagged[:, 1:]
    w = jnp.minimum(jnp.exp(jax.lax.stop_gradient(logp) + 1.0), 2.0)
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
    return c * jnp.sum(f * w * ratio) / (rc0.max_turns * rc0.max_turn_tokens * len(ts))

  (d, m), g = jax.jit(jax.value_and_grad(diff, has_aux=True))(params)
  r, g_ref = jax.jit(jax.value_and_grad(reference))(params)
  assert float(d) == pytest.approx(float(r), rel=1e-5) and float(r) > 0
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
  assert float(m["flag_penalty"][1]) == float(np.sum(np.asarray(batch.flagged)))


def test_distill_arm_has_no_policy_gradient(trajs, params):
  ts, infos = trajs
  batch = _batch(ts, infos, with_feedback=True)
  swapped = batch.replace(rewards=batch.rewards[::-1])

  def value_and_grad(rc):
    return jax.jit(jax.value_and_grad(lambda p, b: _loss(p, b, rc, True)[0]))

  distill = value_and_grad(dataclasses.replace(RC, policy_gradient=False))
  (l1, g1), (l2, g2) = distill(params, batch), distill(params, swapped)
  assert float(l1) == float(l2) and float(l1) > 0
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  loss = jax.jit(
    lambda p, b, lam: _loss(p, b, dataclasses.replace(RC, lambda_feedback=lam), True)[0], static_argnums=2
  )
  f1, f2, a1 = (
    loss(params, batch, RC.lambda_feedback),
    loss(params, swapped, RC.lambda_feedback),
    loss(params, batch, 0.0),
  )
  assert float(f1) != pytest.approx(float(f2))  # the feedback arm's loss does depend on them
  assert float(l1) == pytest.approx(float(f1 - a1), rel=1e-5, abs=1e-7)  # distill = feedback − RL alone
