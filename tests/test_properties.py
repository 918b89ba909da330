"""Properties of the host-side code on generated inputs (hypothesis): the packer's rows, the tool-call
parser, the feedback detectors and the RL batch's bucketing. Each holds for every input, not only for the
hand-picked cases of the other tests; examples are few and small, so the module runs in seconds."""

import chex
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from composer_jax.data import packing
from composer_jax.rl import batch as rl_batch
from composer_jax.rl import chat, feedback

TOK = chat.BYTE_TOKENIZER
OPEN, CLOSE = TOK.special_id("<|tool_call|>"), TOK.special_id("<|/tool_call|>")
# deadline off: a loaded 2-core machine stalls; no example database: nothing written into the checkout.
FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
PAD = -5  # a pad id no document token equals


# --- packing -------------------------------------------------------------------------------------

documents = st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=50), min_size=1, max_size=12)


@st.composite
def packings(draw):
  docs = draw(documents)
  batch_size = draw(st.integers(1, 4))
  seq_len = draw(st.integers(2, 24))
  min_fragment = draw(st.integers(1, seq_len))
  rows = draw(st.lists(st.integers(0, batch_size - 1), min_size=1, max_size=batch_size, unique=True))
  return docs, dict(batch_size=batch_size, seq_len=seq_len, min_fragment=min_fragment), sorted(rows)


def _pack(docs, kwargs, rows=None) -> list[dict]:
  """Every batch of one epoch (the packer ends when each of its rows has run out)."""
  packer = packing.RowPacker(docs, list, pad_id=PAD, rows=rows, num_epochs=1, **kwargs)
  return list(packer)


@FAST
@given(packings())
def test_each_row_is_its_documents_in_order_cut_only_where_the_row_ends(case):
  """Row r holds documents r, r + B, ... exactly once each, in order; segment ids count 1, 2, ... with
  padding only at the end; positions restart at 0 per piece; padding shorter than min_fragment unless the
  row's documents have run out; a document is cut short of its end only by the row's end, and then (unless
  it is the row's first piece) no shorter than min_fragment."""
  docs, kw, _ = case
  B, T = kw["batch_size"], kw["seq_len"]
  batches = _pack(docs, kw)
  for r in range(B):
    want = [t for d in docs[r::B] for t in d]
    ends = set(np.cumsum([len(d) for d in docs[r::B]]).tolist())
    got: list[int] = []
    for batch in batches:
      tokens, seg, pos = (batch[k][r] for k in ("tokens", "segment_ids", "positions"))
      n = int((seg > 0).sum())
      assert (seg[n:] == 0).all() and (tokens[n:] == PAD).all()
      assert list(seg[:n]) == sorted(seg[:n]) and (n == 0 or seg[0] == 1)
      assert set(np.diff(seg[:n]).tolist()) <= {0, 1}
      for s in range(1, int(seg.max(initial=0)) + 1):
        np.testing.assert_array_equal(pos[seg == s], np.arange(int((seg == s).sum())))
        if len(got) + int(np.flatnonzero(seg == s)[-1]) + 1 not in ends:  # piece s stops inside a document
          assert s == seg.max() and n == T and (s == 1 or (seg == s).sum() >= kw["min_fragment"])
      got += tokens[:n].tolist()
      if len(got) < len(want):
        assert T - n < kw["min_fragment"], (T - n, kw)
    assert got == want


@FAST
@given(packings())
def test_a_host_packing_some_rows_gets_those_rows_of_the_whole_batch(case):
  docs, kw, rows = case
  whole, mine = _pack(docs, kw), _pack(docs, kw, rows)
  assert len(mine) <= len(whole)
  chex.assert_trees_all_equal(mine, [{k: v[rows] for k, v in b.items()} for b in whole[: len(mine)]])
  for batch in whole[len(mine) :]:  # after this host's rows ran out, the whole batch pads them
    assert (batch["segment_ids"][rows] == 0).all()


@FAST
@given(packings(), st.integers(0, 5))
def test_resuming_from_any_batch_continues_with_the_same_batches(case, k):
  docs, kw, rows = case
  packer = packing.RowPacker(docs, list, pad_id=PAD, rows=rows, num_epochs=1, **kw)
  first = [b for _, b in zip(range(k), packer, strict=False)]
  state = packer.get_state()
  rest = list(packer)
  again = packing.RowPacker(docs, list, pad_id=PAD, rows=rows, num_epochs=1, **kw)
  again.set_state(state)
  assert len(first) <= k
  chex.assert_trees_all_equal(list(again), rest)


@FAST
@given(st.integers(1, 8), st.integers(1, 4), st.data())
def test_merging_the_hosts_states_gives_the_whole_state(batch_size, hosts, data):
  index = data.draw(st.lists(st.integers(0, 10**12), min_size=batch_size, max_size=batch_size))
  offset = data.draw(st.lists(st.integers(0, 10**6), min_size=batch_size, max_size=batch_size))
  owner = data.draw(st.lists(st.integers(0, hosts - 1), min_size=batch_size, max_size=batch_size))
  states = [
    {
      "index": [i if o == h else packing.UNKNOWN for i, o in zip(index, owner, strict=True)],
      "offset": [f if o == h else packing.UNKNOWN for f, o in zip(offset, owner, strict=True)],
    }
    for h in range(hosts)
  ]
  assert packing.merge_states(states) == {"version": packing.STATE_VERSION, "index": index, "offset": offset}


# --- the tool-call parser ------------------------------------------------------------------------

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
words = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8).filter(
  lambda s: not any(c.isspace() for c in s)
)
bodies = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@FAST
@given(names, st.lists(words, max_size=4), st.none() | bodies, st.text(max_size=20))
def test_a_formatted_call_parses_back_after_any_prose(name, args, body, prose):
  call = (name, *args) + (() if body is None else (body,))
  ids = chat.format_tool_call(*call)
  assert chat.parse_tool_call(ids) == chat.ToolCall(name, tuple(call[1:]))
  assert chat.parse_tool_call(TOK.encode(prose) + ids) == chat.ToolCall(name, tuple(call[1:]))


@FAST
@given(
  st.lists(
    st.integers(-3, TOK.vocab_size + 3) | st.sampled_from([OPEN, CLOSE, ord(" "), ord("a")]), max_size=40
  )
)
def test_the_parser_never_raises_and_a_call_it_returns_formats_back(ids):
  out = chat.parse_tool_call(ids)
  assert isinstance(out, chat.ToolCall | chat.ParseError)
  if isinstance(out, chat.ToolCall):
    assert chat.parse_tool_call(chat.format_tool_call(out.name, *out.args)) == out


# --- feedback detectors --------------------------------------------------------------------------

TOOLS = ("add", "mul", "answer", "run_tests", "write_file")
ENV = {"tools": TOOLS, "renamed": (("sum", "add"),), "feedback_kinds": feedback.KINDS}

assistant_turns = st.tuples(
  st.sampled_from(["", "ok", "done", "all tests pass", "x" * 210]),
  st.none()
  | st.tuples(
    st.sampled_from(TOOLS + ("sum", "nope")), st.sampled_from(["3", "tests/test_a.py", "pkg/m.py"])
  ),
)
tool_results = st.sampled_from(["7", "Error: unknown tool 'sum'.", "2 failed", "ok"])
episodes = st.lists(st.tuples(assistant_turns, st.none() | tool_results), min_size=1, max_size=6)


def _trajectory(turns) -> chat.Trajectory:
  t = chat.Trajectory()
  t.add_message(chat.USER, "Compute 3+4")
  for (prose, call), result in turns:
    t.add_assistant_turn(chat.assistant_ids(prose, call))
    if result is not None:
      t.add_message(chat.TOOL, result)
  return t


@FAST
@given(episodes, st.integers(1, 6))
def test_detections_are_one_kind_per_assistant_turn_and_causal(turns, cut):
  """At most one (the first in KINDS order) kind per assistant turn, in turn order; and a turn's verdict
  depends only on the turns up to its observation: cutting the episode later changes no earlier one."""
  traj = _trajectory(turns)
  found = feedback.detect(traj, ENV)
  flagged = [k for k, _ in found]
  assert flagged == sorted(set(flagged)) and set(flagged) <= set(traj.assistant_turns())
  assert all(kind in feedback.KINDS for _, kind in found)
  short = _trajectory(turns[:cut])
  last = len(short.spans) - 1
  assert [f for f in found if f[0] < last] == [f for f in feedback.detect(short, ENV) if f[0] < last]


@FAST
@given(episodes, st.text(max_size=40))
def test_the_teacher_sees_the_students_tokens_after_the_hint(turns, hint_text):
  traj = _trajectory(turns)
  for k in traj.assistant_turns():
    hint = feedback.hint_ids(hint_text)
    t = feedback.teacher_inputs(traj, k, hint)
    s, e = traj.spans[k]
    assert t.tokens[: t.hint_start].tolist() == traj.tokens[:s]
    assert t.tokens[t.hint_start : t.hint_end].tolist() == hint
    np.testing.assert_array_equal(t.tokens[t.teacher_positions], np.asarray(traj.tokens)[t.student_positions])
    assert t.student_positions.tolist() == [p for p in range(s, e) if traj.loss_mask[p]]


# --- bucketing -----------------------------------------------------------------------------------


@FAST
@given(st.integers(0, 10**6), st.sampled_from([1, 16, 64, 256]))
def test_a_bucket_is_the_smallest_power_of_two_that_holds_n(n, minimum):
  b = rl_batch.bucket(n, minimum)
  assert b >= max(n, minimum) and b & (b - 1) == 0
  assert b == minimum or b // 2 < n


@FAST
@given(st.lists(episodes, min_size=1, max_size=4), st.sampled_from([16, 64]))
def test_an_rl_batch_holds_each_trajectory_and_pads_to_its_bucket(many, min_len):
  trajs = [_trajectory(t) for t in many]
  infos = [ENV] * len(trajs)
  batch = rl_batch.rl_batch(trajs, list(range(len(trajs))), infos, with_feedback=True, min_len=min_len)
  B, T = batch.tokens.shape
  assert (B, T) == (len(trajs), rl_batch.bucket(max(map(len, trajs)), min_len))
  for b, t in enumerate(trajs):
    assert batch.tokens[b, : len(t)].tolist() == t.tokens and (batch.segment_ids[b, len(t) :] == 0).all()
  fb = batch.feedback
  flagged = sum(bool(feedback.detect(t, ENV)) for t in trajs)
  assert (
    fb.fb_rows.shape[0] == rl_batch.bucket(flagged, 16) and int((fb.teacher_lengths > 0).sum()) == flagged
  )
  L = fb.teacher_tokens.shape[1]
  assert L >= 64 and L & (L - 1) == 0
