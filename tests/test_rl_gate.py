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


def _ledger_flagged(call):
  """A ledger rollout whose first turn is `call` on the first pair (then add for the rest, done), as the
  gate's `Flagged` of that turn with its hints."""
  from test_rl_envs import scripted

  from composer_jax.rl import envs, feedback
  from composer_jax.rl.envs import ledger

  cfg = ledger.LedgerConfig(k=2, max_turns=5)
  env = ledger.LedgerEnv(cfg)
  for seed in range(1000):
    env.reset(seed)
    if ledger.is_risky(*env.pairs[0]):
      break
  (a, b), (c, d) = env.pairs
  calls = [(call, str(a), str(b)), ("add", str(c), str(d)), ("done",)]
  traj = envs.rollout(env, seed, scripted(calls), max_turns=cfg.max_turns)
  found = feedback.detect(traj, env.info())
  k = found[0][0] if found else 1
  hints = {"student": []} | {
    v: feedback.hint_ids(feedback.hint_at(traj, k, "wrapping_call", env.info(), variant=v)) for v in ("task",)
  }
  return gate.Flagged(traj, env, k, "wrapping_call", hints), found, (a, b)


def test_ledger_oracle_judges_a_wrapping_fadd_at_its_tool_name():
  """A wrapping `fadd a b` is well-formed, so the syntactic oracle finds no decision token in it; the
  ledger's oracle (the right calls on the turn's operands: `add a b`, and `fadd a b` only when a+b < 100)
  puts it at the `f`, where `add` was right."""
  from composer_jax.rl.envs import ledger

  arity = dict(ledger.INFO["arity"])
  risky = chat.assistant_ids(call=("fadd", "45", "67"))
  assert gate.decision_index(risky, arity) is None  # the syntactic oracle cannot see it
  env = ledger.LedgerEnv()
  oracle = gate.turn_oracle(env, risky)
  assert oracle == gate.Calls(("add 45 67",))
  assert gate.decision_index(risky, oracle) == 1 and risky[1] == ord("f")
  assert gate.valid_next(risky[:1], oracle) == [ord("a")]  # only add continues a right call
  for ok in (("fadd", "45", "23"), ("add", "45", "67"), ("add", "45", "23")):
    ids = chat.assistant_ids(call=ok)
    assert gate.decision_index(ids, gate.turn_oracle(env, ids)) is None, ok
  safe = chat.assistant_ids(call=("fadd", "45", "23"))
  assert sorted(gate.valid_next(safe[:1], gate.turn_oracle(env, safe))) == [ord("a"), ord("f")]
  done = chat.assistant_ids(call=("done",))  # not an add/fadd: the syntactic oracle judges it
  assert gate.turn_oracle(env, done) == gate.Syntax(ledger.INFO["arity"])
  wrong_name = chat.assistant_ids(call=("sum", "3", "4"))
  assert gate.decision_index(wrong_name, gate.turn_oracle(env, wrong_name)) == 1


def test_g4_scores_the_ledgers_flagged_turn_at_the_tool_choice(monkeypatch):
  """`decision_stats` on a flagged ledger turn (a wrapping fadd): with stand-in log-probabilities (the
  student uniform, the hinted teacher's `f` 100x less likely than any other byte), the decision is the
  `f`: p(mistake) 1/V vs the teacher's, valid mass = p("a") under each. Before the ledger's oracle the
  turn had no decision token and G4 saw no ledger turn at all."""
  flagged, found, (a, b) = _ledger_flagged("fadd")
  assert found and found[0] == (flagged.k, "wrapping_call")
  V = TOK.vocab_size

  def fake_logp_rows(params, cfg, rows, meshes=None, chunk=64):
    out = []
    for r in rows:
      logits = np.zeros((len(r), V))
      if len(r) > len(flagged.traj.tokens[: flagged.traj.spans[flagged.k][1]]):  # the hinted row
        logits[:, ord("f")] = -np.log(100.0)
      out.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    return out

  monkeypatch.setattr(gate, "_logp_rows", fake_logp_rows)
  stats_ = gate.decision_stats(None, None, [flagged])
  assert len(stats_) == 1, "the flagged ledger turn has a decision token"
  d = stats_[0]
  z_teacher = (V - 1) + 1 / 100
  assert d["p_student"] == pytest.approx(1 / V) and d["p_teacher"] == pytest.approx(0.01 / z_teacher)
  assert d["valid_student"] == pytest.approx(1 / V) and d["valid_teacher"] == pytest.approx(1 / z_teacher)
  assert d["prefix_gap"] == pytest.approx(1 / z_teacher - 1 / V)  # before the `f`: <|tool_call|>'s mass
  safe, found_safe, _ = _ledger_flagged("add")
  assert not found_safe and gate.decision_points([safe]) == []  # add on the risky pair: nothing wrong


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
