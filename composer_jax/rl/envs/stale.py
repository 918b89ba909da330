"""Stale tool docs: arithmetic through tools whose documentation may name a retired tool.

  user: Compute (3+4)*5. Tools: sum a b, times a b, answer x.
  assistant: <|tool_call|>sum 3 4<|/tool_call|>      tool: Error: unknown tool 'sum'.   (episode over: -0.25)
  with the hint "Note: the tool sum was renamed to vadd." before that turn, the call is vadd 3 4 -> 7 ...

The prompt documents one tool for `+` (first) and one for `*` (second), each under a name from a small
pool. The SFT warm-up teaches the model to call the tools by their documented names. In this
environment two names are retired by one rule shared by every episode (`RENAMED`: sum → vadd,
prod → vmul): a prompt that documents `sum` has stale docs, and the environment accepts only `vadd`.
The error names the failure ("unknown tool 'sum'") but not the fix, so a model that follows the docs
cannot recover; the detector's hint states the rule ("Note: the tool sum was renamed to vadd."). A
rule shared across episodes can be distilled into the policy; a per-episode secret could not.
The current names are outside the docs' pools, so RL alone cannot stumble on them: were they in the
pools (sum → add), sampling another documented name would find the rule by luck, and a comparison of
the arms would measure that luck. A wrong call costs `invalid_penalty`, and the episode ends at the
first one (`max_errors`): with retries the SFT model sometimes tries the current name after the error,
which RL alone then reinforces, and the hint carries nothing RL could not find. Without them the
student's first call is the only chance, and it names the documented tool.

`demonstrations` is the SFT corpus (docs-following calls; mistakes, errors, hints and recoveries;
hints that override the prompt; neutral notes, so that the null control is in distribution). On SFT
servers every pool name works as documented unless a hint says otherwise.
"""

from __future__ import annotations

import dataclasses
import random

from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat, feedback
from composer_jax.rl.envs import Step
from composer_jax.rl.envs.toy import ArithmeticEpisode, Problem, add_demo_call, make_problem

NAMES = {"add": ("add", "plus", "sum"), "mul": ("mul", "times", "prod")}  # per operation, SFT pools
# The shared rule of this environment: retired -> current. A current name is never documented (no pool
# has it): the SFT corpus shows it only after a hint or reminder that gives it.
RENAMED = (("sum", "vadd"), ("prod", "vmul"))
CURRENT = dict(RENAMED)  # retired name -> its current name
WRONG_NAMES = ("calc", "addn", "mult", "compute", "eval", "do")  # SFT: unknown-tool mistakes
FEEDBACK_KINDS = ("stale_tool", "unknown_tool")  # the detectors whose hints the SFT corpus teaches


def unknown_tool_error(name: str) -> str:
  """The server's reply to a call of a name it does not serve: the failure, not the fix."""
  return f"Error: unknown tool '{name}'."


@dataclasses.dataclass(frozen=True)
class StaleConfig:
  stale_rate: float = 0.3  # per tool: P(the docs name its retired name)
  min_ops: int = 1
  max_ops: int = 2
  max_operand: int = 9
  max_turns: int = 4
  invalid_penalty: float = 0.25
  max_errors: int = 1  # the episode ends at this many invalid calls (0: never)


def docs_text(names: dict[str, str], problem: Problem) -> str:
  """The problem first (at a fixed position, as in the toy env: the operands are copied from it), then the
  tool docs, whose names vary in length."""
  return f"{problem.text}. Tools: {names['add']} a b, {names['mul']} a b, answer x."


def arity(name: str) -> int:
  return 1 if name == "answer" else 2


def _int(s: str) -> int | None:
  return int(s) if s.lstrip("-").isdigit() and len(s) <= 12 else None


class StaleEnv(ArithmeticEpisode):
  """One problem per `reset(seed)`; the documented and accepted names are a pure function of the seed."""

  def __init__(self, cfg: StaleConfig = StaleConfig()):
    super().__init__(cfg)
    self.docs: dict[str, str] = {}  # op -> documented name
    self.accepts: dict[str, str] = {}  # accepted name -> op ("answer" -> "answer")

  def info(self) -> dict:
    """Accepted tools, the shared rename rule, the kinds to detect, and decoys (accepted name -> a pool
    name of the same operation that neither works nor is documented: the gate's wrong-content hint)."""
    decoys = tuple(
      (name, next(n for n in NAMES[op] if n not in (name, self.docs[op])))
      for name, op in self.accepts.items()
      if op in NAMES
    )
    return {
      "tools": tuple(self.accepts) or ("add", "mul", "answer"),
      "example": f"{next(iter(self.accepts), 'add')} 3 4",
      "renamed": RENAMED,
      "feedback_kinds": FEEDBACK_KINDS,
      "decoys": decoys,
      "arity": tuple((name, arity(name)) for name in self.accepts),
    }

  def reset(self, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    self.problem = make_problem(rng.randrange(1 << 30), _toy_cfg(self.cfg))
    self.docs = {}
    for op, pool in NAMES.items():
      live = [n for n in pool if n not in CURRENT]
      stale = [n for n in pool if n in CURRENT]
      self.docs[op] = rng.choice(stale) if rng.random() < self.cfg.stale_rate else rng.choice(live)
    self.accepts = {CURRENT.get(n, n): op for op, n in self.docs.items()} | {"answer": "answer"}
    self.answered, self.invalid = None, 0
    return [(chat.USER, docs_text(self.docs, self.problem))]

  def stale_ops(self) -> tuple[str, ...]:
    """The operations this episode's problem needs whose documented name is retired."""
    needed = {op for op, *_ in self.problem.steps} if self.problem else set()
    return tuple(op for op in NAMES if op in needed and self.docs.get(op) in CURRENT)

  def check(self, call: chat.ToolCall | chat.ParseError) -> str:
    """The error text for a call ("" if the environment accepts it); pure, so the gate can ask."""
    if isinstance(call, chat.ParseError):
      return "Error: no tool call." if call.kind == "no_call" else "Error: malformed tool call."
    if call.name not in self.accepts:
      return unknown_tool_error(call.name)
    nums = [_int(a) for a in call.args]
    n = arity(call.name)
    if len(nums) != n or any(x is None for x in nums):
      return f"Error: {call.name} takes {n} integer argument{'s' * (n > 1)}."
    return ""

  def step(self, call: chat.ToolCall | chat.ParseError) -> Step:
    err = self.check(call)
    if err:
      self.invalid += 1
      return Step(err, self.invalid == self.cfg.max_errors, ok=False)
    nums = [int(a) for a in call.args]  # type: ignore[union-attr]
    op = self.accepts[call.name]  # type: ignore[union-attr]
    if op == "answer":
      self.answered = nums[0]
      return Step("", True)
    return Step(str(nums[0] + nums[1] if op == "add" else nums[0] * nums[1]), False)


def _toy_cfg(cfg: StaleConfig):
  from composer_jax.rl.envs import toy

  return toy.ToyConfig(min_ops=cfg.min_ops, max_ops=cfg.max_ops, max_operand=cfg.max_operand)


# ---- SFT corpus ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DemoMix:
  """Shares of the SFT corpus (the rest: plain docs-following demos)."""

  stale_mistake: float = 0.15  # retired name -> error -> stale_tool hint -> current name
  unknown_mistake: float = 0.1  # wrong name -> error -> (unknown_tool hint, or not) -> documented name
  override: float = 0.2  # a rename hint before the turn: the hint overrides the prompt
  # The neutral note before a turn, then the documented call: as common as the rename hints that override
  # the prompt, so a message before a turn is no sign by itself to leave the docs (gate G2).
  null_note: float = 0.25
  # The server renamed a documented tool and the unknown_tool reminder lists the current names, after a
  # wrong-name mistake. Without these demos the reminder always equals the docs, and the frozen teacher,
  # reminded of the current names, still calls the documented one. They come only after a mistake: a
  # reminder before a turn with no mistake teaches that any message before a stale-docs turn means
  # "depart from the docs", which the null note must not (gate G2).
  renamed_reminder: float = 0.1
  # Of those: share where the other documented tool is retired too, so the reminder lists both current
  # names (the environment's reminder on an episode whose docs are stale for both tools).
  both_renamed: float = 0.3
  unknown_hint: float = 0.7  # of unknown-tool mistakes: share followed by the hint
  # Of wrong names: share drawn from the call's pool (an undocumented name), else from WRONG_NAMES.
  pool_mistake: float = 0.5
  # Of unknown-tool mistakes without the hint: share followed by the neutral note. The note then also
  # follows errors, where what comes next is what comes without it, so it predicts nothing there either
  # (without these demos a message after an error always meant a hint, and a checkpoint could read a
  # correction into the neutral note: gate G2 failed, null 0.160 vs student 0.023 valid).
  unknown_null: float = 0.5


def _calls(problem: Problem, names: dict[str, str]) -> list[tuple[str, ...]]:
  steps = [(names[op], str(a), str(b)) for op, a, b, _ in problem.steps]
  return steps + [("answer", str(problem.target))]


def _results(problem: Problem) -> list[str | None]:
  return [str(r) for *_, r in problem.steps] + [None]


def _mistake(traj: chat.Trajectory, call: tuple[str, ...], error: str, tok: Tokenizer) -> None:
  """A wrong call the model is shown but not taught (loss mask 0), then the environment's error."""
  traj.add_prompt([chat.role_token_id(chat.ASSISTANT, tok)], chat.ASSISTANT)
  traj.add_prompt(chat.assistant_ids(call=call, tok=tok), chat.ASSISTANT, new_turn=False)
  traj.end_assistant_turn(tok)
  traj.add_message(chat.TOOL, error, tok)


def _wrong_name(
  rng: random.Random, call: tuple[str, ...], docs: dict[str, str], names: dict[str, str], mix: DemoMix
) -> str:
  """A name the (SFT) server rejects for this call: an undocumented name from the call's pool (the
  confusion a docs-following model makes), or one of WRONG_NAMES."""
  op = next((o for o in NAMES if names[o] == call[0]), None)
  # Not the current name of a retired documented one either: that call is right in `StaleEnv`.
  taken = (docs.get(op), names.get(op), CURRENT.get(docs.get(op, "")))
  pool = [x for x in NAMES.get(op, ()) if x not in taken]
  return rng.choice(pool) if pool and rng.random() < mix.pool_mistake else rng.choice(WRONG_NAMES)


def demonstrations(
  n: int,
  seed: int = 0,
  cfg: StaleConfig = StaleConfig(),
  mix: DemoMix = DemoMix(),
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> list[chat.Trajectory]:
  """SFT corpus on SFT servers (every pool name works as documented unless a hint renames it).

  info["kind"]: plain | stale_mistake | unknown_mistake | override | null_note | renamed_reminder.
  Every hint text the detectors of `StaleEnv` can emit (`feedback.hint_for` of FEEDBACK_KINDS) occurs
  in the corpus, and a taught call only ever uses a documented name or one a hint in context gave.
  """
  rng = random.Random(seed)
  kinds = ("stale_mistake", "unknown_mistake", "override", "null_note", "renamed_reminder")
  out = []
  for _ in range(n):
    problem = make_problem(rng.randrange(1 << 30), _toy_cfg(cfg))
    docs = {op: rng.choice(pool) for op, pool in NAMES.items()}
    ops = [op for op, *_ in problem.steps]
    u = rng.random()
    kind = "plain"
    for name in kinds:
      u -= getattr(mix, name)
      if u < 0:
        kind = name
        break
    # The turn the event happens at: the first use of an operation (a renamed tool before it would be a
    # call that contradicts the docs without a hint).
    op = rng.choice(ops)
    first_use = kind in ("stale_mistake", "override", "renamed_reminder")
    j = ops.index(op) if first_use else rng.randrange(len(ops) + 1)
    names = dict(docs)
    if kind in ("stale_mistake", "renamed_reminder"):
      old = rng.choice([o for o, _ in RENAMED if o in NAMES[op]])
      docs[op], names[op] = old, CURRENT[old]
    if kind == "renamed_reminder" and rng.random() < mix.both_renamed:
      other = next(o for o in NAMES if o != op)  # renamed too, if no call uses it before the reminder
      if other not in ops[:j]:
        old = rng.choice([o for o, _ in RENAMED if o in NAMES[other]])
        docs[other], names[other] = old, CURRENT[old]
    elif kind == "override":
      old = docs[op]
      names[op] = (
        CURRENT[old]
        if old in CURRENT and rng.random() < 0.5
        else rng.choice([x for x in NAMES[op] if x != old])
      )
    calls, results = _calls(problem, names), _results(problem)
    info = {"tools": (names["add"], names["mul"], "answer"), "renamed": RENAMED}
    reminder = feedback.hint_for("unknown_tool", info)
    traj = chat.Trajectory(info={"problem": problem.text, "kind": kind, "docs": dict(docs)})
    traj.add_message(chat.USER, docs_text(docs, problem), tok)
    for i, (call, result) in enumerate(zip(calls, results, strict=True)):
      if i == j and kind == "stale_mistake":
        _mistake(traj, (docs[op], *call[1:]), unknown_tool_error(docs[op]), tok)
        traj.add_message(chat.USER, feedback.rename_hint(docs[op], names[op]), tok)
      elif i == j and kind == "unknown_mistake":
        wrong = _wrong_name(rng, call, docs, names, mix)
        _mistake(traj, (wrong, *call[1:]), unknown_tool_error(wrong), tok)
        if rng.random() < mix.unknown_hint:
          traj.add_message(chat.USER, reminder, tok)
        elif rng.random() < mix.unknown_null:
          traj.add_message(chat.USER, feedback.NULL_NOTE, tok)
      elif i == j and kind == "renamed_reminder":
        wrong = _wrong_name(rng, call, docs, names, mix)
        _mistake(traj, (wrong, *call[1:]), unknown_tool_error(wrong), tok)
        traj.add_message(chat.USER, reminder, tok)
      elif i == j and kind == "override":
        traj.add_message(chat.USER, feedback.rename_hint(docs[op], names[op]), tok)
      elif i == j and kind == "null_note":
        traj.add_message(chat.USER, feedback.NULL_NOTE, tok)
      add_demo_call(traj, call, result, tok)
    traj.reward = 1.0
    out.append(traj)
  return out
