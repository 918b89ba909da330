"""The comparison statistics against independent computations: the paired permutation test against
scipy's and a by-hand enumeration, Holm against the step-down procedure applied directly, the bootstrap
ratio CI against the exact bootstrap distribution (all n^n resamples), steps-to-threshold by hand."""

import itertools

import numpy as np
import pytest

from composer_jax.rl import stats


@pytest.mark.parametrize(
  "d",
  [
    [0.1, 0.2, 0.05, 0.3, 0.15, 0.12],  # all positive, n = 6: p = 1/64
    [0.1, -0.05, 0.2, 0.02, -0.01, 0.3, 0.04],
    [-0.2, 0.1, -0.1, 0.05, 0.0, -0.3],  # a zero and ties in |d|
  ],
)
def test_sign_flip_is_the_exact_permutation_test(d):
  m, p = stats.sign_flip_greater(d)
  means = [
    np.mean([s * x for s, x in zip(signs, d, strict=True)])
    for signs in itertools.product((-1, 1), repeat=len(d))
  ]
  assert m == pytest.approx(np.mean(d)) and p == pytest.approx(
    np.mean([x >= np.mean(d) - 1e-12 for x in means])
  )
  scipy_stats = pytest.importorskip("scipy.stats")
  ref = scipy_stats.permutation_test(
    (np.asarray(d),), np.mean, permutation_type="samples", alternative="greater", n_resamples=np.inf
  )
  assert p == pytest.approx(ref.pvalue)
  assert stats.sign_flip_greater([0.1] * 6)[1] == pytest.approx(1 / 64)


def _holm_rejects(p, alpha):
  """Holm's procedure as stated: test sorted p-values against α/m, α/(m−1), ... and stop at the first
  that fails; the hypotheses before it are rejected."""
  order = sorted(range(len(p)), key=lambda i: p[i])
  rejected = set()
  for j, i in enumerate(order):
    if p[i] > alpha / (len(p) - j):
      break
    rejected.add(i)
  return rejected


@pytest.mark.parametrize("p", [[0.01, 0.04, 0.03], [0.02, 0.02, 0.5], [0.2, 0.001, 0.03, 0.04], [0.6]])
def test_holm_matches_the_step_down_procedure(p):
  adjusted = stats.holm(p)
  for alpha in (0.01, 0.025, 0.04, 0.05, 0.06, 0.1, 0.5):
    assert {i for i, a in enumerate(adjusted) if a <= alpha} == _holm_rejects(p, alpha), alpha
  assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
  assert all(a >= x for a, x in zip(adjusted, p, strict=True)) and max(adjusted) <= 1.0


def test_ratio_ci_against_the_exact_bootstrap():
  num, den = [60.0, 45.0, 60.0, 30.0], [20.0, 25.0, 15.0, 30.0]
  exact = [
    np.mean([num[i] for i in idx]) / np.mean([den[i] for i in idx])
    for idx in itertools.product(range(4), repeat=4)  # every resample of the 4 seeds, equally likely
  ]
  r, lo, hi = stats.ratio_ci(num, den, n_boot=40000, seed=1)
  assert r == pytest.approx(np.mean(num) / np.mean(den))
  assert lo == pytest.approx(np.quantile(exact, 0.025), abs=0.05)
  assert hi == pytest.approx(np.quantile(exact, 0.975), abs=0.05)
  assert stats.ratio_ci(num, den, seed=3) == stats.ratio_ci(num, den, seed=3)  # seeded


def test_steps_to_threshold_is_right_censored():
  steps, m1 = [0, 5, 10, 15, 20], [0.5, 0.3, 0.1, 0.12, 0.05]
  assert stats.steps_to(steps, m1, 0.10) == (10.0, False)  # the first evaluation at or below
  assert stats.steps_to(steps, m1, 0.01) == (20.0, True)  # never: the horizon, censored


def test_two_level_bootstrap_on_a_hand_computed_case():
  """2 seeds × 2 problems. Seed A: problem 1 right (1/1), problem 2 wrong (0/1); seed B: both right.
  Problem draws {11, 12, 21, 22} and seed draws {AA, AB, BA, BB} are each equally likely; A's rate is
  1, 1/2, 1/2, 0 over the problem draws and B's always 1, so the statistic (mean over drawn seeds) is
  0 w.p. 1/16, 1/2 w.p. 4/16, 3/4 w.p. 4/16 and 1 w.p. 7/16 (by hand), and the estimate is 3/4."""
  num, den = [[1, 0], [1, 1]], [[1, 1], [1, 1]]
  reps = stats.two_level_replicates(num, den, n_boot=40000, seed=2)
  for value, p in ((0.0, 1 / 16), (0.5, 4 / 16), (0.75, 4 / 16), (1.0, 7 / 16)):
    assert np.mean(np.isclose(reps, value)) == pytest.approx(p, abs=0.012), value
  m, lo, hi = stats.two_level_ci(num, den, level=0.8, n_boot=40000, seed=2)
  assert (m, lo, hi) == pytest.approx((0.75, 0.5, 1.0))  # P(≤ 0) = 1/16 < 0.1 ≤ P(≤ 1/2); P(< 1) = 9/16


def _two_level_exact(num, den):
  """Every (seed draw, problem draw) of the crossed bootstrap, equally likely, by loops."""
  S, P = len(num), len(num[0])
  out = []
  for sd in itertools.product(range(S), repeat=S):
    for pd in itertools.product(range(P), repeat=P):
      rates = []
      for s in sd:
        n, d = sum(num[s][p] for p in pd), sum(den[s][p] for p in pd)
        if d > 0:
          rates.append(n / d)
      if rates:
        out.append(sum(rates) / len(rates))
  return np.array(out)


def test_two_level_ci_against_the_exact_bootstrap():
  # M1-like counts: risky pairs per problem differ (0 to 2), one seed has a problem without any
  num = [[2, 0, 1], [1, 0, 0], [0, 1, 0]]
  den = [[2, 1, 1], [2, 1, 0], [1, 2, 1]]
  exact = _two_level_exact(num, den)
  m, lo, hi = stats.two_level_ci(num, den, n_boot=40000, seed=1)
  by_hand = np.mean([3 / 4, 1 / 3, 1 / 4])  # each seed's Σ num / Σ den, then the mean over seeds
  assert m == pytest.approx(by_hand)
  reps = stats.two_level_replicates(num, den, n_boot=40000, seed=1)
  assert np.nanmean(reps) == pytest.approx(exact.mean(), abs=0.005)
  assert np.nanstd(reps) == pytest.approx(exact.std(), abs=0.005)
  assert lo == pytest.approx(np.quantile(exact, 0.025), abs=0.03)
  assert hi == pytest.approx(np.quantile(exact, 0.975), abs=0.03)
  assert stats.two_level_ci(num, den, n_boot=40000, seed=1) == (m, lo, hi)  # seeded


def test_two_level_ci_shapes_and_degenerate_cases():
  m, lo, hi = stats.two_level_ci([[1, 1, 1]], [[1, 1, 1]])  # one seed, every problem right
  assert (m, lo, hi) == (1.0, 1.0, 1.0)
  m, lo, hi = stats.two_level_ci([[0, 0]], [[0, 0]])  # nothing counted anywhere
  assert np.isnan(m) and np.isnan(lo) and np.isnan(hi)
  with pytest.raises(ValueError, match="seeds, problems"):
    stats.two_level_ci([1, 2], [1, 2])
