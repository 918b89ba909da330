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
