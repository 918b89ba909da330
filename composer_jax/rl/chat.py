"""The turn format on token ids, the tool-call syntax and its never-raising parser, and `Trajectory`.

Token ids are the truth (re-templating text changes tokens and breaks PPO ratios), so
turns are built by concatenating `tok.encode(text)` with special ids, never by re-tokenising a string:

  message      <|system|> / <|user|> text <|end_turn|>
  assistant    <|assistant|> [prose] [<|tool_call|> CALL <|/tool_call|>] <|end_turn|>
  tool result  <|tool_result|> text <|/tool_result|>

Tool-call syntax (CALL, UTF-8 bytes between the call tokens), chosen so a byte-level tiny model learns
it from a few hundred demonstrations -- no quoting, no JSON braces to balance:

  add 3 4                              name, then space-separated arguments on one line
  write_file pkg/mod.py\n<body>        after the first newline, everything (spaces, newlines) is one
                                       final argument: the body

`format_tool_call` writes the one-line form unless the last argument has whitespace or is empty.
`parse_tool_call` never raises: random ids, truncated calls, nested specials and bad UTF-8 come back as
a `ParseError` that the environment turns into an observation (the rollout stays on-policy).

In an assistant turn the header <|assistant|> and the closing <|end_turn|> appended after a sampled
<|/tool_call|> are format tokens (loss mask 0); everything the sampler produced has mask 1.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

import numpy as np

from composer_jax.data.tokenizer import SPECIAL_TOKENS, ByteTokenizer, Tokenizer

SYSTEM, USER, ASSISTANT, TOOL = 0, 1, 2, 3
ROLE_NAMES = ("system", "user", "assistant", "tool")
_ROLE_TOKEN = {SYSTEM: "<|system|>", USER: "<|user|>", ASSISTANT: "<|assistant|>", TOOL: "<|tool_result|>"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
BYTE_TOKENIZER = ByteTokenizer()

COMPLETED, TRUNCATED, FAILED = "completed", "truncated", "failed"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ParseError:
  """kind: no_call | truncated | nested_special | bad_utf8 | bad_id | malformed."""

  kind: str
  detail: str = ""


# The special tokens the turn format is built from (a checkpoint's tokenizer must have each as one id).
CHAT_TOKENS = tuple(t for t in SPECIAL_TOKENS if t not in ("<|pad|>", "<|bos|>", "<|eos|>"))


@functools.cache
def tokenizer(name: str = "byte") -> Tokenizer:
  """The tokenizer `data.tokenizer` names ("byte", "bpe", a tokenizers json, or a checkpoint directory with
  a `tokenizer.json`), which must have every token of `CHAT_TOKENS` (ValueError naming those it lacks)."""
  if name == "byte":
    return BYTE_TOKENIZER
  from composer_jax.data import tokenizer as tokenizers

  tok = tokenizers.load(name)
  missing = tok.missing(CHAT_TOKENS) if hasattr(tok, "missing") else []
  if missing:
    raise ValueError(
      f"the tokenizer of {name} has no {', '.join(missing)} token: the sft/gate/rl turn format needs each "
      "as a token of its own (add them to its tokenizer.json as added special tokens)"
    )
  return tok


def _sid(tok: Tokenizer, name: str) -> int:
  return tok.special_id(name)


def stop_ids(tok: Tokenizer = BYTE_TOKENIZER) -> tuple[int, ...]:
  """Sampler stop tokens for an assistant turn: end of call, end of turn, end of sequence."""
  return (_sid(tok, "<|/tool_call|>"), _sid(tok, "<|end_turn|>"), tok.eos_id)


def role_token_id(role: int, tok: Tokenizer = BYTE_TOKENIZER) -> int:
  return _sid(tok, _ROLE_TOKEN[role])


def message_ids(role: int, text: str, tok: Tokenizer = BYTE_TOKENIZER) -> list[int]:
  """<|role|> text <|end_turn|> for system/user; <|tool_result|> text <|/tool_result|> for tool."""
  if role == TOOL:
    return [_sid(tok, "<|tool_result|>"), *tok.encode(text), _sid(tok, "<|/tool_result|>")]
  return [role_token_id(role, tok), *tok.encode(text), _sid(tok, "<|end_turn|>")]


def format_tool_call(name: str, *args: str, tok: Tokenizer = BYTE_TOKENIZER) -> list[int]:
  """<|tool_call|> CALL <|/tool_call|>; raises ValueError on a call the syntax cannot express."""
  if not _NAME.fullmatch(name):
    raise ValueError(f"bad tool name {name!r}")
  for a in args[:-1]:
    if not a or any(c.isspace() for c in a):
      raise ValueError(f"only the last argument may be empty or contain whitespace: {a!r}")
  head = " ".join([name, *args[:-1]])
  if args and (not args[-1] or any(c.isspace() for c in args[-1])):
    text = f"{head}\n{args[-1]}"
  else:
    text = " ".join([name, *args])
  return [_sid(tok, "<|tool_call|>"), *tok.encode(text), _sid(tok, "<|/tool_call|>")]


def assistant_ids(
  prose: str = "", call: tuple[str, ...] | None = None, tok: Tokenizer = BYTE_TOKENIZER
) -> list[int]:
  """What a model would sample for one assistant turn (no header): prose, then the call or <|end_turn|>."""
  ids = tok.encode(prose)
  if call is not None:
    return ids + format_tool_call(*call, tok=tok)
  return ids + [_sid(tok, "<|end_turn|>")]


def _decode_strict(ids: Sequence[int], tok: Tokenizer) -> str | ParseError:
  if isinstance(tok, ByteTokenizer):
    if any(not 0 <= i < 256 for i in ids):
      return ParseError("bad_id", "id out of byte range")
    try:
      return bytes(ids).decode("utf-8")
    except UnicodeDecodeError as e:
      return ParseError("bad_utf8", str(e)[:80])
  try:
    text = tok.decode(list(ids))
  except Exception as e:  # noqa: BLE001 -- a foreign tokenizer's decode must not escape the parser
    return ParseError("bad_id", f"{type(e).__name__}")
  return ParseError("bad_utf8", "replacement character") if "\ufffd" in text else text


def parse_tool_call(token_ids: Sequence[int], tok: Tokenizer = BYTE_TOKENIZER) -> ToolCall | ParseError:
  """The first tool call in an assistant turn's ids (prose before it is allowed). Never raises."""
  try:
    ids = [int(i) for i in token_ids]
  except Exception:  # noqa: BLE001
    return ParseError("bad_id", "ids are not integers")
  vocab = getattr(tok, "vocab_size", None)
  if vocab is not None and any(not 0 <= i < vocab for i in ids):
    return ParseError("bad_id", "id outside the vocabulary")
  open_id, close_id = _sid(tok, "<|tool_call|>"), _sid(tok, "<|/tool_call|>")
  if open_id not in ids:
    if close_id in ids:
      return ParseError("malformed", "closing call token without opening")
    return ParseError("no_call", "no tool call")
  start = ids.index(open_id) + 1
  inner = []
  for i in ids[start:]:
    if i == close_id:
      break
    if tok.is_special(i):  # type: ignore[attr-defined]
      name = tok.decode([i])
      return ParseError("nested_special", f"{name} inside a tool call")
    inner.append(i)
  else:
    return ParseError("truncated", "tool call not closed")
  text = _decode_strict(inner, tok)
  if isinstance(text, ParseError):
    return text
  head, nl, body = text.partition("\n")
  words = head.split(" ")
  name, args = words[0], words[1:]
  if not _NAME.fullmatch(name):
    return ParseError("malformed", f"bad tool name {name[:32]!r}")
  if any(not a or any(c.isspace() for c in a) for a in args):
    return ParseError("malformed", "empty argument or stray whitespace")
  return ToolCall(name, tuple(args) + ((body,) if nl else ()))


def prose_ids(token_ids: Sequence[int], tok: Tokenizer = BYTE_TOKENIZER) -> list[int]:
  """The non-special tokens of a turn outside any tool call (the explanation the model wrote)."""
  open_id, close_id = _sid(tok, "<|tool_call|>"), _sid(tok, "<|/tool_call|>")
  out, inside = [], False
  for i in token_ids:
    i = int(i)
    if i == open_id:
      inside = True
    elif i == close_id:
      inside = False
    elif not inside and not tok.is_special(i):  # type: ignore[attr-defined]
      out.append(i)
  return out


@dataclasses.dataclass
class Trajectory:
  """One rollout as token ids with per-token turn index, role, loss mask and sampler logprobs.

  A turn is one message (prompt, assistant turn, tool result, hint); `spans[k] = (start, end)` and
  `turn_roles[k]` describe turn k. `status` is completed / truncated / failed with `reason`.
  """

  tokens: list[int] = dataclasses.field(default_factory=list)
  turn_ids: list[int] = dataclasses.field(default_factory=list)
  roles: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  turn_roles: list[int] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  status: str = COMPLETED
  reason: str = ""
  info: dict = dataclasses.field(default_factory=dict)
  # Routing replay (rl.rollout.collect with routing_replay): the sampler's experts per token,
  # [len(tokens), MoE layers, top_k] int, -1 where unknown; None when not recorded.
  routed_experts: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

  def __len__(self) -> int:
    return len(self.tokens)

  def _append(self, ids, role, mask, logprobs, new_turn):
    ids = [int(i) for i in ids]
    if new_turn or not self.spans:
      self.spans.append((len(self.tokens), len(self.tokens)))
      self.turn_roles.append(role)
    k = len(self.spans) - 1
    self.tokens += ids
    self.turn_ids += [k] * len(ids)
    self.roles += [role] * len(ids)
    self.loss_mask += [mask] * len(ids)
    self.logprobs += [float(x) for x in logprobs] if mask else [0.0] * len(ids)
    self.spans[k] = (self.spans[k][0], len(self.tokens))

  def add_prompt(self, ids: Sequence[int], role: int, *, new_turn: bool = True) -> None:
    """Prompt / observation / format tokens: loss mask 0, logprob 0."""
    self._append(ids, role, 0, (), new_turn)

  def add_message(self, role: int, text: str, tok: Tokenizer = BYTE_TOKENIZER) -> None:
    self.add_prompt(message_ids(role, text, tok), role)

  def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
    """Model-sampled tokens, appended to the current (assistant) turn: loss mask 1."""
    if not self.spans or self.turn_roles[-1] != ASSISTANT:
      raise ValueError("add_sampled needs an open assistant turn (call start_assistant_turn first)")
    logprobs = [0.0] * len(ids) if logprobs is None else logprobs
    if len(logprobs) != len(ids):
      raise ValueError(f"{len(ids)} ids but {len(logprobs)} logprobs")
    self._append(ids, ASSISTANT, 1, logprobs, False)

  def start_assistant_turn(self, tok: Tokenizer = BYTE_TOKENIZER) -> None:
    self.add_prompt([role_token_id(ASSISTANT, tok)], ASSISTANT)

  def end_assistant_turn(self, tok: Tokenizer = BYTE_TOKENIZER) -> None:
    """Close the turn with <|end_turn|> (mask 0) unless the model itself sampled <|end_turn|>/<|eos|>."""
    if self.tokens and self.tokens[-1] in (_sid(tok, "<|end_turn|>"), tok.eos_id):
      return
    self.add_prompt([_sid(tok, "<|end_turn|>")], ASSISTANT, new_turn=False)

  def add_assistant_turn(
    self, ids: Sequence[int], logprobs: Sequence[float] | None = None, tok: Tokenizer = BYTE_TOKENIZER
  ) -> int:
    """Header + sampled ids + closing token; returns the turn index."""
    self.start_assistant_turn(tok)
    self.add_sampled(ids, logprobs)
    self.end_assistant_turn(tok)
    return len(self.spans) - 1

  def turn_tokens(self, k: int) -> list[int]:
    s, e = self.spans[k]
    return self.tokens[s:e]

  def sampled_tokens(self, k: int) -> list[int]:
    s, e = self.spans[k]
    return [t for t, m in zip(self.tokens[s:e], self.loss_mask[s:e], strict=True) if m]

  def assistant_turns(self) -> list[int]:
    return [k for k, r in enumerate(self.turn_roles) if r == ASSISTANT]

  def fail(self, reason: str) -> None:
    self.status, self.reason, self.reward = FAILED, reason, 0.0


def to_arrays(trajs: Sequence[Trajectory], pad_to: int, pad_id: int | None = None) -> dict[str, np.ndarray]:
  """One trajectory per row, right-padded to `pad_to` (ValueError if one is longer).

  Returns tokens, positions, segment_ids (1 real, 0 pad), loss_mask (float32), sampler_logprobs
  (float32, 0 where mask 0), turn_ids (-1 on pad), roles (-1 on pad), rewards [B].
  """
  pad_id = BYTE_TOKENIZER.pad_id if pad_id is None else pad_id
  b = len(trajs)
  out = {
    "tokens": np.full((b, pad_to), pad_id, np.int32),
    "positions": np.zeros((b, pad_to), np.int32),
    "segment_ids": np.zeros((b, pad_to), np.int32),
    "loss_mask": np.zeros((b, pad_to), np.float32),
    "sampler_logprobs": np.zeros((b, pad_to), np.float32),
    "turn_ids": np.full((b, pad_to), -1, np.int32),
    "roles": np.full((b, pad_to), -1, np.int32),
    "rewards": np.array([t.reward for t in trajs], np.float32),
  }
  for i, t in enumerate(trajs):
    n = len(t)
    if n > pad_to:
      raise ValueError(f"trajectory {i} has {n} tokens > pad_to {pad_to}")
    out["tokens"][i, :n] = t.tokens
    out["positions"][i, :n] = np.arange(n)
    out["segment_ids"][i, :n] = 1
    out["loss_mask"][i, :n] = t.loss_mask
    out["sampler_logprobs"][i, :n] = t.logprobs
    out["turn_ids"][i, :n] = t.turn_ids
    out["roles"][i, :n] = t.roles
  return out
