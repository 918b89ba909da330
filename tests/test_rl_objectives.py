"""RL objectives against independent float64 NumPy references: advantages, clipping, masks, (sum, count)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.rl import objectives as obj

OBJECTIVES = ("grpo", "drgrpo", "dapo", "cispo", "gspo")
EPS = {
  "grpo": (0.2, 0.2),
  "drgrpo": (0.2, 0.2),
  "dapo": (0.2, 0.28),
  "cispo": (1.0, 4.0),
  "gspo": (3e-4, 4e-4),
}


# ----------------------------------------------------------------------------------------------- advantages
GROUP_IDS = np.array([7, -3, 7, 100, -3, 7, 100, 100, 42, 5, 5], np.int32)
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, 1.0, 0.0, 2.0, 2.0, 3.0, 0.3, 0.9], np.float32)


def _np_advantages(r, g, kind, eps=1e-6):
  r = r.astype(np.float64)
  out = np.zeros_like(r)
  for gid in np.unique(g):
    idx = np.flatnonzero(g == gid)
    x = r[idx]
    if len(idx) < 2 or np.all(x == x[0]):
      continue
    if kind == "grpo":
      out[idx] = (x - x.mean()) / (x.std(ddof=1) + eps)
    elif kind == "drgrpo":
      out[idx] = x - x.mean()
    else:
      out[idx] = [x[i] - np.delete(x, i).mean() for i in range(len(x))]
  return out


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_advantages_match_numpy_and_are_zero_mean_per_group(kind):
  adv = np.asarray(obj.advantages(jnp.asarray(REWARDS), jnp.asarray(GROUP_IDS), kind=kind))
  np.testing.assert_allclose(adv, _np_advantages(REWARDS, GROUP_IDS, kind), rtol=1e-5, atol=1e-6)
  for gid in np.unique(GROUP_IDS):
    assert abs(adv[GROUP_IDS == gid].mean()) < 1e-6
  # Group 100 is all 2.0 and group 42 a singleton: exactly zero.
  assert np.all(adv[GROUP_IDS == 100] == 0.0) and np.all(adv[GROUP_IDS == 42] == 0.0)


def test_advantages_jit_and_groups_with_signal():
  f = jax.jit(lambda r, g: obj.advantages(r, g, kind="grpo"))
  np.testing.assert_allclose(
    f(REWARDS, GROUP_IDS), _np_advantages(REWARDS, GROUP_IDS, "grpo"), rtol=1e-5, atol=1e-6
  )
  signal = np.asarray(obj.groups_with_signal(jnp.asarray(REWARDS), jnp.asarray(GROUP_IDS)))
  np.testing.assert_array_equal(signal, ~np.isin(GROUP_IDS, [100, 42]))


def test_unknown_kinds_raise():
  with pytest.raises(ValueError, match="grpo, drgrpo, rloo"):
    obj.advantages(jnp.asarray(REWARDS), jnp.asarray(GROUP_IDS), kind="ppo")
  z = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="dapo"):
    obj.policy_loss(z, z, jnp.zeros(2), z, objective="reinforce")
  with pytest.raises(ValueError, match="gspo"):
    obj.policy_metrics(z, z, jnp.zeros(2), z, objective="reinforce")


def test_overlong_penalty_matches_dapo_formula():
  lengths = np.array([0, 50, 60, 70, 79, 80, 81, 200])
  got = np.asarray(obj.overlong_penalty(jnp.asarray(lengths), max_len=80, buffer=20, penalty=0.5))
  ref = [0.0 if n <= 60 else (-(n - 60) / 20 * 0.5 if n <= 80 else -0.5) for n in lengths]
  np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


# -------------------------------------------------------------------------------------------- policy loss
def _np_policy_loss(logp, old, adv, mask, objective, sampler=None, max_len=None, cap=2.0):
  logp, old, adv = (np.asarray(x, np.float64) for x in (logp, old, adv))
  m = np.asarray(mask) > 0
  B, T = logp.shape
  if adv.ndim == 1:
    adv = np.repeat(adv[:, None], T, axis=1)
  lo, hi = EPS[objective]
  lr = np.clip(np.where(m, logp - old, 0.0), -20, 20)
  r = np.exp(lr)
  w = np.ones_like(r) if sampler is None else np.minimum(np.exp(old - np.asarray(sampler, np.float64)), cap)
  n = m.sum(1)
  if objective == "cispo":
    term = -np.clip(r, 1 - lo, 1 + hi) * adv * logp
  elif objective == "gspo":
    s = np.exp((lr * m).sum(1) / np.maximum(n, 1))[:, None]
    term = -np.minimum(s * adv, np.clip(s, 1 - lo, 1 + hi) * adv)
  else:
    term = -np.minimum(r * adv, np.clip(r, 1 - lo, 1 + hi) * adv)
  term = np.where(m, term * w, 0.0)
  n_seq = float((n > 0).sum())
  if objective in ("dapo", "cispo"):
    return term.sum(), float(m.sum())
  if objective == "drgrpo":
    return term.sum() / (T if max_len is None else max_len), n_seq
  return (term.sum(1) / np.maximum(n, 1)).sum(), n_seq


def _batch(seed, B=4, T=6, per_token=False):
  rng = np.random.default_rng(seed)
  old = np.log(rng.uniform(0.05, 0.9, (B, T))).astype(np.float32)
  logp = (old + rng.normal(0, 0.3, (B, T))).astype(np.float32)
  sampler = (old + rng.normal(0, 0.5, (B, T))).astype(np.float32)
  adv = rng.normal(0, 1, (B, T) if per_token else (B,)).astype(np.float32)
  mask = (rng.uniform(size=(B, T)) < 0.7).astype(np.float32)
  mask[:, 0] = 1.0
  mask[-1] = 0.0  # an all-padding row: counted by no objective
  return logp, old, adv, mask, sampler


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_policy_loss_matches_numpy(objective):
  for seed, per_token, with_sampler in [(0, False, False), (1, True, True)]:
    logp, old, adv, mask, sampler = _batch(seed, per_token=per_token)
    smp = sampler if with_sampler else None
    s, c = obj.policy_loss(
      jnp.asarray(logp), old, adv, mask, objective=objective, sampler_logp=smp, max_len=9
    )
    rs, rc = _np_policy_loss(logp, old, adv, mask, objective, smp, max_len=9)
    np.testing.assert_allclose(float(s), rs, rtol=2e-5, atol=1e-6)
    assert float(c) == rc


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_masked_tokens_contribute_nothing_and_micro_batches_sum(objective):
  logp, old, adv, mask, sampler = _batch(2, B=6)
  loss = jax.jit(
    lambda lp, o, a, m, s: obj.policy_loss(lp, o, a, m, objective=objective, sampler_logp=s, max_len=8)
  )

  def value_and_grad(lp, o, s):
    return jax.value_and_grad(lambda x: loss(x, o, adv, mask, s)[0])(lp)

  v, g = value_and_grad(jnp.asarray(logp), old, sampler)
  junk = np.where(mask > 0, 0.0, np.nan).astype(np.float32)
  v2, g2 = value_and_grad(jnp.asarray(logp + junk), old - np.abs(junk), sampler + junk)
  assert float(v2) == float(v)
  np.testing.assert_array_equal(np.asarray(g2), np.asarray(g))
  assert np.all(np.asarray(g)[mask == 0] == 0.0) and np.any(np.asarray(g)[mask > 0] != 0.0)

  s, c = loss(logp, old, adv, mask, sampler)
  parts = [loss(logp[i::2], old[i::2], adv[i::2], mask[i::2], sampler[i::2]) for i in range(2)]
  np.testing.assert_allclose(float(sum(p[0] for p in parts)), float(s), rtol=1e-6, atol=1e-7)
  assert float(sum(p[1] for p in parts)) == float(c)


def _token_grad(objective, ratio, adv):
  """d loss / d logp of one token with old logp 0 and ratio `ratio`."""
  old = jnp.zeros((1, 1))
  mask = jnp.ones((1, 1))
  f = lambda lp: obj.policy_loss(lp, old, jnp.full((1,), adv), mask, objective=objective)[0]  # noqa: E731
  return float(jax.grad(f)(jnp.full((1, 1), np.log(ratio), jnp.float32))[0, 0])


@pytest.mark.parametrize("objective", ["grpo", "dapo"])
def test_clipping_engages_exactly_at_eps(objective):
  lo, hi = EPS[objective]
  d = 1e-3
  # A > 0: the upper bound 1 + ε_high stops the gradient; below 1 - ε_low it still flows.
  assert _token_grad(objective, 1 + hi + d, 1.0) == 0.0
  assert _token_grad(objective, 1 + hi - d, 1.0) == pytest.approx(-(1 + hi - d), rel=1e-5)
  assert _token_grad(objective, 1 - lo - d, 1.0) == pytest.approx(-(1 - lo - d), rel=1e-5)
  # A < 0: the lower bound 1 - ε_low stops the gradient; above 1 + ε_high it still flows.
  assert _token_grad(objective, 1 - lo - d, -1.0) == 0.0
  assert _token_grad(objective, 1 - lo + d, -1.0) == pytest.approx(1 - lo + d, rel=1e-5)
  assert _token_grad(objective, 1 + hi + d, -1.0) == pytest.approx(1 + hi + d, rel=1e-5)


def test_cispo_keeps_gradient_where_ppo_clips():
  # r = 1.5, A > 0: PPO/DAPO drop the token; CISPO's gradient is -sg(min(r, 1 + ε_high))·A.
  assert _token_grad("dapo", 1.5, 1.0) == 0.0
  assert _token_grad("cispo", 1.5, 1.0) == pytest.approx(-1.5, rel=1e-6)
  assert _token_grad("cispo", 9.0, 1.0) == pytest.approx(-5.0, rel=1e-6)  # truncated at 1 + 4
  assert _token_grad("cispo", 0.3, -2.0) == pytest.approx(0.6, rel=1e-5)  # no lower bound by default


def test_tis_weight_is_capped_and_detached():
  old = np.log(np.array([[0.5, 0.5, 0.5]], np.float32))
  sampler = np.log(np.array([[0.5, 0.4, 0.05]], np.float32))  # π_old/μ = 1, 1.25, 10 → capped at 2
  logp, adv, mask = jnp.asarray(old), jnp.ones((1,)), jnp.ones((1, 3))

  def f(lp, s):
    return obj.policy_loss(lp, old, adv, mask, objective="dapo", sampler_logp=s)[0]

  np.testing.assert_allclose(float(f(logp, sampler)), -(1 + 1.25 + 2.0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(jax.grad(f)(logp, sampler)), [[-1.0, -1.25, -2.0]], rtol=1e-6)
  assert np.all(np.asarray(jax.grad(f, argnums=1)(logp, sampler)) == 0.0)
  m = obj.policy_metrics(logp, old, adv, mask, objective="dapo", sampler_logp=sampler)
  assert float(m["tis_capped"][0]) == 1.0 and float(m["tis_weight"][0]) == pytest.approx(4.25, rel=1e-6)


def test_gspo_uses_the_sequence_ratio():
  old = np.zeros((2, 4), np.float32)
  logp = np.array([[1e-4, 2e-4, 9.0, 3e-4], [5e-4, 6e-4, 7e-4, 8e-4]], np.float32)
  mask = np.array([[1, 1, 0, 1], [1, 1, 1, 1]], np.float32)
  adv = jnp.asarray([1.0, 1.0])
  f = lambda lp: obj.policy_loss(lp, old, adv, mask, objective="gspo")[0]  # noqa: E731
  # s_0 = exp(2e-4) inside (1 - 3e-4, 1 + 4e-4): value s_0, gradient s_0/n_0 on each of its 3 tokens.
  # s_1 = exp(6.5e-4) > 1 + 4e-4 with A > 0: the whole sequence is clipped (value 1 + 4e-4, no gradient).
  s0 = np.exp(2e-4)
  np.testing.assert_allclose(float(f(jnp.asarray(logp))), -(s0 + (1 + 4e-4)), rtol=1e-6)
  g = np.asarray(jax.grad(f)(jnp.asarray(logp)))
  np.testing.assert_allclose(g[0], [-s0 / 3, -s0 / 3, 0.0, -s0 / 3], rtol=1e-5)
  assert np.all(g[1] == 0.0)
  m = obj.policy_metrics(jnp.asarray(logp), old, adv, mask, objective="gspo")
  assert [float(x) for x in m["clip_frac"]] == [1.0, 2.0]
  np.testing.assert_allclose(float(m["ratio"][0]), s0 + np.exp(6.5e-4), rtol=1e-6)


def test_policy_metrics_match_numpy():
  logp, old, adv, mask, _ = _batch(3)
  m = obj.policy_metrics(jnp.asarray(logp), old, adv, mask, objective="dapo", max_len=5)
  on = mask > 0
  lr = (logp - old).astype(np.float64)
  r = np.exp(lr)
  a = np.repeat(adv[:, None], logp.shape[1], axis=1)
  clipped = ((r > 1.28) & (a > 0)) | ((r < 0.8) & (a < 0))
  np.testing.assert_allclose(float(m["clip_frac"][0]), (clipped & on).sum())
  np.testing.assert_allclose(float(m["ratio"][0]), r[on].sum(), rtol=1e-5)
  np.testing.assert_allclose(float(m["approx_kl"][0]), (r - 1 - lr)[on].sum(), rtol=1e-3, atol=1e-6)
  assert float(m["approx_kl"][1]) == on.sum() and "tis_weight" not in m


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_on_objective_scale_is_the_policy_losss_own_reduction(objective):
  """A per-token term reduced by `on_objective_scale` lands on the policy loss's normaliser: at ratio 1
  the PPO and GSPO terms are -A per token (CISPO's -A·log π): the reductions must agree, counts included."""
  rng = np.random.default_rng(3)
  B, T = 4, 9
  logp = jnp.asarray(rng.normal(-1.0, 0.3, (B, T)), jnp.float32)
  mask = jnp.asarray(rng.random((B, T)) < 0.7, jnp.float32).at[3].set(0.0)  # an all-padding row
  adv = jnp.asarray(rng.normal(0, 1, (B, T)), jnp.float32)
  want = obj.policy_loss(logp, logp, adv, mask, objective=objective, max_len=16)
  term = -adv * logp if objective == "cispo" else -adv
  got = obj.on_objective_scale(term, mask, objective=objective, max_len=16)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  if objective == "drgrpo":  # by hand: Σ v / max_len, over rows with a token
    v = -np.asarray(adv) * np.asarray(mask)
    assert float(got[0]) == pytest.approx(v.sum() / 16, rel=1e-5) and float(got[1]) == 3.0
