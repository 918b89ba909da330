"""The feedback gate's parts against independent references: the valid-call oracle on constructed turns,
the statistics (CI by hand, the exact Wilcoxon against scipy's exact test and a hand enumeration, the curve
mean against numpy), and the gate verdicts on constructed numbers (each gate can fail, and says why)."""

import itertools

import numpy as np
import pytest

from composer_jax.configs import GateConfig
from composer_jax.rl import chat, gate, stats

TOK = chat.BYTE_TOKENIZER
ARITY = {"add": 2, "times": 2, "answer": 1}


@pytest.mark.parametrize(
  "call, want",
  [
    (("sum", "3", "4"), 1),  # 's' starts no accepted name: the decision token is the name's first byte
    (("addx", "3", "4"), 4),
    (("add", "3"), 6),  # closed after one argument: the closing token
    (("add", "3", "4", "5"), 8),  # a third argument: its separating space
    (("add", "-3", "4"), None),
    (("answer", "12"), None),
    (("times", "3", "x"), 9),
  ],
)
def test_decision_index(call, want):
  assert gate.decision_index(chat.assistant_ids(call=call), ARITY) == want


def test_valid_next_sets():
  open_id, close_id = TOK.special_id("<|tool_call|>"), TOK.special_id("<|/tool_call|>")
  ids = chat.assistant_ids(call=("add", "3", "4"))
  assert gate.valid_next([], ARITY) == [open_id]
  assert sorted(gate.valid_next(ids[:1], ARITY)) == [ord("a"), ord("t")]
  assert gate.valid_next(ids[:3], ARITY) == [ord("d")]
  assert sorted(gate.valid_next(ids[:5], ARITY)) == sorted([ord("-")] + [ord(str(d)) for d in range(10)])
  assert close_id in gate.valid_next(ids[:-1], ARITY) and ord(" ") not in gate.valid_next(ids[:-1], ARITY)
  assert gate.valid_next([ord("a")], ARITY) == []  # prose before the call: not a direct call


def test_mean_ci_by_hand():
  x = [0.0, 1.0, 1.0, 0.5]
  m, lo, hi = stats.mean_ci(x)
  s = np.sqrt(sum((v - 0.625) ** 2 for v in x) / 3)
  assert m == pytest.approx(0.625) and hi - m == pytest.approx(1.959963984540054 * s / 2)
  assert stats.mean_ci([0.3]) == (0.3, 0.3, 0.3)


def _wilcoxon_by_hand(d):
  """P(W+ ≥ w) by enumerating signs, ranks from scratch (average ranks for ties)."""
  d = [v for v in d if v != 0]
  a = sorted(abs(v) for v in d)
  rank = {v: np.mean([i + 1 for i, u in enumerate(a) if u == v]) for v in a}
  w = sum(rank[abs(v)] for v in d if v > 0)
  null = [
    sum(rank[abs(v)] for v, s in zip(d, signs, strict=True) if s)
    for signs in itertools.product((0, 1), repeat=len(d))
  ]
  return w, np.mean([x >= w - 1e-9 for x in null])


@pytest.mark.parametrize(
  "d",
  [
    [0.12, 0.3, 0.05, 0.2, 0.15, 0.22],  # all positive, n = 6: p = 1/64
    [0.1, -0.02, 0.3, 0.05, 0.2, -0.01, 0.15],
    [0.1, 0.1, -0.1, 0.2, 0.0, 0.3],  # ties and a zero
    [-0.2, -0.1, 0.05, -0.3, -0.02, 0.01],
  ],
)
def test_wilcoxon_exact(d):
  w, p = stats.wilcoxon_greater(d)
  assert (w, p) == pytest.approx(_wilcoxon_by_hand(d))
  scipy_stats = pytest.importorskip("scipy.stats")
  if len(set(np.abs(d))) == len(d) and 0 not in d:  # scipy's exact method: no ties, no zeros
    ref = scipy_stats.wilcoxon(d, alternative="greater", method="exact")
    assert p == pytest.approx(ref.pvalue) and w == pytest.approx(ref.statistic)


def test_wilcoxon_all_positive_six_seeds_is_one_in_64():
  assert stats.wilcoxon_greater([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == (21.0, pytest.approx(1 / 64))
  assert stats.wilcoxon_greater([0.0, 0.0]) == (0.0, 1.0)


def test_curve_mean_is_trapezoid_over_range():
  steps, vals = [0, 10, 20, 30], [0.3, 0.5, 0.6, 0.7]
  assert stats.curve_mean(steps, vals) == pytest.approx(np.trapezoid(vals, steps) / 30)
  assert stats.curve_mean([0], [0.4]) == 0.4


class _T:
  def __init__(self, r):
    self.reward = r


def _evaluate(student, task, null, wrong, lowered=0.95, prefix_gap=0.0, share=0.3, r_gap=0.8):
  F = 120
  rng = np.random.default_rng(0)
  valid = {
    c: np.clip(v + rng.normal(0, 0.01, F), 0, 1)
    for c, v in (("student", student), ("task", task), ("null", null), ("wrong", wrong))
  }
  decisions = [
    {"kind": "stale_tool", "p_student": 0.9, "p_teacher": 0.1 if i < lowered * F else 0.95,
     "prefix_gap": prefix_gap, "valid_student": 0.0, "valid_teacher": 0.9}
    for i in range(F)
  ]  # fmt: skip
  n = 400
  flagged = set(range(int(share * n)))
  trajs = [_T(0.0 if i in flagged else r_gap) for i in range(n)]
  return gate.evaluate(valid, decisions, trajs, flagged, GateConfig())


def test_gates_pass_and_each_one_can_fail():
  ok = _evaluate(0.0, 0.99, 0.01, 0.0)
  assert ok["passed"] and all(g["pass"] for g in ok["gates"].values())
  cases = {
    "G1": dict(task=0.25),  # the hint helps too little
    "G2": dict(null=0.2),  # a neutral note helps as much: form, not content
    "G3": dict(wrong=0.9),  # a wrong hint works as well: content ignored
    "G4": dict(lowered=0.5),
    "G5": dict(share=0.8),
  }
  base = dict(student=0.0, task=0.99, null=0.01, wrong=0.0)
  for name, change in cases.items():
    r = _evaluate(**(base | change))
    failed = [k for k, g in r["gates"].items() if not g["pass"]]
    assert failed == [name] and not r["passed"], (name, failed)
  r = _evaluate(**base, prefix_gap=-0.05)  # the teacher lowers valid mass before the mistake
  assert not r["gates"]["G4"]["pass"] and "valid-prefix mass" in r["gates"]["G4"]["why"]
  r = _evaluate(**base, r_gap=0.1)  # the mistake costs nothing
  assert not r["gates"]["G5"]["pass"]


@pytest.mark.slow
def test_default_sft_passes_the_gate_and_feedback_leads(tmp_path):
  """The one-command defaults end to end (minus pretrain/synth, ~8 min on 2 cores): the SFT checkpoint
  passes every gate, and after the rl stage RL + feedback is ahead of RL alone on the fixed problems."""
  import importlib.util
  import pathlib

  from composer_jax import configs, stages

  spec = importlib.util.spec_from_file_location(
    "composer25", pathlib.Path(__file__).resolve().parents[1] / "experiments" / "composer25.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = configs.from_config(module.get_config("tiny"))
  stages.sft.run(config, str(tmp_path))
  report = stages.gate.run(config, str(tmp_path))
  assert report["passed"], report["gates"]
  rl = stages.REGISTRY["rl"]
  effect = rl.summarize(stages.rl.run(config, str(tmp_path)), tmp_path)["effect"]
  assert effect["ahead"] and effect["where"].startswith("fixed problems"), effect
