"""Toy multi-turn arithmetic through tools, learnable by a tiny byte-level model on CPU.

  user: Compute (3+4)*5
  assistant: <|tool_call|>add 3 4<|/tool_call|>     tool: 7
  assistant: <|tool_call|>mul 7 5<|/tool_call|>     tool: 35
  assistant: <|tool_call|>answer 35<|/tool_call|>   done, reward 1

Reward is exact: 1 for the right answer, else 0, minus `invalid_penalty` per invalid call. Problems are a
pure function of the seed. `demonstrations` makes the SFT warm-up corpus, including invalid calls followed
by the error observation and a hint, then a valid call, so the hinted teacher can beat the student.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat, feedback
from composer_jax.rl.envs import Step

TOOLS = ("add", "mul", "answer")
WRONG_TOOLS = ("sum", "plus", "times", "multiply", "calc", "add3")
_SYMBOL = {"add": "+", "mul": "*"}
_FN = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}


@dataclasses.dataclass(frozen=True)
class ToyConfig:
  min_ops: int = 1
  max_ops: int = 2
  max_operand: int = 9
  ops: tuple[str, ...] = ("add", "mul")
  max_turns: int = 6
  invalid_penalty: float = 0.0


@dataclasses.dataclass(frozen=True)
class Problem:
  text: str  # "Compute (3+4)*5"
  steps: tuple[tuple[str, int, int, int], ...]  # (op, a, b, result) in order
  target: int


def make_problem(seed: int, cfg: ToyConfig = ToyConfig()) -> Problem:
  """Left-nested expression ((a op b) op c) ...; each step's result feeds the next call."""
  rng = random.Random(seed)
  n = rng.randint(cfg.min_ops, cfg.max_ops)
  acc = rng.randint(0, cfg.max_operand)
  expr, top, steps = str(acc), None, []  # top: the loosest-binding operator at the expression's top level
  for _ in range(n):
    op, b = rng.choice(cfg.ops), rng.randint(0, cfg.max_operand)
    res = _FN[op](acc, b)
    if op == "mul" and top == "add":
      expr, top = f"({expr})*{b}", "mul"
    else:
      expr, top = f"{expr}{_SYMBOL[op]}{b}", "add" if "add" in (op, top) else "mul"
    steps.append((op, acc, b, res))
    acc = res
  return Problem(f"Compute {expr}", tuple(steps), acc)


class ArithmeticEpisode:
  """What the arithmetic environments share: a problem, the answer given, the invalid calls so far, and
  the reward (1 for the right answer, minus `cfg.invalid_penalty` per invalid call)."""

  def __init__(self, cfg: Any):
    self.cfg = cfg
    self.problem: Problem | None = None
    self.answered: int | None = None
    self.invalid = 0

  @property
  def max_turns(self) -> int:
    return self.cfg.max_turns

  def reward(self) -> float:
    correct = self.problem is not None and self.answered == self.problem.target
    return float(correct) - self.cfg.invalid_penalty * self.invalid


class ToyEnv(ArithmeticEpisode):
  def __init__(self, cfg: ToyConfig = ToyConfig()):
    super().__init__(cfg)

  def info(self) -> dict:
    return {"tools": TOOLS, "example": "add 3 4", "arity": (("add", 2), ("mul", 2), ("answer", 1))}

  def check(self, call: chat.ToolCall | chat.ParseError) -> str:
    """The error text for a call ("" if accepted); pure (the feedback gate asks it)."""
    obs = observe(call)[0]
    return obs if obs.startswith("Error") else ""

  def reset(self, seed: int) -> list[tuple[int, str]]:
    self.problem, self.answered, self.invalid = make_problem(seed, self.cfg), None, 0
    return [(chat.USER, self.problem.text)]

  def step(self, call: chat.ToolCall | chat.ParseError) -> Step:
    obs, done = observe(call)
    if obs.startswith("Error"):
      self.invalid += 1
      return Step(obs, False, ok=False)
    if done:
      self.answered = int(call.args[0])  # type: ignore[union-attr]
    return Step(obs, done)


def _int(s: str) -> int | None:
  return int(s) if s.lstrip("-").isdigit() and len(s) <= 12 else None


def observe(call: chat.ToolCall | chat.ParseError) -> tuple[str, bool]:
  """(observation, done) for one call; the exact error strings the model (and the demos) see."""
  tools = ", ".join(TOOLS)
  if isinstance(call, chat.ParseError):
    if call.kind == "no_call":
      return f"Error: no tool call. Available tools: {tools}.", False
    return f"Error: malformed tool call ({call.kind}). Call a tool like: add 3 4", False
  if call.name not in TOOLS:
    return f"Error: unknown tool '{call.name}'. Available tools: {tools}.", False
  want = 1 if call.name == "answer" else 2
  nums = [_int(a) for a in call.args]
  if len(nums) != want or any(x is None for x in nums):
    return f"Error: {call.name} takes {want} integer argument{'s' * (want > 1)}.", False
  if call.name == "answer":
    return "", True
  return str(_FN[call.name](*nums)), False


def add_demo_call(traj: chat.Trajectory, call: tuple[str, ...], result: str | None, tok: Tokenizer) -> None:
  """A demonstration's correct call (loss mask 1) and, unless it ends the episode, the tool's result."""
  traj.add_assistant_turn(chat.assistant_ids(call=call, tok=tok), None, tok)
  if result is not None:
    traj.add_message(chat.TOOL, result, tok)


def demonstrations(
  n: int,
  seed: int = 0,
  cfg: ToyConfig = ToyConfig(),
  *,
  mistake_fraction: float = 0.3,
  hint_fraction: float = 0.7,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> list[chat.Trajectory]:
  """SFT corpus: correct tool use, loss mask 1 on the assistant's tokens only.

  A `mistake_fraction` of demos make one invalid call (a wrong tool name, mask 0 so it is not taught)
  and see the exact error observation; of those, `hint_fraction` then get the hint message
  (`feedback.hint_for("unknown_tool", ...)`) before the valid call. Some clean demos also carry the hint
  right before a turn, the position the feedback teacher inserts it.
  """
  rng = random.Random(seed)
  hint = feedback.hint_for("unknown_tool", ToyEnv().info())
  out = []
  for _ in range(n):
    prob = make_problem(rng.randrange(1 << 30), cfg)
    traj = chat.Trajectory(info={"problem": prob.text, "hinted": False, "mistake": False})
    traj.add_message(chat.USER, prob.text, tok)
    calls = [(op, str(a), str(b)) for op, a, b, _ in prob.steps] + [("answer", str(prob.target))]
    results = [str(r) for *_, r in prob.steps] + [None]
    bad_at = rng.randrange(len(calls)) if rng.random() < mistake_fraction else -1
    clean_hint_at = rng.randrange(len(calls)) if bad_at < 0 and rng.random() < 0.15 else -1
    for j, (call, result) in enumerate(zip(calls, results, strict=True)):
      if j == bad_at:
        wrong = (rng.choice(WRONG_TOOLS), *call[1:])
        traj.add_prompt([chat.role_token_id(chat.ASSISTANT, tok)], chat.ASSISTANT)
        traj.add_prompt(chat.assistant_ids(call=wrong, tok=tok), chat.ASSISTANT, new_turn=False)
        traj.end_assistant_turn(tok)
        traj.add_message(chat.TOOL, observe(chat.ToolCall(wrong[0], wrong[1:]))[0], tok)
        traj.info["mistake"] = True
        if rng.random() < hint_fraction:
          traj.add_message(chat.USER, hint, tok)
          traj.info["hinted"] = True
      if j == clean_hint_at:
        traj.add_message(chat.USER, hint, tok)
        traj.info["hinted"] = True
      add_demo_call(traj, call, result, tok)
    traj.reward = 1.0
    out.append(traj)
  return out
