"""The pre-registered ledger comparison (benchmarks/ledger_compare.py) on constructed curves, checked
against independent computations (scipy's exact Wilcoxon and permutation tests, Holm by hand, the trapezoid
by hand), and the benchmark's arms: each changes only its own settings."""

import dataclasses

import numpy as np
import pytest
from tiny import load_script

from composer_jax import configs

STEPS = (0, 10, 20, 30)


@pytest.fixture(scope="module")
def cmp():
  return load_script("benchmarks/ledger_compare.py")


def _run(m1):
  evals = [
    {"step": s, "risky_first_fadd": v, "pass_rate": 1 - v, "invalid_call_rate": 0.01, "reward": 1 - v}
    for s, v in zip(STEPS, m1, strict=True)
  ]
  return {"evals": evals, "history": []}


def _runs(speed, seeds=6):
  """M1 falling from 0.5 at an arm-specific speed per seed (the seed adds a distinct offset)."""
  out = {}
  for arm, rate in speed.items():
    out[arm] = {}
    for s in range(seeds):
      r = rate * (1 + 0.07 * s)
      out[arm][str(s)] = _run([0.5, max(0.5 - r, 0.0), max(0.5 - 2 * r, 0.0), max(0.5 - 3 * r, 0.0)])
  return out


def test_per_seed_auc_and_steps_to_threshold(cmp):
  t = cmp.per_seed(
    {"feedback": {"0": _run([0.5, 0.2, 0.08, 0.02])}, "informative": {"0": _run([0.5, 0.4, 0.3, 0.2])}}
  )
  row = t["feedback"]["0"]
  assert row["m1_auc"] == pytest.approx(np.trapezoid([0.5, 0.2, 0.08, 0.02], STEPS) / 30)
  assert (row["m3"], row["censored"], row["m1_final"], row["m2_final"]) == (20.0, False, 0.02, 0.98)
  assert (t["informative"]["0"]["m3"], t["informative"]["0"]["censored"]) == (30.0, True)


def test_compare_against_independent_tests(cmp):
  scipy_stats = pytest.importorskip("scipy.stats")
  long = cmp.per_seed(_runs({"alone": 0.02, "informative": 0.05, "penalty": 0.08, "feedback": 0.15}))
  short = cmp.per_seed(_runs({"informative": 0.1, "feedback": 0.13}))
  res = cmp.compare(long, short)
  seeds = [str(s) for s in range(6)]
  auc = {a: np.array([long[a][s]["m1_auc"] for s in seeds]) for a in long}
  d = auc["informative"] - auc["feedback"]
  ref = scipy_stats.wilcoxon(d, alternative="greater", method="exact")
  assert res["primary"]["p"] == pytest.approx(ref.pvalue) == pytest.approx(1 / 64)
  ps = {}
  for name, other in (("D vs C", "penalty"), ("D vs A", "alone")):
    ps[name] = scipy_stats.wilcoxon(
      auc[other] - auc["feedback"], alternative="greater", method="exact"
    ).pvalue
  short_auc = {a: np.array([short[a][s]["m1_auc"] for s in seeds]) for a in short}
  x = d - (short_auc["informative"] - short_auc["feedback"])
  ps["interaction"] = scipy_stats.permutation_test(
    (x,), np.mean, permutation_type="samples", alternative="greater", n_resamples=np.inf
  ).pvalue
  order = sorted(ps, key=ps.get)
  holm = dict(
    zip(
      order, np.minimum(1, np.maximum.accumulate([ps[n] * (3 - i) for i, n in enumerate(order)])), strict=True
    )
  )
  for name, t in res["secondary"].items():
    assert t["p"] == pytest.approx(ps[name]) and t["p_holm"] == pytest.approx(holm[name]), name
  m3_b = [long["informative"][s]["m3"] for s in seeds]
  m3_d = [long["feedback"][s]["m3"] for s in seeds]
  assert res["ratio"]["ratio"] == pytest.approx(np.mean(m3_b) / np.mean(m3_d))
  assert res["ratio"]["lo"] <= res["ratio"]["ratio"] <= res["ratio"]["hi"]
  lines = cmp.report(res)
  assert "D ahead" in lines[0] and any("interaction" not in x and "D vs A" in x for x in lines)


def test_compare_without_seeds_or_short_k(cmp):
  assert cmp.report(cmp.compare({})) == ["- primary (D vs B): no paired seeds yet"]
  res = cmp.compare(cmp.per_seed(_runs({"informative": 0.1, "feedback": 0.1}, seeds=3)))
  assert res["secondary"] == {} and res["primary"]["p"] > 0.05  # ties: nothing shown


def test_arms_change_only_their_own_settings():
  bench = load_script("benchmarks/rl_feedback.py")
  base = dataclasses.replace(configs.RLConfig(env="ledger"), lambda_feedback=0.5)
  want = {
    "alone": dict(lambda_feedback=0.0),
    "feedback": dict(lambda_feedback=0.5),
    "null": dict(lambda_feedback=0.5, hint="null"),
    "informative": dict(lambda_feedback=0.0, informative=True),
    "penalty": dict(lambda_feedback=0.0, flag_penalty=0.3),
    "distill": dict(lambda_feedback=0.5, policy_gradient=False),
  }
  for arm, w in want.items():
    r = bench.arm_config(dataclasses.replace(base, flag_penalty=9.0), arm, 4, flag_penalty=0.3)
    got = dict(
      lambda_feedback=r.lambda_feedback, hint=r.hint, informative=r.ledger.informative,
      flag_penalty=r.flag_penalty, policy_gradient=r.policy_gradient,
    )  # fmt: skip
    default = dict(
      lambda_feedback=0.5, hint="task", informative=False, flag_penalty=0.0, policy_gradient=True
    )
    assert got == default | w and r.seed == 4, arm
  with pytest.raises(ValueError, match="ledger"):
    bench.arm_config(configs.RLConfig(env="stale"), "informative", 0)


def _with_problems(m1_pairs, correct, order=None):
  """A run whose last evaluation keeps per-problem outcomes (problem seeds 11, 12, ...; `order` permutes
  how they are stored, as another process might)."""
  seeds = [11 + i for i in range(len(m1_pairs))]
  order = order or list(range(len(seeds)))
  problems = {
    "seed": [seeds[i] for i in order],
    "risky_first_fadd": [list(m1_pairs[i]) for i in order],
    "all_correct": [[correct[i], 1] for i in order],
  }
  m1 = sum(n for n, _ in m1_pairs) / sum(d for _, d in m1_pairs)
  last = {"step": 30, M1: m1, "pass_rate": float(np.mean(correct)), "invalid_call_rate": 0.0}
  first = {"step": 0, M1: 0.5, "pass_rate": 0.0, "invalid_call_rate": 0.0}
  return {"evals": [first, last | {"problems": problems}], "history": []}


M1 = "risky_first_fadd"


def test_last_evaluation_cis_over_seeds_and_problems(cmp):
  runs = {
    "informative": {
      "0": _with_problems([(1, 2), (0, 1), (1, 1), (0, 0)], [0, 1, 0, 1]),
      "1": _with_problems([(0, 2), (0, 1), (1, 1), (0, 0)], [1, 1, 0, 1], order=[3, 1, 0, 2]),
      "2": _with_problems([(2, 2), (1, 1), (0, 1), (0, 0)], [0, 0, 1, 1]),
    },
    "feedback": {"0": _run([0.5, 0.3, 0.2, 0.1])},  # no per-problem outcomes: left out
  }
  reference = {"0": _with_problems([(0, 2), (0, 1), (0, 1), (0, 0)], [1, 1, 1, 1])["evals"][-1]}
  cis = cmp.last_eval_cis(runs, reference, n_boot=4000)
  assert set(cis) == {"informative", "reference"}
  b = cis["informative"]
  # by hand: each seed's Σ fadd-first / Σ risky pairs over the 4 problems, then the mean over seeds
  assert b["m1"][0] == pytest.approx(np.mean([2 / 4, 1 / 4, 3 / 4]))
  assert b["m2"][0] == pytest.approx(np.mean([2 / 4, 3 / 4, 2 / 4]))
  assert b["m1"][1] < b["m1"][0] < b["m1"][2] and (b["problems"], b["seeds"], b["step"]) == (
    4,
    ["0", "1", "2"],
    30,
  )
  # the stored order does not matter: outcomes are matched by problem seed
  same = dict(runs["informative"])
  same["1"] = _with_problems([(0, 2), (0, 1), (1, 1), (0, 0)], [1, 1, 0, 1])
  assert cmp.last_eval_cis({"informative": same}, n_boot=4000)["informative"] == b
  assert cis["reference"]["m1"] == [0.0, 0.0, 0.0] and cis["reference"]["m2"] == [1.0, 1.0, 1.0]
  lines, result = cmp.summary(runs, reference=reference)
  text = "\n".join(lines)
  assert "reference (SFT, rule in prompt): M1 / M2 |" in text and "| 0.000 / 1.000 |" in text
  assert any(x.startswith("- B informative, step 30, 3 seeds × 4 problems: M1 0.500 [") for x in lines), lines
  assert any(x.startswith("- reference (SFT, rule in prompt), step 30") for x in lines)
  assert result["reference"]["0"][M1] == 0.0
