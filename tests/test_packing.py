"""Per-row packing and prefetch: each row of the global batch is its own document stream, so hosts that
pack only their rows assemble the one-host batch bit for bit, restore from a checkpoint of any host
count, and tokenize only their rows' documents; a prefetching worker changes no batch and no state."""

import gc
import json
import logging
import threading
import time
import traceback

import chex
import jax
import numpy as np
import pytest

from composer_jax import checks, configs, sharding
from composer_jax.data import corpus, packing, tokenizer
from composer_jax.data.prefetch import Prefetch
from composer_jax.train import batch as batch_lib

B, T = 8, 32
KEYS = ("tokens", "segment_ids", "positions")


@pytest.fixture(scope="module")
def source():
  """17 documents of 3..~200 bytes, each naming its own index."""
  rng = np.random.default_rng(0)
  return [{"text": f"#{i}:{'ab' * int(rng.integers(1, 100))}".encode()} for i in range(17)]


def _batches(source, rows=None, prefetch=0, **kw):
  args = dict(batch_size=B, seq_len=T, seed=1) | kw
  return corpus.batches(source, tokenizer.ByteTokenizer(), rows=rows, prefetch=prefetch, **args)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _equal(a, b):
  chex.assert_trees_all_equal(a, b)


def test_each_row_is_the_stream_of_documents_r_r_plus_b_and_so_on(source):
  """The pieces of row r over 12 batches (past an epoch) are a prefix of documents r, r + B, r + 2B, ...
  of the shuffled order with EOS after each: built here from `documents` alone, not from the packer."""
  byte = tokenizer.ByteTokenizer()
  docs = corpus.documents(source, seed=1)
  got = _take(_batches(source), 12)
  for r in range(B):
    pieces = []
    for batch in got:
      seg_T = batch["segment_ids"][r]
      n = int((seg_T > 0).sum())
      assert (seg_T[n:] == 0).all() and T - n < T // 8  # padding only at the end, under min_fragment
      for s in range(1, int(seg_T.max(initial=0)) + 1):
        (idx,) = np.nonzero(seg_T == s)
        assert (batch["positions"][r][idx] == np.arange(idx.size)).all()
        pieces.append(batch["tokens"][r][idx])
    stream = np.concatenate(pieces)
    reference = np.concatenate([byte.encode(docs[i]) + [byte.eos_id] for i in range(r, r + 40 * B, B)])
    np.testing.assert_array_equal(stream, reference[: stream.size])
    assert stream.size > 6 * T  # several documents, into the second epoch for most rows


def _host_rows(meshes, hosts):
  """The rows each of `hosts` hosts packs, the devices split in id order as jax numbers processes'."""
  devices = sorted(meshes.devices, key=lambda d: d.id)
  per = len(devices) // hosts
  return [batch_lib.rows_held((B, T), meshes, devices[h * per : (h + 1) * per]).ids for h in range(hosts)]


def _assembled(parts):
  """The global batches from each host's (rows, batches)."""
  out = []
  for i in range(len(parts[0][1])):
    batch = {k: np.full((B, T), -7, np.int32) for k in KEYS}
    for rows, batches in parts:
      for k in KEYS:
        batch[k][list(rows)] = batches[i][k]
    out.append(batch)
  return out


@pytest.mark.parametrize("dense", [(4, 1, 2), (2, 1, 4), (8, 1, 1)])
def test_hosts_packing_their_rows_assemble_the_one_host_batch_and_resume_on_any_host_count(source, dense):
  """2, 4 and 8 hosts (rows split over time on (2,1,4): two hosts pack the same row): bit-identical to one
  host; the hosts' states merged equal the one host's, and restored on another host count the next
  batches are the one host's next batches."""
  meshes = sharding.build_meshes(dense, (8, 1))
  one = _batches(source)
  first, then = _take(one, 9), _take(one, 4)
  for hosts in (2, 4, 8):
    host_rows = _host_rows(meshes, hosts)
    assert sorted(set().union(*host_rows)) == list(range(B))
    its = [_batches(source, rows) for rows in host_rows]
    _equal(_assembled([(rows, _take(it, 9)) for rows, it in zip(host_rows, its, strict=True)]), first)
    saved = json.loads(json.dumps(packing.merge_states([it.get_state() for it in its])))
    assert saved == one_state(source, 9)
    other = _host_rows(meshes, 8 // hosts if hosts != 8 else 2)
    resumed = []
    for rows in other:
      it = _batches(source, rows)
      it.set_state(saved)
      resumed.append((rows, _take(it, 4)))
    _equal(_assembled(resumed), then)


def one_state(source, n):
  it = _batches(source)
  _take(it, n)
  return it.get_state()


def test_each_host_tokenizes_only_its_rows_documents(source):
  """Documents i with i mod B in the host's rows, each tokenized once: a host does 1/hosts of the work."""
  rows = (2, 3)
  seen, calls = [], []

  class Recorded:
    def __init__(self, docs):
      self.docs = docs

    def __len__(self):
      return len(self.docs)

    def __getitem__(self, i):
      seen.append(i)
      return self.docs[i]

  def tokenize(text):
    calls.append(text)
    return list(text.encode()) + [0]

  it = packing.RowPacker(
    Recorded(corpus.documents(source, seed=1)), tokenize, batch_size=B, seq_len=T, pad_id=0, rows=rows
  )
  _take(it, 10)
  assert seen and {i % B for i in seen} == set(rows)
  assert len(calls) == len(seen) == len(set(seen))


def test_a_finite_iterator_pads_rows_that_ran_out_and_ends_when_all_have(source):
  """Evaluation (one epoch, unshuffled): rows 0..B-1 hold documents r, r + B, ...; a row with none left
  is padding, and the iterator ends once every row is."""
  got = list(_batches(source, shuffle=False, num_epochs=1))
  seg_NBT = np.stack([b["segment_ids"] for b in got])
  assert (seg_NBT[-1] == 0).any(axis=1).any() and (seg_NBT[-1] > 0).any()  # a partial final batch
  byte = tokenizer.ByteTokenizer()
  eos_per_row = [sum(int((b["tokens"][r] == byte.eos_id).sum()) for b in got) for r in range(B)]
  assert eos_per_row == [len(range(r, len(source), B)) for r in range(B)]
  it = _batches(source, rows=(1, 6), shuffle=False, num_epochs=1)
  pad = it.padding()
  assert pad["tokens"].shape == (2, T) and (pad["segment_ids"] == 0).all()


def test_a_state_of_the_single_stream_format_continues_every_row_from_its_place(source, caplog):
  """An older checkpoint's {index, offset}: one line says so; row 0 continues document `index` at
  `offset`, row r starts document index + r, so no document is repeated or skipped."""
  caplog.set_level(logging.WARNING)
  docs, byte = corpus.documents(source, seed=1), tokenizer.ByteTokenizer()
  it = _batches(source)
  it.set_state({"index": 5, "offset": 3})
  assert "single-stream format" in caplog.text and len(caplog.records) == 1
  batch = next(it)
  for r in range(B):
    doc = np.asarray(byte.encode(docs[5 + r]) + [byte.eos_id])[3 if r == 0 else 0 :]
    n = min(doc.size, T)
    np.testing.assert_array_equal(batch["tokens"][r][:n], doc[:n])
  with pytest.raises(ValueError, match="cannot read"):
    it.set_state({"version": 3, "index": [0] * B, "offset": [0] * B})
  with pytest.raises(ValueError, match="lacks rows"):
    _batches(source, rows=(0, 1)).set_state(_batches(source, rows=(2,)).get_state())


def test_prefetch_changes_no_batch_and_no_state(source):
  """k batches taken with prefetch 2 (more already packed ahead): the state is that after the k-th;
  restored with or without prefetch, the next batches equal the in-thread run's."""
  plain = _batches(source)
  want_first, want_state, want_then = _take(plain, 5), plain.get_state(), _take(plain, 6)
  ahead = _batches(source, prefetch=2)
  first = _take(ahead, 4)
  time.sleep(0.2)  # the worker fills its buffer and packs one more: 3 batches ahead of the 5th
  _equal(first + _take(ahead, 1), want_first)
  assert ahead.get_state() == want_state
  saved = json.loads(json.dumps(ahead.get_state()))
  ahead.close()
  for prefetch in (0, 3):
    resumed = _batches(source, prefetch=prefetch)
    resumed.set_state(saved)
    _equal(_take(resumed, 6), want_then)
    resumed.close()


def _prefetch_threads():
  return [t for t in threading.enumerate() if t.name == "prefetch"]


def test_a_worker_exception_reaches_the_caller_with_its_traceback(source):
  def failing_tokenize(text):
    if text.startswith("#4:"):
      raise RuntimeError("bad document 4")
    return list(text.encode())

  docs = corpus.documents(source, seed=0, shuffle=False)
  it = Prefetch(packing.RowPacker(docs, failing_tokenize, batch_size=2, seq_len=T, pad_id=0), size=2)
  with pytest.raises(RuntimeError, match="bad document 4") as e:
    for _ in range(100):
      next(it)
  assert "failing_tokenize" in [f.name for f in traceback.extract_tb(e.value.__traceback__)]
  with pytest.raises(RuntimeError, match="bad document 4"):  # not a hang, nor a silent end
    next(it)
  it.close()
  assert not _prefetch_threads()


def test_closing_does_not_wait_on_a_full_buffer_nor_hang_on_a_slow_worker(source):
  """A worker blocked on a full buffer, or packing slowly, ends at `close` (as at the end of a stage or
  after Ctrl-C); one dropped without `close` ends too."""
  it = _batches(source, prefetch=1)
  next(it)
  time.sleep(0.3)  # the buffer is full: the worker waits to put
  t0 = time.perf_counter()
  it.close()
  assert time.perf_counter() - t0 < 1.0 and not _prefetch_threads()
  with pytest.raises(ValueError, match="closed"):
    next(it)

  def slow(text):
    time.sleep(0.05)
    return list(text.encode())

  docs = corpus.documents(source, seed=0)
  slow_it = Prefetch(packing.RowPacker(docs, slow, batch_size=2, seq_len=T, pad_id=0), size=2)
  next(slow_it)
  t0 = time.perf_counter()
  slow_it.close()
  assert time.perf_counter() - t0 < 2.0 and not _prefetch_threads()
  dropped = _batches(source, prefetch=2)
  next(dropped)
  del dropped
  gc.collect()
  deadline = time.monotonic() + 2.0
  while _prefetch_threads() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _prefetch_threads()


def test_placing_from_rows_equals_placing_the_whole_batch(meshes):
  """The per-host placement (each device's shard cut from the rows packed here, time split over
  context) gives the same global array as `device_put` of the whole batch."""
  x_BT = np.arange(B * T, dtype=np.int32).reshape(B, T)
  rows = batch_lib.Rows(tuple(range(B)), B)
  got = batch_lib._from_rows(x_BT, rows, meshes)
  want = jax.device_put(x_BT, sharding.batch_sharding((B, T), meshes))
  assert got.sharding == want.sharding
  np.testing.assert_array_equal(np.asarray(got), x_BT)
  assert batch_lib.local_rows((B, T), meshes) == rows  # one process holds every row


def test_a_negative_prefetch_is_one_config_error():
  """Refused before any stage starts (`checks.numbers`, which the pipeline runs first)."""
  with pytest.raises(configs.ConfigError, match=r"^data.prefetch=-1 must be >= 0") as e:
    checks.numbers(configs.from_config({"data": {"prefetch": -1}}))
  assert "\n" not in str(e.value)
  checks.numbers(configs.from_config({"data": {"prefetch": 0}}))
