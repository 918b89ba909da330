"""Ledger-K: enter K sums through `add` or a documented fast add `fadd`, which on the RL server silently
wraps above 99. One terminal, binary reward over about K/2 risky decisions.

  user: Ledger 34 67, 12 45, 80 35. Tools: add a b, fadd a b (fast add), done.
  assistant: <|tool_call|>fadd 34 67<|/tool_call|>   tool: next 12 45    (RL: entry 1 is 1, wrapped)
  assistant: <|tool_call|>add 12 45<|/tool_call|>    tool: next 80 35
  assistant: <|tool_call|>add 80 35<|/tool_call|>    tool: ledger full
  assistant: <|tool_call|>done<|/tool_call|>         reward 0: entry 1 is wrong

Modes (`LedgerEnv(cfg, mode)`): "sft" (the SFT server: fadd is correct), "silent" (RL, arms alone,
penalty, feedback, distill, and every evaluation: fadd wraps mod 100 when a+b >= 100, nothing says so),
"informative" (RL, arm informative: such a call records nothing, the rule comes back as the tool's
reply with the pair to redo, the entry can be redone, and each such call costs `redo_cost`).

The server names the next pair in each reply, so after the first turn the operands are copied from the
last message: the tiny model's difficulty is the add/fadd choice, not retrieval from a long prompt. Pairs
are risky (tens digits summing to >= 10, so a+b >= 100) or safe (tens digits summing to <= 8, so
a+b <= 98): no pair sits at the boundary. The SFT corpus (`demonstrations`) picks add or fadd 50/50 per
pair, so the fix is sampled about half the time, and uses add on risky pairs only once the rule is in
context.
"""

from __future__ import annotations

import dataclasses
import random

from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat, feedback
from composer_jax.rl.batch import bucket
from composer_jax.rl.envs import Step
from composer_jax.rl.envs.toy import add_demo_call

TOOLS = ("add", "fadd", "done")
MODULUS = 100
MODES = ("sft", "silent", "informative")
INFO = {
  "tools": TOOLS,
  "example": "add 12 34",
  "wraps": (("fadd", MODULUS, "add"),),
  "feedback_kinds": ("wrapping_call",),
  "decoys": (("fadd", "add"), ("add", "fadd")),  # the gate's wrong-content hint swaps the two
  "arity": (("add", 2), ("fadd", 2), ("done", 0)),
}
RULE = feedback.hint_for("wrapping_call", INFO)  # "fadd wraps above 99; use add when a+b >= 100."
FULL = "ledger full"


@dataclasses.dataclass(frozen=True)
class LedgerConfig:
  k: int = 3
  risky_share: float = 0.5
  redo_cost: float = 0.25
  max_turns: int = 7
  rule_in_prompt: bool = False  # the reference policy: the SFT model told the rule (never trained)


Pair = tuple[int, int]


def is_risky(a: int, b: int) -> bool:
  return a + b >= MODULUS


def make_pairs(rng: random.Random, k: int, risky_share: float) -> tuple[Pair, ...]:
  """K two-digit pairs, each risky with probability `risky_share`; risky iff the tens digits sum to ≥ 10."""
  out = []
  for _ in range(k):
    risky = rng.random() < risky_share
    tens = [(x, y) for x in range(1, 10) for y in range(1, 10) if (x + y >= 10 if risky else x + y <= 8)]
    ta, tb = rng.choice(tens)
    out.append((10 * ta + rng.randrange(10), 10 * tb + rng.randrange(10)))
  return tuple(out)


def pairs_of(seed: int, cfg: LedgerConfig) -> tuple[Pair, ...]:
  return make_pairs(random.Random(seed), cfg.k, cfg.risky_share)


def prompt(pairs: tuple[Pair, ...], rule: bool = False) -> str:
  """The task; `rule` appends the rule (the SFT corpus and the reference policy, never RL)."""
  text = f"Ledger {', '.join(f'{a} {b}' for a, b in pairs)}. Tools: add a b, fadd a b (fast add), done."
  return f"{text} {RULE}" if rule else text


def reply(pairs: tuple[Pair, ...], entered: int) -> str:
  """The server's reply once `entered` entries are recorded: the next pair, or that the ledger is full."""
  return f"next {pairs[entered][0]} {pairs[entered][1]}" if entered < len(pairs) else FULL


def _int(s: str) -> int | None:
  return int(s) if s.lstrip("-").isdigit() and len(s) <= 12 else None


def call_error(call: chat.ToolCall | chat.ParseError, mode: str = "informative") -> str:
  """The server's error for a call ("" if it is executed); pure, so the gate can ask. In informative
  mode a wrapping fadd is refused with the rule."""
  tools = ", ".join(TOOLS)
  if isinstance(call, chat.ParseError):
    if call.kind == "no_call":
      return f"Error: no tool call. Available tools: {tools}."
    return "Error: malformed tool call. Call a tool like: add 12 34"
  if call.name not in TOOLS:
    return f"Error: unknown tool. Tools: {tools}."  # no echo of the name: replies stay short
  want = dict(INFO["arity"])[call.name]
  nums = [_int(a) for a in call.args]
  if len(nums) != want or any(x is None for x in nums):
    return f"Error: {call.name} takes {want} integer argument{'s' * (want != 1)}."
  if mode == "informative" and call.name == "fadd" and is_risky(*nums):
    return RULE
  return ""


def right_calls(call: chat.ToolCall | chat.ParseError) -> tuple[str, ...] | None:
  """The right calls on the operands of `call`, an add or fadd of two integers, as call texts: `add a b`,
  and `fadd a b` unless it wraps (the gate's decision-token oracle: a wrapping fadd is well-formed, and its
  mistake is the tool's first byte). None for any other call (only its syntax can be judged)."""
  if isinstance(call, chat.ParseError) or call.name not in ("add", "fadd") or len(call.args) != 2:
    return None
  nums = [_int(a) for a in call.args]
  if any(x is None for x in nums):
    return None
  operands = " ".join(call.args)
  return (f"add {operands}",) + ((f"fadd {operands}",) if not is_risky(*nums) else ())  # type: ignore[arg-type]


class LedgerEnv:
  """One episode per `reset(seed)`: the pairs are a pure function of the seed (and `cfg.k`)."""

  def __init__(self, cfg: LedgerConfig = LedgerConfig(), mode: str = "silent"):
    if mode not in MODES:
      raise ValueError(f"unknown ledger mode {mode!r}; known: {', '.join(MODES)}")
    self.cfg, self.mode = cfg, mode
    self.pairs: tuple[Pair, ...] = ()
    self.ledger: list[int] = []
    self.first: dict[int, str] = {}  # entry -> the tool of its first add/fadd call
    self.done, self.invalid, self.redos = False, 0, 0

  @property
  def max_turns(self) -> int:
    return self.cfg.max_turns

  def info(self) -> dict:
    return dict(INFO)

  def reset(self, seed: int) -> list[tuple[int, str]]:
    self.pairs = pairs_of(seed, self.cfg)
    self.ledger, self.first = [], {}
    self.done, self.invalid, self.redos = False, 0, 0
    return [(chat.USER, prompt(self.pairs, self.cfg.rule_in_prompt))]

  def check(self, call: chat.ToolCall | chat.ParseError) -> str:
    """The informative server's error for this call, "" when it executes it (pure: the gate asks)."""
    return call_error(call, "informative")

  def right_calls(self, call: chat.ToolCall | chat.ParseError) -> tuple[str, ...] | None:
    """`right_calls` (pure: the gate asks)."""
    return right_calls(call)

  def step(self, call: chat.ToolCall | chat.ParseError) -> Step:
    err = call_error(call, self.mode)
    if err == RULE:  # the pair to redo comes with the rule, as every reply names the pair to enter
      self.first.setdefault(len(self.ledger), "fadd")
      self.redos += 1
      return Step(f"{RULE} {reply(self.pairs, len(self.ledger))}", False, ok=False)
    if err:
      self.invalid += 1
      return Step(err, False, ok=False)
    if call.name == "done":  # type: ignore[union-attr]
      self.done = True
      return Step("", True)
    i = len(self.ledger)
    if i >= len(self.pairs):
      self.invalid += 1
      return Step("Error: the ledger is full; call done.", False, ok=False)
    a, b = (int(x) for x in call.args)  # type: ignore[union-attr]
    self.first.setdefault(i, call.name)  # type: ignore[union-attr]
    wraps = self.mode != "sft" and call.name == "fadd" and is_risky(a, b)  # type: ignore[union-attr]
    self.ledger.append((a + b) % MODULUS if wraps else a + b)
    return Step(reply(self.pairs, i + 1), False)

  def correct(self) -> bool:
    return self.done and self.ledger == [a + b for a, b in self.pairs]

  def reward(self) -> float:
    """1 when `done` was called with every entry right (informative: minus redo_cost per refused call)."""
    return float(self.correct()) - self.cfg.redo_cost * self.redos

  def metrics(self) -> dict[str, tuple[float, float]]:
    """(sum, count) per measure: risky_first_fadd = M1's risky pairs whose first add/fadd call was fadd
    (of the risky pairs attempted), safe_accuracy = safe entries recorded right (of those attempted),
    attempted = entries with an add/fadd call (of K), all_correct = M2."""
    risky = [i for i in self.first if is_risky(*self.pairs[i])]
    safe = [i for i in self.first if not is_risky(*self.pairs[i])]
    right = [i < len(self.ledger) and self.ledger[i] == sum(self.pairs[i]) for i in safe]
    return {
      "risky_first_fadd": (float(sum(self.first[i] == "fadd" for i in risky)), float(len(risky))),
      "safe_accuracy": (float(sum(right)), float(len(safe))),
      "attempted": (float(len(self.first)), float(len(self.pairs))),
      "all_correct": (float(self.correct()), 1.0),
    }


def budget(k: int, tok: Tokenizer, max_turn_tokens: int) -> tuple[int, int]:
  """(max_turns, cache_len) that hold a whole episode in the KV-cache engine, whatever the arm: K entries,
  `done`, and 2 + K // 2 more turns (redos, invalid calls). The engine appends each turn's new context
  padded to a power of two ≥ 16 plus `max_turn_tokens` sampled slots; every later turn is costed at the
  longest reply (the rule, or an error)."""
  turns = k + 1 + 2 + k // 2
  first = len(chat.message_ids(chat.USER, prompt(((99, 99),) * k, rule=True), tok)) + 1
  errors = [call_error(chat.ParseError(kind)) for kind in ("no_call", "malformed")]
  replies = [f"{RULE} {reply(((99, 99),), 0)}", FULL, call_error(chat.ToolCall("x")), *errors]
  longest = max(len(chat.message_ids(chat.TOOL, r, tok)) for r in replies) + 2  # + <|end_turn|>, header
  return turns, bucket(first, 16) + max_turn_tokens + (turns - 1) * (bucket(longest, 16) + max_turn_tokens)


# ---- SFT corpus ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DemoMix:
  """Shares of the SFT corpus (the rest: plain demos). Once the rule is in context every later risky pair
  uses add; without it each pair is add or fadd 50/50, so the corpus never teaches the rule unhinted."""

  hint_before: float = 0.2  # the rule as a user message right before a risky turn (where the teacher has it)
  informative: float = 0.15  # a risky fadd (shown, not taught), the rule as the reply, the redo with add
  rule_in_prompt: float = 0.1  # the rule at the end of the prompt (the reference policy's context)
  null_note: float = 0.1  # the neutral note before a turn, choices unchanged (the null arm in distribution)


KINDS = ("hint_before", "informative", "rule_in_prompt", "null_note")


def _shown(traj: chat.Trajectory, call: tuple[str, ...], tok: Tokenizer) -> None:
  """An assistant call the model is shown but not taught (loss mask 0)."""
  traj.add_prompt([chat.role_token_id(chat.ASSISTANT, tok)], chat.ASSISTANT)
  traj.add_prompt(chat.assistant_ids(call=call, tok=tok), chat.ASSISTANT, new_turn=False)
  traj.end_assistant_turn(tok)


def _kind(rng: random.Random, mix: DemoMix) -> str:
  u = rng.random()
  for name in KINDS:
    u -= getattr(mix, name)
    if u < 0:
      return name
  return "plain"


def demonstrations(
  n: int,
  seed: int = 0,
  max_k: int = 12,
  risky_share: float = 0.5,
  mix: DemoMix = DemoMix(),
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> list[chat.Trajectory]:
  """SFT corpus on the SFT server (fadd correct), K drawn from 1..max_k. info["kind"]: plain | KINDS."""
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    pairs = make_pairs(rng, rng.randint(1, max_k), risky_share)
    risky = [i for i, p in enumerate(pairs) if is_risky(*p)]
    kind = _kind(rng, mix)
    if kind in ("hint_before", "informative") and not risky:
      kind = "plain"
    at = rng.choice(risky) if kind in ("hint_before", "informative") else rng.randrange(len(pairs))
    knows = kind == "rule_in_prompt"
    traj = chat.Trajectory(info={"kind": kind, "pairs": pairs})
    traj.add_message(chat.USER, prompt(pairs, rule=knows), tok)
    for i, (a, b) in enumerate(pairs):
      if i == at and kind == "hint_before":
        traj.add_message(chat.USER, RULE, tok)
        knows = True
      elif i == at and kind == "informative":
        _shown(traj, ("fadd", str(a), str(b)), tok)
        traj.add_message(chat.TOOL, f"{RULE} {reply(pairs, i)}", tok)
        knows = True
      elif i == at and kind == "null_note":
        traj.add_message(chat.USER, feedback.NULL_NOTE, tok)
      tool = "add" if knows and is_risky(a, b) else rng.choice(("add", "fadd"))
      add_demo_call(traj, (tool, str(a), str(b)), reply(pairs, i + 1), tok)
    add_demo_call(traj, ("done",), None, tok)
    traj.reward = 1.0
    out.append(traj)
  return out
