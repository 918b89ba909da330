"""The statistics of the feedback gate and the paired-seed comparisons, in numpy (no scipy needed).

  mean, lo, hi = mean_ci(diffs)              # normal-approximation 95 % CI of a mean (n ≳ 30)
  w, p = wilcoxon_greater(diffs)             # exact one-sided Wilcoxon signed-rank, H1: median > 0
  m, p = sign_flip_greater(diffs)            # exact paired permutation test of the mean, H1: mean > 0
  adjusted = holm([p1, p2, p3])              # Holm's step-down family-wise adjustment
  r, lo, hi = ratio_ci(num, den)             # mean(num) / mean(den), paired bootstrap percentile CI
  step, censored = steps_to(steps, values, threshold)   # first evaluation at or below a threshold
  area = curve_mean(steps, values)           # area under an eval curve ÷ its step range

The gate's units are flagged turns (≥ 100), so a mean's CI uses the normal quantile; the RL comparison
has a handful of paired seeds, so its test enumerates every sign assignment (2^n, n ≤ 20) instead of an
asymptotic approximation.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

Z_975 = 1.959963984540054  # the standard normal's 0.975 quantile


def mean_ci(x: Sequence[float], z: float = Z_975) -> tuple[float, float, float]:
  """(mean, lower, upper): mean ± z·s/√n with the sample standard deviation s (ddof 1). n = 1: (x, x, x)."""
  a = np.asarray(x, np.float64)
  if a.size == 0:
    raise ValueError("mean_ci of an empty sample")
  m = float(a.mean())
  if a.size == 1:
    return m, m, m
  half = z * float(a.std(ddof=1)) / np.sqrt(a.size)
  return m, m - half, m + half


def _ranks(a: np.ndarray) -> np.ndarray:
  """Ranks 1..n with ties given their average rank."""
  order = np.argsort(a, kind="stable")
  ranks = np.empty(a.size, np.float64)
  ranks[order] = np.arange(1, a.size + 1)
  for v in np.unique(a):
    tied = a == v
    ranks[tied] = ranks[tied].mean()
  return ranks


def wilcoxon_greater(d: Sequence[float], max_n: int = 20) -> tuple[float, float]:
  """Exact one-sided Wilcoxon signed-rank test of paired differences d, H1: location > 0.

  Zeros are dropped (Wilcoxon's convention); |d| ties get average ranks. Returns (W+, p) with W+ the sum
  of the ranks of the positive differences and p = P(W+ ≥ observed) over all 2^n equally likely sign
  assignments (the permutation distribution, exact also with ties). No nonzero difference: (0, 1)."""
  a = np.asarray(d, np.float64)
  a = a[a != 0]
  n = a.size
  if n == 0:
    return 0.0, 1.0
  if n > max_n:
    raise ValueError(f"exact enumeration is for n ≤ {max_n}; got {n}")
  r = _ranks(np.abs(a))
  w = float(r[a > 0].sum())
  signs = np.array(list(itertools.product((0.0, 1.0), repeat=n)))  # [2^n, n]
  null = signs @ r
  return w, float(np.mean(null >= w - 1e-9))


def curve_mean(steps: Sequence[float], values: Sequence[float]) -> float:
  """Trapezoid area under values(steps) divided by the step range: the curve's mean height (an
  AUC on the reward's own scale). One point: that value."""
  x, y = np.asarray(steps, np.float64), np.asarray(values, np.float64)
  if x.size == 1:
    return float(y[0])
  return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / (x[-1] - x[0]))


def sign_flip_greater(d: Sequence[float], max_n: int = 20) -> tuple[float, float]:
  """Exact paired permutation test of the mean of paired differences d, H1: mean > 0. Returns (mean, p)
  with p = P(mean ≥ observed) over all 2^n sign assignments (each pair's difference equally likely
  either sign under H0)."""
  a = np.asarray(d, np.float64)
  if a.size == 0:
    raise ValueError("sign_flip_greater of an empty sample")
  if a.size > max_n:
    raise ValueError(f"exact enumeration is for n ≤ {max_n}; got {a.size}")
  signs = np.array(list(itertools.product((-1.0, 1.0), repeat=a.size)))  # [2^n, n]
  null = signs @ np.abs(a) / a.size
  m = float(a.mean())
  return m, float(np.mean(null >= m - 1e-12))


def holm(p: Sequence[float]) -> list[float]:
  """Holm (1979) step-down adjusted p-values, in the input order: sorted ascending, the i-th (from 0) of
  m is multiplied by m − i, made non-decreasing, capped at 1. Reject H_i at level α iff adjusted_i ≤ α."""
  a = np.asarray(p, np.float64)
  m = a.size
  order = np.argsort(a, kind="stable")
  scaled = np.minimum(1.0, np.maximum.accumulate(a[order] * (m - np.arange(m))))
  out = np.empty(m)
  out[order] = scaled
  return out.tolist()


def ratio_ci(
  num: Sequence[float], den: Sequence[float], *, n_boot: int = 20000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
  """(mean(num) / mean(den), lower, upper): the percentile bootstrap CI over paired units (seeds resampled
  with replacement, each keeping its num and den). Resamples whose mean(den) is 0 are dropped."""
  x, y = np.asarray(num, np.float64), np.asarray(den, np.float64)
  if x.shape != y.shape or x.size == 0:
    raise ValueError(f"ratio_ci needs paired non-empty samples; got {x.shape} and {y.shape}")
  idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
  mx, my = x[idx].mean(1), y[idx].mean(1)
  r = mx[my != 0] / my[my != 0]
  tail = (1 - level) / 2
  return float(x.mean() / y.mean()), float(np.quantile(r, tail)), float(np.quantile(r, 1 - tail))


def steps_to(steps: Sequence[float], values: Sequence[float], threshold: float) -> tuple[float, bool]:
  """(the first step whose value is ≤ threshold, False), or (the last step, True) when none is: the
  steps-to-threshold, right-censored at the horizon."""
  for x, v in zip(steps, values, strict=True):
    if v <= threshold:
      return float(x), False
  return float(steps[-1]), True
