"""The statistics of the feedback gate and the paired-seed comparisons, in numpy (no scipy needed).

  mean, lo, hi = mean_ci(diffs)              # normal-approximation 95 % CI of a mean (n ≳ 30)
  w, p = wilcoxon_greater(diffs)             # exact one-sided Wilcoxon signed-rank, H1: median > 0
  m, p = sign_flip_greater(diffs)            # exact paired permutation test of the mean, H1: mean > 0
  adjusted = holm([p1, p2, p3])              # Holm's step-down family-wise adjustment
  r, lo, hi = ratio_ci(num, den)             # mean(num) / mean(den), paired bootstrap percentile CI
  m, lo, hi = two_level_ci(num_SP, den_SP)   # mean over seeds of per-seed ratios, seeds × problems bootstrap
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


def _seed_means(num_RS: np.ndarray, den_RS: np.ndarray, w_RS: np.ndarray) -> np.ndarray:
  """Per row r, the w-weighted mean over seeds of num/den, seeds with den 0 left out (nan: none left)."""
  ok = den_RS > 0
  ratio = np.where(ok, num_RS / np.where(ok, den_RS, 1.0), 0.0)
  w = np.where(ok, w_RS, 0.0)
  total = w.sum(-1)
  return np.where(total > 0, (w * ratio).sum(-1) / np.where(total > 0, total, 1.0), np.nan)


def two_level_replicates(
  num_SP: Sequence[Sequence[float]], den_SP: Sequence[Sequence[float]], *, n_boot: int = 20000, seed: int = 0
) -> np.ndarray:
  """[n_boot] bootstrap replicates of `two_level_ci`'s statistic (nan where no seed has a count).

  Each replicate draws S seeds with replacement and, independently, P problems with replacement (as
  multiplicities), the same problems for every seed: each seed's ratio is Σ num / Σ den over the drawn
  problems, and the statistic is the mean of those ratios over the drawn seeds."""
  num, den = np.asarray(num_SP, np.float64), np.asarray(den_SP, np.float64)
  if num.shape != den.shape or num.ndim != 2 or num.size == 0:
    raise ValueError(f"two_level_ci needs [seeds, problems] sums and counts; got {num.shape}, {den.shape}")
  S, P = num.shape
  rng = np.random.default_rng(seed)
  c_RP = rng.multinomial(P, np.full(P, 1.0 / P), size=n_boot).astype(np.float64)  # problem multiplicities
  w_RS = rng.multinomial(S, np.full(S, 1.0 / S), size=n_boot).astype(np.float64)  # seed multiplicities
  return _seed_means(c_RP @ num.T, c_RP @ den.T, w_RS)


def two_level_ci(
  num_SP: Sequence[Sequence[float]],
  den_SP: Sequence[Sequence[float]],
  *,
  n_boot: int = 20000,
  level: float = 0.95,
  seed: int = 0,
) -> tuple[float, float, float]:
  """(estimate, lower, upper) for a rate measured per seed on a shared set of problems: the mean over
  seeds of each seed's Σ_p num / Σ_p den (a seed with Σ den = 0 left out), with a percentile bootstrap CI
  that resamples both levels, seeds and problems (`two_level_replicates`).

  Every seed is scored on the same fixed problems, so seeds and problems are crossed, not nested: the
  problems are drawn once per replicate for all seeds (Owen 2007's "pigeonhole" bootstrap for crossed
  random effects), which keeps a hard problem hard in every seed; drawing them afresh for each seed would
  average the problems' variance away over the seeds. With one seed it is the bootstrap over problems."""
  num, den = np.asarray(num_SP, np.float64), np.asarray(den_SP, np.float64)
  reps = two_level_replicates(num, den, n_boot=n_boot, seed=seed)
  est = float(_seed_means(num.sum(1), den.sum(1), np.ones(num.shape[0])))
  reps = reps[~np.isnan(reps)]
  if reps.size == 0:
    return est, float("nan"), float("nan")
  tail = (1 - level) / 2
  return est, float(np.quantile(reps, tail)), float(np.quantile(reps, 1 - tail))
