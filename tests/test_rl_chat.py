"""Turn format: the tool-call parser never raises, calls round-trip, masks and padded batches are exact."""

import random

import numpy as np
import pytest

from composer_jax.rl import chat

TOK = chat.BYTE_TOKENIZER
OPEN, CLOSE = TOK.special_id("<|tool_call|>"), TOK.special_id("<|/tool_call|>")
END = TOK.special_id("<|end_turn|>")


def _random_sequences(n, seed=0):
  rng = random.Random(seed)
  for i in range(n):
    length = rng.randint(0, 40)
    mode = i % 4
    if mode == 0:  # anything in the vocabulary
      ids = [rng.randrange(TOK.vocab_size) for _ in range(length)]
    elif mode == 1:  # random bytes inside a well-delimited call: bad UTF-8, odd names, whitespace
      ids = [OPEN] + [rng.randrange(256) for _ in range(length)] + [CLOSE]
    elif mode == 2:  # calls with specials sprinkled in, truncated or nested
      ids = [OPEN] + [
        rng.choice([rng.randrange(256), rng.randrange(256, TOK.vocab_size)]) for _ in range(length)
      ]
    else:  # out-of-range and negative ids, non-ints
      ids = [rng.choice([-1, TOK.vocab_size, 10**9, OPEN, CLOSE, 97, 32]) for _ in range(length)]
    yield ids


def test_parser_never_raises_on_random_ids():
  kinds = set()
  for ids in _random_sequences(4000):
    out = chat.parse_tool_call(ids)
    assert isinstance(out, (chat.ToolCall, chat.ParseError))
    kinds.add(type(out).__name__ if isinstance(out, chat.ToolCall) else out.kind)
  # The fuzz reaches every branch, including a few accidental valid calls.
  assert {"no_call", "truncated", "nested_special", "bad_utf8", "bad_id", "malformed"} <= kinds, kinds
  assert chat.parse_tool_call(["x", None]).kind == "bad_id"
  assert chat.parse_tool_call(np.array([OPEN, 97, CLOSE])) == chat.ToolCall("a")


@pytest.mark.parametrize(
  "call",
  [
    ("add", "3", "4"),
    ("answer", "-35"),
    ("submit",),
    ("write_file", "pkg/mod.py", "def f(x):\n  return x  # ünïcode\n"),
    ("write_file", "empty.py", ""),
    ("run_tests", "tests/test_a.py", "-k", "slug"),
  ],
)
def test_call_round_trip(call):
  ids = chat.format_tool_call(*call)
  assert ids[0] == OPEN and ids[-1] == CLOSE and all(i < 256 for i in ids[1:-1])
  assert chat.parse_tool_call(ids) == chat.ToolCall(call[0], call[1:])
  # Prose before the call is allowed; text after the closing token is ignored.
  assert chat.parse_tool_call(TOK.encode("I will add.\n") + ids + TOK.encode("junk")) == chat.ToolCall(
    call[0], call[1:]
  )


def test_malformed_calls():
  def parse(text, close=True):
    return chat.parse_tool_call([OPEN, *TOK.encode(text)] + ([CLOSE] if close else []))

  assert parse("add 3 4", close=False).kind == "truncated"
  assert parse("add  3").kind == "malformed" and parse("3add 1").kind == "malformed"
  assert parse("").kind == "malformed" and parse("add 3 ").kind == "malformed"
  assert chat.parse_tool_call([OPEN, 97, OPEN, 98, CLOSE]).kind == "nested_special"
  assert chat.parse_tool_call([OPEN, 0xFF, 0xFE, CLOSE]).kind == "bad_utf8"
  assert chat.parse_tool_call(TOK.encode("just prose") + [END]).kind == "no_call"
  assert chat.parse_tool_call(TOK.encode("add 3 4") + [CLOSE]).kind == "malformed"
  with pytest.raises(ValueError):
    chat.format_tool_call("add", "3 4", "5")


def _traj():
  t = chat.Trajectory()
  t.add_message(chat.SYSTEM, "sys")
  t.add_message(chat.USER, "Compute 1+2")
  first, second = chat.assistant_ids("ok ", ("add", "1", "2")), chat.assistant_ids(call=("answer", "3"))
  t.add_assistant_turn(first, [-0.5] * len(first))
  t.add_message(chat.TOOL, "3")
  t.add_assistant_turn(second, [-0.25] * len(second))
  return t


def test_trajectory_mask_logprobs_and_spans():
  t = _traj()
  n = len(t)
  assert len(t.turn_ids) == len(t.roles) == len(t.loss_mask) == len(t.logprobs) == n
  assert t.turn_roles == [chat.SYSTEM, chat.USER, chat.ASSISTANT, chat.TOOL, chat.ASSISTANT]
  assert t.spans[0][0] == 0 and t.spans[-1][1] == n
  assert all(a[1] == b[0] for a, b in zip(t.spans, t.spans[1:], strict=False))  # contiguous turns
  sampled = chat.assistant_ids("ok ", ("add", "1", "2")) + chat.assistant_ids(call=("answer", "3"))
  # Mask is 1 exactly on the sampled tokens: not on headers, the appended <|end_turn|>, prompts, results.
  assert [tok for tok, m in zip(t.tokens, t.loss_mask, strict=True) if m] == sampled
  for k, (s, e) in enumerate(t.spans):
    assert set(t.turn_ids[s:e]) == {k} and set(t.roles[s:e]) == {t.turn_roles[k]}
  assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
  assert sorted({lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m}) == [-0.5, -0.25]
  s, e = t.spans[2]
  assert t.tokens[s] == TOK.special_id("<|assistant|>") and t.tokens[e - 1] == END and not t.loss_mask[e - 1]
  t.add_message(chat.USER, "x")
  with pytest.raises(ValueError):
    t.add_sampled([1, 2])  # only into an open assistant turn


def test_sampled_end_turn_not_duplicated():
  t = chat.Trajectory()
  t.add_message(chat.USER, "hi")
  t.add_assistant_turn(chat.assistant_ids("hello"))  # the model sampled <|end_turn|> itself
  assert t.tokens[-1] == END and t.tokens[-2] != END and t.loss_mask[-1] == 1


def test_to_arrays():
  t1, t2 = _traj(), chat.Trajectory()
  t2.add_message(chat.USER, "x")
  t1.reward = 1.0
  b = chat.to_arrays([t1, t2], pad_to=len(t1) + 3)
  assert {k: v.shape for k, v in b.items() if k != "rewards"} == {
    k: (2, len(t1) + 3)
    for k in ("tokens", "positions", "segment_ids", "loss_mask", "sampler_logprobs", "turn_ids", "roles")
  }
  n = len(t1)
  np.testing.assert_array_equal(b["tokens"][0, :n], t1.tokens)
  np.testing.assert_array_equal(b["positions"][0, :n], np.arange(n))
  assert (b["tokens"][0, n:] == TOK.pad_id).all() and (b["segment_ids"][0, n:] == 0).all()
  assert (b["turn_ids"][1, len(t2) :] == -1).all() and b["loss_mask"][1].sum() == 0
  np.testing.assert_array_equal(b["sampler_logprobs"][0, :n], np.float32(t1.logprobs))
  np.testing.assert_array_equal(b["rewards"], [1.0, 0.0])
  with pytest.raises(ValueError):
    chat.to_arrays([t1], pad_to=n - 1)
