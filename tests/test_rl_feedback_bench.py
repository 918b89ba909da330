"""benchmarks/rl_feedback.py's verdict on constructed per-seed tables: it passes only when feedback wins on
both primary metrics by the required margin and significance, never raises the invalid-call rate, and the
null-hint arm does not beat RL alone; each criterion can fail on its own."""

import pytest
from tiny import load_script


@pytest.fixture(scope="module")
def bench():
  return load_script("benchmarks/rl_feedback.py")


def _run(rewards, invalid):
  """One arm's run: fixed-set evaluations at steps 0, 15, 30."""
  points = zip((0, 15, 30), rewards, invalid, strict=True)
  return {"evals": [{"step": s, "reward": r, "invalid_call_rate": i} for s, r, i in points], "history": []}


def _runs(fb_final=0.8, fb_invalid=0.05, null_final=0.5, n=6):
  seeds = [str(s) for s in range(n)]
  return {
    "alone": {s: _run((0.45, 0.48, 0.5 + 0.01 * int(s)), (0.17, 0.17, 0.16)) for s in seeds},
    "feedback": {s: _run((0.45, 0.7, fb_final + 0.01 * int(s)), (0.17, 0.08, fb_invalid)) for s in seeds},
    "null": {s: _run((0.45, 0.47, null_final + 0.01 * int(s)), (0.17, 0.17, 0.17)) for s in seeds},
  }


def test_table_reads_final_auc_and_invalid(bench):
  t = bench.per_seed(_runs())
  row = t["feedback"]["2"]
  assert row["final"] == pytest.approx(0.82) and row["invalid"] == 0.05 and row["reward0"] == 0.45
  # trapezoid over steps 0..30 divided by the range: (0.45 + 0.7)/4 + (0.7 + 0.82)/4
  assert row["auc"] == pytest.approx((0.45 + 0.7) / 4 + (0.7 + 0.82) / 4)


def test_verdict_passes_and_each_criterion_can_fail(bench):
  lines, ok = bench.verdict(bench.per_seed(_runs()))
  assert ok, lines
  _, ok = bench.verdict(bench.per_seed(_runs(fb_final=0.55)))  # final ahead by < 0.10
  assert not ok
  _, ok = bench.verdict(bench.per_seed(_runs(fb_invalid=0.165)))  # invalid calls above RL alone's
  assert not ok
  lines, ok = bench.verdict(bench.per_seed(_runs(null_final=0.6)))  # the null hint beats RL alone
  assert not ok and any("null" in x and "FAIL" in x for x in lines), lines
  lines, ok = bench.verdict(bench.per_seed(_runs(n=3)))  # 3 seeds: p = 1/8 > 0.05 even if all win
  assert not ok, lines


def test_compact_keeps_each_problems_outcome(bench):
  problems = {"seed": [3, 4], "risky_first_fadd": [[1, 2], [0, 1]], "all_correct": [[0, 1], [1, 1]]}
  ev = {"step": 5, "reward": 0.5, "risky_first_fadd": 1 / 3, "problems": problems, "tokens_per_rollout": 40.0}
  out = bench.compact(
    {"informative": {"100": {"evals": [ev], "history": [{"step": 1, "reward": 0.4, "x": 1}]}}}
  )
  kept = out["informative"]["100"]
  assert kept["evals"] == [{k: ev[k] for k in ("step", "reward", "risky_first_fadd", "problems")}]
  assert kept["history"] == [{"step": 1, "reward": 0.4}]
