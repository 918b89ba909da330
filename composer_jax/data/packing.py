"""Packed rows of documents with one document stream per row of the global batch, so that a host packs
only the rows its devices hold and the global batch does not depend on how many hosts there are.

Shape suffixes: B rows of the global batch, R rows this host packs, T time.

Row r of a global batch of B rows reads documents r, r + B, r + 2B, ... of the (shuffled) document order;
indices past the source's length are later epochs (`corpus.documents`). Each document is tokenized with
an EOS appended and poured into the row; a document that does not fit the rest of the row continues at
the start of the row in the next batch, unless the piece left in this row would be shorter than
`min_fragment`: then the row's end is padded instead (padding only at row ends, segment id 0). Segment
ids count 1, 2, ... per piece within a row and positions restart at 0 per piece, so attention (same
segment, causal by position) never crosses documents.

A row's whole future is set by two numbers, its next document's index and the token offset in it. The
checkpointed state holds both for every row of the global batch, -1 for the rows this host does not
pack; `global_state` fills them in from every host before a save, so a checkpoint restores onto any
number of hosts, each taking its own rows from it:

  {"version": 2, "index": [B ints], "offset": [B ints]}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np
from absl import logging

STATE_VERSION = 2
UNKNOWN = -1  # a row this host does not pack: another host's state has it


def pack_row(
  doc: Callable[[int], np.ndarray],
  index: int,
  offset: int,
  *,
  stride: int,
  end: int | None,
  seq_len: int,
  min_fragment: int,
  pad_id: int,
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int, int]:
  """One row's next T columns from `doc(index)[offset:]` on, then documents index + stride, ... (none at
  or past `end`). Returns ((tokens_T, segment_ids_T, positions_T), index, offset) after the row."""
  T = seq_len
  tokens_T = np.full(T, pad_id, np.int32)
  segment_ids_T = np.zeros(T, np.int32)
  positions_T = np.zeros(T, np.int32)
  col, seg = 0, 0
  while col < T and (end is None or index < end):
    tokens = doc(index)
    remaining = len(tokens) - offset
    n = min(remaining, T - col)
    if n < remaining and n < min_fragment and col > 0:
      break  # a tiny fragment is not worth splitting the document for: pad the row's end
    seg += 1
    tokens_T[col : col + n] = tokens[offset : offset + n]
    segment_ids_T[col : col + n] = seg
    positions_T[col : col + n] = np.arange(n, dtype=np.int32)
    col += n
    offset += n
    if offset == len(tokens):
      index, offset = index + stride, 0
  return (tokens_T, segment_ids_T, positions_T), index, offset


def fresh_state(batch_size: int) -> dict[str, Any]:
  """Every row at the start of its stream: row r's first document is r."""
  return {"version": STATE_VERSION, "index": list(range(batch_size)), "offset": [0] * batch_size}


def upgraded(state: dict[str, Any], batch_size: int) -> dict[str, Any]:
  """`state` in the current format. The single-stream format of older checkpoints ({index, offset}: one
  stream poured into the rows in order) continues from where it stopped: row r from document index + r,
  row 0 at the saved offset, so no document is repeated or skipped (the batches differ from that
  stream's, which no longer exists). A newer version than this code reads raises ValueError."""
  version = state.get("version")
  if version == STATE_VERSION:
    if len(state["index"]) != batch_size or len(state["offset"]) != batch_size:
      raise ValueError(f"the data state has {len(state['index'])} rows, the batch has {batch_size}")
    return state
  if version is None and set(state) == {"index", "offset"}:
    index, offset = int(state["index"]), int(state["offset"])
    logging.warning(
      "[data] the checkpoint's data state is the single-stream format {index %d, offset %d}: the %d row "
      "streams continue from document %d (row 0 at its offset), no document repeated or skipped",
      index, offset, batch_size, index,
    )  # fmt: skip
    return {
      "version": STATE_VERSION,
      "index": [index + r for r in range(batch_size)],
      "offset": [offset] + [0] * (batch_size - 1),
    }
  raise ValueError(f"a data state this code cannot read (version {version!r}, keys {sorted(state)})")


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """One state of every row from hosts' states (each knows its own rows; -1 elsewhere). A row that two
  hosts pack (split over time) must agree; a row no host knows raises."""
  index_HB = np.array([s["index"] for s in states], np.int64)
  offset_HB = np.array([s["offset"] for s in states], np.int64)
  known_HB = index_HB != UNKNOWN
  missing = np.flatnonzero(~known_HB.any(axis=0))
  if missing.size:
    raise ValueError(f"no host has the data state of rows {missing.tolist()}")
  index_B, offset_B = index_HB.max(axis=0), offset_HB.max(axis=0)
  if ((index_HB != index_B) & known_HB).any() or ((offset_HB != offset_B) & known_HB).any():
    raise ValueError("hosts that pack the same row disagree on its data state")
  return {"version": STATE_VERSION, "index": index_B.tolist(), "offset": offset_B.tolist()}


def global_state(state: dict[str, Any]) -> dict[str, Any]:
  """This host's state with every other host's rows filled in (an all-gather: every process calls it at
  the same point, e.g. before a save); on one process `state` itself."""
  import jax

  if jax.process_count() == 1:
    return state
  from jax.experimental import multihost_utils

  both_2B = np.array([state["index"], state["offset"]], np.int64)
  # As int32 pairs: jax gathers 32-bit integers unless x64 is on, and document indices may exceed them.
  gathered = multihost_utils.process_allgather(both_2B.view(np.int32))
  hosts = np.asarray(gathered).astype(np.int32).view(np.int64)
  return merge_states([{"index": h[0].tolist(), "offset": h[1].tolist()} for h in hosts])


class RowPacker(grain.DatasetIterator):
  """Packed batches {tokens, segment_ids, positions} [R, T] int32 of `rows` (global row ids, sorted; all
  B rows by default) of a global batch of `batch_size` rows; see the module docstring.

  Ends (StopIteration) when every one of its rows has run out of documents (`num_epochs` set); rows
  that ran out earlier are padding. `padding()` is one more such batch, for a host whose rows ran out
  before another host's did (`train.pretrain.fixed_batches`).
  """

  def __init__(
    self,
    docs: Any,
    tokenize: Callable[[str], list[int]],
    *,
    batch_size: int,
    seq_len: int,
    pad_id: int,
    rows: Sequence[int] | None = None,
    num_epochs: int | None = None,
    min_fragment: int | None = None,
  ):
    super().__init__()
    self._docs, self._tokenize = docs, tokenize
    self._B, self._T, self._pad_id = batch_size, seq_len, pad_id
    self.rows = np.arange(batch_size) if rows is None else np.unique(np.asarray(rows, np.int64))
    if self.rows.size == 0 or self.rows[0] < 0 or self.rows[-1] >= batch_size:
      raise ValueError(f"rows {self.rows.tolist()} are not a non-empty subset of 0..{batch_size - 1}")
    self._end = None if num_epochs is None else num_epochs * len(docs)
    self._min_fragment = max(1, seq_len // 8) if min_fragment is None else min_fragment
    self._index_R, self._offset_R = self.rows.copy(), np.zeros(self.rows.size, np.int64)
    self._cached: dict[int, tuple[int, np.ndarray]] = {}  # local row -> (document index, its tokens)

  def get_state(self) -> dict[str, Any]:
    index_B, offset_B = np.full(self._B, UNKNOWN, np.int64), np.full(self._B, UNKNOWN, np.int64)
    index_B[self.rows], offset_B[self.rows] = self._index_R, self._offset_R
    return {"version": STATE_VERSION, "index": index_B.tolist(), "offset": offset_B.tolist()}

  def set_state(self, state: dict[str, Any]) -> None:
    state = upgraded(state, self._B)
    index_R = np.asarray(state["index"], np.int64)[self.rows]
    if (index_R == UNKNOWN).any():
      raise ValueError(
        f"the data state lacks rows {self.rows[index_R == UNKNOWN].tolist()}: one host's state, not "
        "every host's (`packing.global_state`)"
      )
    self._index_R, self._offset_R = index_R, np.asarray(state["offset"], np.int64)[self.rows]
    self._cached = {}

  def _exhausted(self) -> bool:
    return self._end is not None and bool((self._index_R >= self._end).all())

  def _doc(self, row: int, index: int) -> np.ndarray:
    cached = self._cached.get(row)
    if cached is None or cached[0] != index:
      cached = self._cached[row] = (index, np.asarray(self._tokenize(self._docs[index]), np.int32))
    return cached[1]

  def __next__(self) -> dict[str, np.ndarray]:
    if self._exhausted():
      raise StopIteration
    out = []
    for i in range(self.rows.size):
      row, self._index_R[i], self._offset_R[i] = pack_row(
        lambda index, i=i: self._doc(i, index), int(self._index_R[i]), int(self._offset_R[i]),
        stride=self._B, end=self._end, seq_len=self._T, min_fragment=self._min_fragment,
        pad_id=self._pad_id,
      )  # fmt: skip
      out.append(row)
    tokens_RT, segment_ids_RT, positions_RT = (np.stack(x) for x in zip(*out, strict=True))
    return {"tokens": tokens_RT, "segment_ids": segment_ids_RT, "positions": positions_RT}

  def padding(self) -> dict[str, np.ndarray]:
    shape = (self.rows.size, self._T)
    zeros = np.zeros(shape, np.int32)
    return {"tokens": np.full(shape, self._pad_id, np.int32), "segment_ids": zeros, "positions": zeros}


class PackedRows(grain.IterDataset):
  """`RowPacker` as a grain IterDataset, so grain's prefetch and checkpointing compose with it."""

  def __init__(self, docs: Any, tokenize: Callable[[str], list[int]], **kwargs: Any):
    super().__init__(docs)
    self._docs, self._tokenize, self._kwargs = docs, tokenize, kwargs

  def __iter__(self) -> RowPacker:
    return RowPacker(self._docs, self._tokenize, **self._kwargs)
