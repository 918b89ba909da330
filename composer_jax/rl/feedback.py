"""Targeted text feedback, host side: find assistant turns that went wrong, a hint for each, and the
teacher's input with the hint inserted right before that turn (notes/rl.md §5).

  found = detect(traj, env.info(), FeedbackRules())          # [(turn k, kind), ...]
  hint = hint_ids(hint_for(kind, env.info()))                # a <|user|> message, token ids
  t = teacher_inputs(traj, k, hint)                          # teacher = prefix + hint + turn k
  # student logits at t.student_positions  <->  teacher logits at t.teacher_positions, token by token

Kinds: unknown_tool, malformed_call, no_call, repeated_failure, claimed_success, over_long.
The hints restate what is already in context (tool names, the call syntax, "run the tests"), so they
carry no privileged information about the answer. The loss itself is `rl.feedback_loss` (divergence.py).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat

KINDS = ("unknown_tool", "malformed_call", "no_call", "repeated_failure", "claimed_success", "over_long")


@dataclasses.dataclass(frozen=True)
class FeedbackRules:
  kinds: tuple[str, ...] = (
    "unknown_tool",
    "malformed_call",
    "repeated_failure",
    "claimed_success",
    "over_long",
  )
  max_prose_tokens: int = 200  # over_long: more explanation than this in one turn
  success_pattern: str = r"\b(done|fixed|solved|all tests pass(ed|ing)?|tests (now )?pass)\b"
  failure_pattern: str = r"^Error\b|\b\d+ (failed|errors?)\b"  # an observation that reports a failure
  test_tool: str = "run_tests"  # claimed_success only applies to envs with this tool
  hints: tuple[tuple[str, str], ...] = ()  # (kind, text) overrides; "{tools}" and "{example}" filled in


_HINTS = {
  "unknown_tool": "Reminder: available tools are {tools}.",
  "malformed_call": "Reminder: call a tool as its name then arguments, e.g. {example}. Tools: {tools}.",
  "no_call": "Reminder: answer with a tool call. Available tools are {tools}.",
  "repeated_failure": "Reminder: that exact call already failed; change it or use another tool.",
  "claimed_success": "Reminder: run the tests with run_tests before saying the task is done.",
  "over_long": "Reminder: keep explanations short and act with a tool call.",
}


def hint_for(kind: str, env_info: dict, rules: FeedbackRules = FeedbackRules()) -> str:
  """The hint text for a detection kind, e.g. `Reminder: available tools are add, mul, answer.`"""
  text = dict(rules.hints).get(kind, _HINTS[kind])
  tools = ", ".join(env_info.get("tools", ()))
  return text.format(tools=tools, example=env_info.get("example", "name arg"))


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
      if tools and call.name not in tools:
        hits.append("unknown_tool")
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
    kinds = [h for h in KINDS if h in hits and h in rules.kinds]
    if kinds:
      found.append((k, kinds[0]))
  return found


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
