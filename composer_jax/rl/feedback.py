"""Targeted text feedback, host side: find assistant turns that went wrong, a hint for each, and the
teacher's input with the hint inserted right before that turn.

  found = detect(traj, env.info(), FeedbackRules())          # [(turn k, kind), ...]
  hint = hint_ids(hint_for(kind, env.info()))                # a <|user|> message, token ids
  t = teacher_inputs(traj, k, hint)                          # teacher = prefix + hint + turn k
  # student logits at t.student_positions  <->  teacher logits at t.teacher_positions, token by token

Kinds (`KINDS`, first match wins): stale_tool (a tool the environment's shared rule renamed, stated
in `env_info["renamed"]`), unknown_tool, malformed_call, no_call, repeated_failure, claimed_success,
edits_tests (a write to a test file), over_long, wrapping_call (a call of a tool that wraps, stated in
`env_info["wraps"]` as (tool, modulus, safe tool), whose integer arguments sum to ≥ the modulus). An
environment names the kinds whose hints its SFT corpus teaches in `env_info["feedback_kinds"]`;
`FeedbackRules.kinds` overrides that. Most hints restate what is in context (tool names, the call
syntax, "run the tests"); stale_tool and wrapping_call state a rule shared by every episode, which a
model can learn for good ("shared rules can be distilled, per-episode private information cannot").
Controls for the gate and the null-hint arm: `hint_for(..., variant="null")` is a neutral note,
`variant="wrong"` the same hint with wrong content. The loss itself is `rl.feedback_loss` (divergence.py).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat

KINDS = (
  "stale_tool",
  "unknown_tool",
  "malformed_call",
  "no_call",
  "repeated_failure",
  "claimed_success",
  "edits_tests",
  "over_long",
  "wrapping_call",
)
# The kinds acted on when neither the rules nor the environment name any.
DEFAULT_KINDS = (
  "unknown_tool",
  "malformed_call",
  "repeated_failure",
  "claimed_success",
  "edits_tests",
  "over_long",
)
HINT_VARIANTS = ("task", "null", "wrong")
NULL_NOTE = "Note: check each step."  # the null control: a note of a hint's form that says nothing


@dataclasses.dataclass(frozen=True)
class FeedbackRules:
  kinds: tuple[str, ...] = ()  # (): env_info["feedback_kinds"], else DEFAULT_KINDS
  max_prose_tokens: int = 200  # over_long: more explanation than this in one turn
  success_pattern: str = r"\b(done|fixed|solved|all tests pass(ed|ing)?|tests (now )?pass)\b"
  failure_pattern: str = r"^Error\b|\b\d+ (failed|errors?)\b"  # an observation that reports a failure
  test_tool: str = "run_tests"  # claimed_success only applies to envs with this tool
  write_tool: str = "write_file"  # edits_tests: a write through this tool ...
  test_path_pattern: str = (
    r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$|conftest\.py$)"  # ... to such a path
  )
  hints: tuple[tuple[str, str], ...] = ()  # (kind, text) overrides; "{tools}" and "{example}" filled in


_HINTS = {
  "stale_tool": "Note: the tool {old} was renamed to {new}.",
  "unknown_tool": "Reminder: available tools are {tools}.",
  "malformed_call": "Reminder: call a tool as its name then arguments, e.g. {example}. Tools: {tools}.",
  "no_call": "Reminder: answer with a tool call. Available tools are {tools}.",
  "repeated_failure": "Reminder: that exact call already failed; change it or use another tool.",
  "claimed_success": "Reminder: run the tests with run_tests before saying the task is done.",
  "edits_tests": "Reminder: do not edit the tests; change the code they test.",
  "over_long": "Reminder: keep explanations short and act with a tool call.",
  "wrapping_call": "{wrap} wraps above {top}; use {safe} when a+b >= {mod}.",
}


def rename_hint(old: str, new: str) -> str:
  """The stale_tool hint: `Note: the tool sum was renamed to vadd.`"""
  return _HINTS["stale_tool"].format(old=old, new=new)


def hint_for(
  kind: str,
  env_info: dict,
  rules: FeedbackRules = FeedbackRules(),
  *,
  call: chat.ToolCall | chat.ParseError | None = None,
  variant: str = "task",
) -> str:
  """The hint text for a detection kind, e.g. `Reminder: available tools are add, mul, answer.`

  `call` (the flagged turn's call) fills stale_tool's `{old}`. variant "null": `NULL_NOTE` whatever
  the kind; "wrong": the same hint with wrong content, from `env_info["decoys"]` (current name ->
  a name the environment does not accept) -- the gate checks that content, not form, moves the teacher."""
  if variant not in HINT_VARIANTS:
    raise ValueError(f"unknown hint variant {variant!r}; known: {', '.join(HINT_VARIANTS)}")
  if variant == "null":
    return NULL_NOTE
  decoys = dict(env_info.get("decoys", ())) if variant == "wrong" else {}
  tools = [decoys.get(t, t) for t in env_info.get("tools", ())]
  old = getattr(call, "name", "")
  new = dict(env_info.get("renamed", ())).get(old, "")
  wrap, mod, safe = (env_info.get("wraps") or (("", 0, ""),))[0]
  text = dict(rules.hints).get(kind, _HINTS[kind])
  return text.format(
    tools=", ".join(tools), example=env_info.get("example", "name arg"), old=old, new=decoys.get(new, new),
    wrap=decoys.get(wrap, wrap), safe=decoys.get(safe, safe), mod=mod, top=mod - 1,
  )  # fmt: skip


def hint_at(
  traj: chat.Trajectory,
  k: int,
  kind: str,
  env_info: dict,
  rules: FeedbackRules = FeedbackRules(),
  *,
  variant: str = "task",
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> str:
  """`hint_for` the flagged turn k of `traj` (its call re-parsed from the tokens)."""
  call = chat.parse_tool_call(traj.turn_tokens(k), tok)
  return hint_for(kind, env_info, rules, call=call, variant=variant)


def hint_ids(text: str, tok: Tokenizer = chat.BYTE_TOKENIZER) -> list[int]:
  """The hint as a user message (<|user|> text <|end_turn|>), the same tokens the SFT demos use."""
  return chat.message_ids(chat.USER, text, tok)


ToolKey = tuple[str, tuple[str, ...]]


def _observation_after(traj: chat.Trajectory, k: int, tok: Tokenizer) -> str | None:
  if k + 1 < len(traj.spans) and traj.turn_roles[k + 1] == chat.TOOL:
    s, e = traj.spans[k + 1]
    return tok.decode(traj.tokens[s + 1 : e - 1])
  return None


def detect(
  traj: chat.Trajectory,
  env_info: dict,
  rules: FeedbackRules = FeedbackRules(),
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> list[tuple[int, str]]:
  """(turn index, kind) for every assistant turn that went wrong; at most one kind per turn, the first
  in `KINDS` order. Calls are re-parsed from the tokens, observations read from the following turn."""
  tools = tuple(env_info.get("tools", ()))
  renamed = dict(env_info.get("renamed", ()))
  wraps = {tool: mod for tool, mod, _ in env_info.get("wraps", ())}
  active = rules.kinds or tuple(env_info.get("feedback_kinds", ())) or DEFAULT_KINDS
  fail_re, ok_re = re.compile(rules.failure_pattern, re.I | re.M), re.compile(rules.success_pattern, re.I)
  failed_calls: set[ToolKey] = set()
  ran_tests = False
  found = []
  for k in traj.assistant_turns():
    ids = traj.turn_tokens(k)
    call = chat.parse_tool_call(ids, tok)
    prose = chat.prose_ids(ids, tok)
    obs = _observation_after(traj, k, tok)
    hits = []
    if isinstance(call, chat.ParseError):
      hits.append("no_call" if call.kind == "no_call" else "malformed_call")
    else:
      if renamed.get(call.name) in tools and call.name not in tools:
        hits.append("stale_tool")
      if tools and call.name not in tools:
        hits.append("unknown_tool")
      if call.name in wraps and _wraps(call, wraps[call.name]):
        hits.append("wrapping_call")
      if call.name == rules.write_tool and call.args and re.search(rules.test_path_pattern, call.args[0]):
        hits.append("edits_tests")
      if _key(call) in failed_calls:
        hits.append("repeated_failure")
      if call.name == rules.test_tool:
        ran_tests = True
    if rules.test_tool in tools and not ran_tests and ok_re.search(tok.decode(prose)):
      hits.append("claimed_success")
    if len(prose) > rules.max_prose_tokens:
      hits.append("over_long")
    if isinstance(call, chat.ToolCall) and obs is not None and fail_re.search(obs):
      failed_calls.add(_key(call))
    kinds = [h for h in KINDS if h in hits and h in active]
    if kinds:
      found.append((k, kinds[0]))
  return found


def _wraps(call: chat.ToolCall, modulus: int) -> bool:
  """Two integer arguments whose sum reaches the modulus (where the tool's result wraps)."""
  nums = [a for a in call.args if a.lstrip("-").isdigit() and len(a) <= 12]
  return len(call.args) == 2 and len(nums) == 2 and int(nums[0]) + int(nums[1]) >= modulus


def _key(call: chat.ToolCall) -> ToolKey:
  return call.name, call.args


@dataclasses.dataclass(frozen=True)
class TeacherInputs:
  """`tokens` = student prefix before turn k + hint + turn k's tokens (positions 0..len-1).

  `student_positions[i]` and `teacher_positions[i]` index the same sampled token of turn k (loss mask 1)
  in the student's and the teacher's sequence; `teacher_positions = student_positions + len(hint)`.
  The prefix is identical, so a live teacher can reuse the student's KV cache of `tokens[:hint_start]`.
  """

  tokens: np.ndarray  # [L] int32
  student_positions: np.ndarray  # [N] int32
  teacher_positions: np.ndarray  # [N] int32
  hint_start: int
  hint_end: int


def teacher_inputs(traj: chat.Trajectory, turn_k: int, hint: list[int]) -> TeacherInputs:
  """Hint inserted right before turn k's <|assistant|> header; only turn k's sampled tokens align."""
  s, e = traj.spans[turn_k]
  tokens = np.array([*traj.tokens[:s], *hint, *traj.tokens[s:e]], np.int32)
  student = np.array([p for p in range(s, e) if traj.loss_mask[p]], np.int32)
  return TeacherInputs(tokens, student, student + len(hint), s, s + len(hint))
