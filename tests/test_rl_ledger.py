"""Ledger-K: pairs half risky with a margin, fadd wrapping only on the RL servers, the terminal binary
reward, the detector and its hints, the informative arm's redo, the M1 bookkeeping, an SFT corpus that
never teaches the rule unhinted, a K = 12 episode that fits the engine's cache and the model, each
fixed-set problem's outcome kept (against the pairs worked out independently), and the reference policy's
evaluation (the rule in the prompt, the silent env)."""

import collections
import dataclasses
import re

import numpy as np
import pytest
from test_rl_envs import scripted
from tiny import load_script

from composer_jax import configs
from composer_jax.rl import batch, chat, envs, feedback
from composer_jax.rl.envs import factories, ledger
from composer_jax.stages import rl as rl_stage

TOK = chat.BYTE_TOKENIZER
RULE = "fadd wraps above 99; use add when a+b >= 100."


def _env(k=3, mode="silent", **kw):
  return ledger.LedgerEnv(ledger.LedgerConfig(k=k, max_turns=k + 3 + k // 2, **kw), mode)


def _seed(k, want):
  """A seed whose pairs' risk pattern is `want` (tuple of bools)."""
  for s in range(10_000):
    e = _env(k)
    e.reset(s)
    if tuple(ledger.is_risky(*p) for p in e.pairs) == want:
      return s
  raise AssertionError(want)


def _play(env, seed, tools, done=True):
  """One scripted episode: `tools[i]` enters pair i with that tool's correct operands."""
  probe = _env(env.cfg.k)
  probe.reset(seed)
  calls = [(t, str(a), str(b)) for t, (a, b) in zip(tools, probe.pairs, strict=False)]
  return envs.rollout(env, seed, scripted(calls + [("done",)] * done), max_turns=env.max_turns)


def test_pairs_are_seeded_half_risky_and_never_at_the_boundary():
  risky, n = 0, 0
  for s in range(500):
    a, b = _env(4), _env(4)
    assert a.reset(s) == b.reset(s) and a.pairs == b.pairs
    for x, y in a.pairs:
      assert 10 <= x <= 99 and 10 <= y <= 99
      tens = x // 10 + y // 10
      assert tens >= 10 or tens <= 8  # risky iff the tens digits reach 10: no sum in 99..100's reach
      assert ledger.is_risky(x, y) == (tens >= 10) and (x + y >= 100) == (tens >= 10)
      risky, n = risky + (tens >= 10), n + 1
  assert 0.45 < risky / n < 0.55


def test_fadd_wraps_only_on_the_rl_servers():
  s = _seed(3, (True, False, True))
  probe = _env()
  probe.reset(s)
  sums = [a + b for a, b in probe.pairs]
  for mode, want in (("sft", sums), ("silent", [x % 100 for x in sums]), ("informative", None)):
    env = _env(mode=mode)
    traj = _play(env, s, ["fadd"] * 3)
    if mode == "informative":  # refused, not recorded: only the safe pair is entered
      assert env.ledger == [sums[1]] and traj.reward == pytest.approx(-0.5)
      continue
    assert env.ledger == want and traj.reward == (1.0 if mode == "sft" else 0.0)
  silent = _env()
  assert _play(silent, s, ["add", "fadd", "add"]).reward == 1.0  # a safe fadd is exact in RL too


def test_reward_is_terminal_and_binary():
  s = _seed(3, (False, True, False))
  assert _play(_env(), s, ["add"] * 3).reward == 1.0
  assert _play(_env(), s, ["add"] * 3, done=False).reward == 0.0  # no done: truncated, 0
  assert _play(_env(), s, ["add"] * 2).reward == 0.0  # done with an entry missing
  wrong = _env()
  traj = envs.rollout(wrong, s, scripted([("add", "10", "10")] * 3 + [("done",)]))
  assert traj.reward == 0.0 and wrong.ledger == [20] * 3  # entries must be the pairs' sums
  over = _env()
  probe = _env()
  probe.reset(s)
  calls = [("add", str(a), str(b)) for a, b in probe.pairs] + [("add", "1", "2"), ("bogus",), ("done",)]
  traj = envs.rollout(over, s, scripted(calls))
  obs = [TOK.decode(traj.turn_tokens(k)) for k, r in enumerate(traj.turn_roles) if r == chat.TOOL]
  assert obs[2:] == [
    "<|tool_result|>ledger full<|/tool_result|>",
    "<|tool_result|>Error: the ledger is full; call done.<|/tool_result|>",
    "<|tool_result|>Error: unknown tool. Tools: add, fadd, done.<|/tool_result|>",
  ]
  assert traj.reward == 1.0 and traj.info["invalid_calls"] == 2


def test_detector_flags_exactly_a_wrapping_fadd_and_the_hints():
  info = _env().info()
  for name, a, b, flagged in [
    ("fadd", 50, 50, True), ("fadd", 99, 99, True), ("fadd", 50, 49, False), ("add", 60, 70, False),
    ("fadd", 1, 2, False),
  ]:  # fmt: skip
    traj = chat.Trajectory()
    traj.add_message(chat.USER, "Ledger 1 2.", TOK)
    traj.add_assistant_turn(chat.assistant_ids(call=(name, str(a), str(b))))
    assert feedback.detect(traj, info) == ([(1, "wrapping_call")] if flagged else []), (name, a, b)
  s = _seed(3, (False, True, True))
  traj = _play(_env(), s, ["fadd", "fadd", "add"])
  assert feedback.detect(traj, info) == [(3, "wrapping_call")]  # the second call, after prompt and reply
  assert feedback.hint_for("wrapping_call", info) == RULE == ledger.RULE
  assert feedback.hint_for("wrapping_call", info, variant="wrong") == (
    "add wraps above 99; use fadd when a+b >= 100."
  )
  assert feedback.hint_for("wrapping_call", info, variant="null") == feedback.NULL_NOTE
  assert (
    _env().check(chat.ToolCall("fadd", ("60", "70"))) == RULE
    and _env().check(chat.ToolCall("add", ("60", "70"))) == ""
  )
  # Other environments' detections are unchanged: their info has no wrapping tool.
  assert "wrapping_call" not in feedback.DEFAULT_KINDS


def test_informative_arm_continues_and_the_entry_is_redone():
  s = _seed(3, (True, False, False))
  probe = _env()
  probe.reset(s)
  (a, b), rest = probe.pairs[0], probe.pairs[1:]
  calls = [("fadd", str(a), str(b)), ("add", str(a), str(b))] + [("add", str(x), str(y)) for x, y in rest]
  env = _env(mode="informative")
  traj = envs.rollout(env, s, scripted(calls + [("done",)]), max_turns=env.max_turns)
  obs = [TOK.decode(traj.turn_tokens(k)) for k, r in enumerate(traj.turn_roles) if r == chat.TOOL]
  assert (
    obs[0] == f"<|tool_result|>{RULE} next {a} {b}<|/tool_result|>"
    and obs[1] == f"<|tool_result|>next {rest[0][0]} {rest[0][1]}<|/tool_result|>"
  )
  assert env.ledger == [a + b, *(x + y for x, y in rest)] and traj.status == chat.COMPLETED
  assert traj.reward == pytest.approx(1.0 - 0.25)  # right after the redo, minus one redo_cost
  assert env.metrics()["risky_first_fadd"] == (1.0, 1.0)  # the first attempt is what M1 counts
  silent = _env()
  traj = envs.rollout(silent, s, scripted(calls + [("done",)]), max_turns=silent.max_turns)
  assert traj.reward == 0.0  # the same calls in the silent env: entry 1 wrapped, the rest shifted


def test_metrics_count_first_attempts_on_risky_pairs():
  s = _seed(4, (True, True, False, True))
  env = _env(4)
  _play(env, s, ["fadd", "add", "fadd", "add"])
  m = env.metrics()
  assert m["risky_first_fadd"] == (1.0, 3.0) and m["safe_accuracy"] == (1.0, 1.0)
  assert m["attempted"] == (4.0, 4.0) and m["all_correct"] == (0.0, 1.0)
  short = _env(4)
  _play(short, s, ["fadd"])  # done after one entry: only that pair was attempted
  assert short.metrics()["risky_first_fadd"] == (1.0, 1.0) and short.metrics()["attempted"] == (1.0, 4.0)


def test_demonstrations_teach_the_rule_only_with_it_in_context():
  demos = ledger.demonstrations(1500, seed=3, max_k=12)
  kinds = collections.Counter(d.info["kind"] for d in demos)
  assert set(kinds) == {"plain", *ledger.KINDS}
  unhinted = collections.Counter()
  for d in demos:
    text = TOK.decode(d.tokens)
    assert (RULE in text) == (d.info["kind"] in ("hint_before", "informative", "rule_in_prompt"))
    knows, taught = False, []
    for k in range(len(d.spans)):
      knows |= RULE in TOK.decode(d.turn_tokens(k))  # the prompt, a hint message or the server's reply
      if d.turn_roles[k] == chat.ASSISTANT and d.sampled_tokens(k):
        call = chat.parse_tool_call(d.sampled_tokens(k))
        taught.append(call)
        if call.name in ("add", "fadd") and ledger.is_risky(*map(int, call.args)):
          if knows:
            assert call.name == "add"
          else:
            unhinted[call.name] += 1
    assert [c.name for c in taught[:-1]] and taught[-1].name == "done"
    entered = [tuple(map(int, c.args)) for c in taught[:-1]]
    assert entered == list(d.info["pairs"])  # every pair once, in order, with its own operands
  assert 0.45 < unhinted["fadd"] / sum(unhinted.values()) < 0.55  # the fix is sampled ~half the time
  shown = [d for d in demos if d.info["kind"] == "informative"]
  for d in shown:  # the refused fadd is context (mask 0), never taught
    k = next(k for k in d.assistant_turns() if not d.sampled_tokens(k))
    assert chat.parse_tool_call(d.turn_tokens(k)[1:]).name == "fadd"


def _engine_slots(traj: chat.Trajectory, max_turn_tokens: int) -> int:
  """The KV-cache engine's slots for one row (`rl.engine.KVCacheSampler.generate`): each turn appends the
  new context padded to a power of two ≥ 16, then `max_turn_tokens` sampled slots."""
  header, used, held = chat.role_token_id(chat.ASSISTANT), 0, 0
  for k in traj.assistant_turns():
    s, _ = traj.spans[k]
    context = traj.tokens[:s] + [header]
    used += batch.bucket(len(context) - held, 16) + max_turn_tokens
    held = len(context) + len(traj.sampled_tokens(k))
  return used


def test_a_k12_episode_fits_the_context_of_the_stages_tokenizer():
  config = configs.from_config(load_script("experiments/composer25.py").get_config("tiny"))
  tok = chat.tokenizer(config.data.tokenizer)
  n, context = config.rl.max_turn_tokens, config.model.max_position_embeddings
  turns, slots = ledger.budget(12, tok, n)
  assert turns == 21 and slots == 1872
  worst = 0
  for s in range(20):
    probe = _env(12)
    probe.reset(s)
    gold = [("add", str(a), str(b)) for a, b in probe.pairs]
    silent = envs.rollout(_env(12), s, scripted(gold + [("done",)]), max_turns=turns)
    assert silent.reward == 1.0 and silent.info["turns"] == 13 and len(silent) <= 512  # one batch bucket
    redo = [
      c
      for (a, b), g in zip(probe.pairs, gold, strict=True)
      for c in [("fadd", str(a), str(b))] + [g] * ledger.is_risky(a, b)
    ]
    env = _env(12, mode="informative")  # each pair first tried with fadd: a redo per risky pair
    traj = envs.rollout(env, s, scripted(redo + [("done",)]), max_turns=turns)
    assert env.correct() == (len(redo) + 1 <= turns)  # up to 2 + K // 2 redos fit the turn budget
    assert len(traj) <= context or not env.correct()  # a finished episode fits the model's 1024 positions
    # The engine's worst case: every spare turn a malformed call, answered by the longest error.
    junk = [chat.assistant_ids(call=c) for c in redo] + [chat.assistant_ids("?" * (n - 1))] * turns
    calls = junk[: turns - 1] + [chat.assistant_ids(call=("done",))]
    worst = max(
      worst, _engine_slots(envs.rollout(_env(12, mode="informative"), s, scripted(calls), max_turns=turns), n)
    )
  assert worst <= slots
  problems = rl_stage._ledger_problems(
    dataclasses.replace(config.rl, env="ledger", ledger=configs.LedgerEnvConfig(k=12)), tok
  )
  assert (
    len(problems) == 2 and "rl.max_turns 4 < 21" in problems[0] and "rl.cache_len 768 < 1872" in problems[1]
  )
  fits = dataclasses.replace(
    config.rl, env="ledger", max_turns=turns, cache_len=slots, ledger=configs.LedgerEnvConfig(k=12)
  )
  assert rl_stage._ledger_problems(fits, tok) == []


def test_factory_trains_in_the_arm_env_and_evaluates_silently():
  rcfg = configs.RLConfig(env="ledger", max_turns=7, ledger=configs.LedgerEnvConfig(k=3, informative=True))
  env_list, seeds, groups = factories.factory(rcfg, "", None)(0)
  assert all(e.mode == "informative" for e in env_list) and len(env_list) == len(seeds) == len(groups)
  fixed, _ = factories.fixed_set(rcfg, 4)
  assert all(e.mode == "silent" and e.cfg.k == 3 for e in fixed)
  demos = factories.demonstrations(rcfg, configs.SFTConfig(demos=20), 0, TOK)
  assert all(TOK.decode(d.tokens).startswith("<|user|>Ledger ") for d in demos)


class _ParityPolicy:
  """A stand-in generation engine (the `Rollout` calls `evaluate` makes): each turn it reads the pair to
  enter from the context (the last `next a b`, else the prompt's first pair) and calls fadd when a is
  even, add when odd; `done` once the ledger is full. It records each row's first context (the prompt)."""

  cfg = None

  def __init__(self):
    self.prompts = []

  def update_weights(self, params):
    pass

  def reset(self, rows):
    self.prompts = [None] * rows

  def generate(self, contexts, live, key):
    from composer_jax.rl.engine import Generated

    out = []
    for b, (ctx, on) in enumerate(zip(contexts, live, strict=True)):
      if not on:
        out.append([])
        continue
      text = TOK.decode(ctx)
      self.prompts[b] = self.prompts[b] or text
      nxt = list(re.finditer(r"next (\d+) (\d+)", text))
      if text.rfind(ledger.FULL) > max((m.start() for m in nxt), default=-1):
        out.append(chat.assistant_ids(call=("done",)))
        continue
      a, b_ = nxt[-1].groups() if nxt else re.search(r"Ledger (\d+) (\d+)", text).groups()
      out.append(chat.assistant_ids(call=("fadd" if int(a) % 2 == 0 else "add", a, b_)))
    return Generated(out, [[0.0] * len(x) for x in out])


def test_evaluation_keeps_each_problems_outcome():
  """Per-problem outcomes of a fixed-set evaluation against the pairs worked out independently: under
  the parity policy a risky pair's first call is fadd iff its a is even, and a problem is all right iff
  no risky pair has an even a (a safe fadd is right). The per-problem sums give the pooled measures."""
  from composer_jax.rl import rollout

  rcfg = configs.RLConfig(env="ledger", max_turns=7, ledger=configs.LedgerEnvConfig(k=3, informative=True))
  scores, problems = rollout.evaluate_problems(None, None, rcfg, TOK, n=24, engine=_ParityPolicy())
  _, seeds = factories.fixed_set(rcfg, 24)
  assert problems["seed"] == seeds
  for i, s in enumerate(seeds):
    probe = _env(3)
    probe.reset(s)
    risky = [(a, b) for a, b in probe.pairs if ledger.is_risky(a, b)]
    wrong = sum(a % 2 == 0 for a, _ in risky)
    assert problems["risky_first_fadd"][i] == [wrong, len(risky)], s
    assert problems["all_correct"][i] == [int(wrong == 0), 1] and problems["reward"][i] == int(wrong == 0)
    assert problems["attempted"][i] == [3, 3] and problems["safe_accuracy"][i] == [3 - len(risky)] * 2
  for name in ("risky_first_fadd", "all_correct", "safe_accuracy"):
    num, den = (sum(x[j] for x in problems[name]) for j in (0, 1))
    assert scores[name] == pytest.approx(num / den), name
  assert 0 < scores["risky_first_fadd"] < 1 and scores["pass_rate"] == pytest.approx(
    np.mean(problems["reward"])
  )


def test_problem_log_joins_outcomes_to_the_evaluation_records():
  from composer_jax.rl import rollout

  calls = iter([({"reward": 0.5}, {"seed": [1, 2], "reward": [0, 1]}), ({"reward": 1.0}, {"seed": [1, 2]})])
  log = rollout.ProblemLog(lambda params: next(calls))
  assert log("p0") == {"reward": 0.5} and log("p1") == {"reward": 1.0}  # the loop sees scalars only
  evals = [{"step": 0, "reward": 0.5}, {"step": 5, "reward": 1.0}]
  joined = log.attach(evals)
  assert joined[0]["problems"] == {"seed": [1, 2], "reward": [0, 1]} and joined[1]["step"] == 5
  assert log.attach(evals[:1]) == evals[:1]  # counts differ (another process's records): left as they are


def test_reference_policy_is_the_sft_model_told_the_rule_in_the_silent_env():
  """The reference (issue 32): the arm's settings with only the rule added to the prompt, scored in the
  silent env, so its fixed set is the arms' set with the rule at the end of each prompt."""
  from composer_jax.rl import rollout

  bench = load_script("benchmarks/rl_feedback.py")
  rcfg = configs.RLConfig(env="ledger", max_turns=7, ledger=configs.LedgerEnvConfig(k=3, informative=True))
  ref = bench.reference_config(rcfg)
  assert ref.ledger == dataclasses.replace(rcfg.ledger, rule_in_prompt=True, informative=False)
  assert dataclasses.replace(ref, ledger=rcfg.ledger) == rcfg
  policy = _ParityPolicy()
  rollout.evaluate_problems(None, None, ref, TOK, n=4, engine=policy)
  assert all(p.split("<|end_turn|>")[0].endswith(RULE) for p in policy.prompts)
  policy = _ParityPolicy()
  rollout.evaluate_problems(None, None, rcfg, TOK, n=4, engine=policy)
  assert not any(RULE in p for p in policy.prompts)
