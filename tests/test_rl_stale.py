"""The stale-docs environment: the shared rename rule, errors that name the failure but not the fix, the
cost of wrong calls, its detector and hints (task, null, wrong content), and an SFT corpus that teaches
every hint it can emit without ever teaching the rule unhinted."""

import collections

import pytest
from test_rl_envs import scripted

from composer_jax.rl import chat, envs, feedback
from composer_jax.rl.envs import stale

TOK = chat.BYTE_TOKENIZER


def _stale_seed(op: str) -> int:
  """A seed whose problem uses `op` and whose docs name that op's retired tool."""
  for s in range(10_000):
    e = stale.StaleEnv()
    e.reset(s)
    if op in e.stale_ops():
      return s
  raise AssertionError("no stale episode")


def _gold(env: stale.StaleEnv, use_docs: bool = False) -> list[tuple[str, ...]]:
  names = env.docs if use_docs else {op: n for n, op in env.accepts.items() if op in stale.NAMES}
  calls = [(names[op], str(a), str(b)) for op, a, b, _ in env.problem.steps]
  return calls + [("answer", str(env.problem.target))]


def test_episodes_are_a_function_of_the_seed_and_follow_the_rule():
  seen = collections.Counter()
  for s in range(400):
    e1, e2 = stale.StaleEnv(), stale.StaleEnv()
    assert e1.reset(s) == e2.reset(s) and e1.accepts == e2.accepts
    for op, name in e1.docs.items():
      current = dict(stale.RENAMED).get(name, name)
      assert e1.accepts[current] == op and name in stale.NAMES[op]
      seen[name in dict(stale.RENAMED)] += 1
  assert 0.2 < seen[True] / sum(seen.values()) < 0.4  # stale_rate 0.3 per tool
  # No prompt documents a current name, so a docs-following policy cannot sample it by chance.
  assert not {new for _, new in stale.RENAMED} & {n for pool in stale.NAMES.values() for n in pool}


def test_stale_docs_fail_without_the_fix_and_cost_reward():
  s = _stale_seed("add")
  env = stale.StaleEnv()
  env.reset(s)
  traj = envs.rollout(stale.StaleEnv(), s, scripted(_gold(env, use_docs=True)[:1] * 6))
  obs = [TOK.decode(traj.turn_tokens(k)) for k, r in enumerate(traj.turn_roles) if r == chat.TOOL]
  assert obs[0] == "<|tool_result|>Error: unknown tool 'sum'.<|/tool_result|>"  # no list of tools: no fix
  assert traj.status == chat.COMPLETED and traj.reward == -0.25 and traj.info["turns"] == 1  # ends at once
  retry = stale.StaleEnv(stale.StaleConfig(max_errors=0))
  traj = envs.rollout(retry, s, scripted(_gold(env, use_docs=True)[:1] * 6))
  assert traj.status == chat.TRUNCATED and traj.reward == -0.25 * retry.max_turns
  good = envs.rollout(stale.StaleEnv(), s, scripted(_gold(env)))
  assert (good.reward, good.info["invalid_calls"]) == (1.0, 0)
  env2 = stale.StaleEnv(stale.StaleConfig(invalid_penalty=0.25, max_errors=2))
  one_bad = [("sum", "1", "2")] + _gold(env)
  assert envs.rollout(env2, s, scripted(one_bad)).reward == pytest.approx(0.75)


def test_check_is_pure_and_names_the_error():
  env = stale.StaleEnv()
  env.reset(_stale_seed("mul"))
  assert env.check(chat.ToolCall("prod", ("2", "3"))) == "Error: unknown tool 'prod'."
  assert env.check(chat.ToolCall("vmul", ("2",))) == "Error: vmul takes 2 integer arguments."
  assert env.check(chat.ToolCall("answer", ("x",))) == "Error: answer takes 1 integer argument."
  assert env.check(chat.ParseError("truncated")) == "Error: malformed tool call."
  assert env.check(chat.ToolCall("vmul", ("2", "3"))) == "" and env.invalid == 0


def test_detector_and_hint_variants():
  s = _stale_seed("add")
  env = stale.StaleEnv()
  env.reset(s)
  traj = envs.rollout(env, s, scripted(_gold(env, use_docs=True)[:1] * 6))
  info = env.info()
  found = feedback.detect(traj, info)
  assert found[0][1] == "stale_tool" and {k for _, k in found} == {"stale_tool"}
  k = found[0][0]
  assert feedback.hint_at(traj, k, "stale_tool", info) == "Note: the tool sum was renamed to vadd."
  assert feedback.hint_at(traj, k, "stale_tool", info, variant="null") == feedback.NULL_NOTE
  wrong = feedback.hint_at(traj, k, "stale_tool", info, variant="wrong")
  decoy = dict(info["decoys"])["vadd"]
  assert wrong == f"Note: the tool sum was renamed to {decoy}." and env.check(
    chat.ToolCall(decoy, ("1", "2"))
  )
  # An unknown (not renamed) tool gets the unknown_tool hint with the accepted names.
  bad = envs.rollout(stale.StaleEnv(), s, scripted([("calc", "1", "2")] + _gold(env)))
  assert feedback.detect(bad, info) == [(1, "unknown_tool")]
  assert (
    feedback.hint_for("unknown_tool", info) == f"Reminder: available tools are {', '.join(info['tools'])}."
  )


def test_demonstrations_teach_every_hint_and_never_the_rule_unhinted():
  demos = stale.demonstrations(600, seed=3)
  kinds = collections.Counter(d.info["kind"] for d in demos)
  assert set(kinds) == {
    "plain",
    "stale_mistake",
    "unknown_mistake",
    "override",
    "null_note",
    "renamed_reminder",
  }
  user_msgs = set()
  for d in demos:
    user_msgs |= {TOK.decode(d.turn_tokens(k)[1:-1]) for k, r in enumerate(d.turn_roles) if r == chat.USER}
  emitted = {feedback.rename_hint(old, new) for old, new in stale.RENAMED} | {feedback.NULL_NOTE}
  renamed = dict(stale.RENAMED)
  for add in stale.NAMES["add"]:  # the accepted names of every documentation the environment can show
    for mul in stale.NAMES["mul"]:
      tools = (renamed.get(add, add), renamed.get(mul, mul), "answer")
      emitted.add(feedback.hint_for("unknown_tool", {"tools": tools}))
  assert emitted <= user_msgs, emitted - user_msgs
  follows_reminder: set[int] = set()  # demos where a taught call uses a name only a reminder gave
  for d in demos:
    hinted: dict[str, str] = {}  # documented name -> the name a hint in context renamed it to
    for k, role in enumerate(d.turn_roles):
      text = TOK.decode(d.turn_tokens(k))
      if role == chat.USER and "was renamed to" in text:
        old, new = (
          text.removeprefix("<|user|>Note: the tool ").removesuffix(".<|end_turn|>").split(" was renamed to ")
        )
        hinted[old] = new
      if role == chat.USER and text.startswith("<|user|>Reminder: available tools are "):
        listed = text.removeprefix("<|user|>Reminder: available tools are ").removesuffix(".<|end_turn|>")
        hinted |= {f"listed {name}": name for name in listed.split(", ")}
      if role != chat.ASSISTANT:
        continue
      call = chat.parse_tool_call(d.turn_tokens(k))
      taught = any(d.loss_mask[slice(*d.spans[k])])
      if not taught:  # mistakes: shown, never taught
        pool = {x for names in stale.NAMES.values() for x in names}
        assert call.name in renamed or call.name in stale.WRONG_NAMES or call.name in pool
        if d.info["kind"] != "stale_mistake":  # there the mistake is the documented, retired name
          assert call.name not in d.info["docs"].values() and call.name not in hinted.values()
        continue
      documented = [n for n in d.info["docs"].values()] + ["answer"]
      # A taught call uses a documented name, or the name a hint in context gave it.
      assert call.name in documented or call.name in hinted.values(), TOK.decode(d.tokens)
      if d.info["kind"] == "renamed_reminder" and call.name not in documented:
        follows_reminder.add(id(d))
  # The reminder overrides the docs where the server renamed a documented tool (the feedback teacher's
  # situation on stale-docs episodes): the current name follows it in every such demo.
  assert len(follows_reminder) == kinds["renamed_reminder"] > 0
  # ... and only after an error: a reminder before a stale-docs turn with no mistake taught "a message
  # here means depart from the docs", and the neutral note then raised the valid rate (gate G2).
  for d in (d for d in demos if d.info["kind"] == "renamed_reminder"):
    texts = [TOK.decode(d.turn_tokens(k)) for k in range(len(d.turn_roles))]
    at = next(k for k, t in enumerate(texts) if t.startswith("<|user|>Reminder: "))
    assert d.turn_roles[at - 1] == chat.TOOL and "Error: unknown tool" in texts[at - 1]
