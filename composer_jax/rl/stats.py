"""The statistics of the feedback gate and the paired-seed comparison, in numpy (no scipy needed).

  mean, lo, hi = mean_ci(diffs)              # normal-approximation 95 % CI of a mean (n ≳ 30)
  w, p = wilcoxon_greater(diffs)             # exact one-sided Wilcoxon signed-rank, H1: median > 0
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
