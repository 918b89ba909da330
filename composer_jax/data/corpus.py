"""Pretraining corpus (a tfds builder over the stdlib's .py files) and its packed grain batches (`packing`).

Why the stdlib: it is real code that exists offline on every machine (~740 files, ~12 MB on 3.11).
Stored as array_record and read with `as_data_source`, so TensorFlow is never needed.

Kept: every `.py` under `os.path.dirname(os.__file__)`. Dropped: directories named `test`, `tests`,
`idle_test` (CPython's test suite: huge, repetitive, deliberately odd encodings), `site-packages` /
`dist-packages` (third-party code, differs per machine), `__pycache__`, and files that are not valid
UTF-8. `idlelib` and `lib2to3` proper are kept: ordinary application code.

Split is by file: sha256 of the relative path decides, so a file never appears in both splits and the
split does not depend on the file listing order or count.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from typing import Any

import grain
import jax
import tensorflow_datasets as tfds
from absl import logging
from jax.experimental import multihost_utils

from composer_jax.data import builders, packing
from composer_jax.data.prefetch import Prefetch
from composer_jax.data.tokenizer import Tokenizer

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
VALIDATION_PERMILLE = 20  # 2% of files
SPLITS = ("train", "validation")


def stdlib_root() -> str:
  return os.path.dirname(os.__file__)


def split_of(relpath: str) -> str:
  """Deterministic by-file split from the path alone."""
  h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
  return "validation" if h % 1000 < VALIDATION_PERMILLE else "train"


def list_sources(root: str, max_files: int | None = None) -> list[str]:
  """Sorted relative paths of the kept .py files (first `max_files` of them, for tests)."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
    for f in filenames:
      if f.endswith(".py"):
        out.append(os.path.relpath(os.path.join(dirpath, f), root))
  out.sort()
  return out[:max_files] if max_files is not None else out


def read_source(root: str, relpath: str) -> str | None:
  """File text, or None when it is not UTF-8 (bytes kept exactly: no newline translation)."""
  with open(os.path.join(root, relpath), "rb") as f:
    data = f.read()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


def iter_split(root: str, split: str, max_files: int | None = None):
  """(relpath, text) of one split, in path order; shared by the builder and the tokenizer script."""
  for rel in list_sources(root, max_files):
    if split_of(rel) == split:
      text = read_source(root, rel)
      if text is not None:
        yield rel, text


class StdlibCode(tfds.core.GeneratorBasedBuilder):
  """`.py` sources of a Python installation; features `path`, `text` (both Text -> bytes on read)."""

  VERSION = tfds.core.Version("1.0.0")

  def __init__(self, *, src_dir: str | None = None, max_files: int | None = None, **kwargs):
    self._src_dir = src_dir or stdlib_root()
    self._max_files = max_files
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    # Built directly: `dataset_info_from_configs` needs the builder in a tfds-style package layout.
    return tfds.core.DatasetInfo(
      builder=self,
      description=f"Python source files under {self._src_dir} (tests and site-packages excluded).",
      features=tfds.features.FeaturesDict({"path": tfds.features.Text(), "text": tfds.features.Text()}),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {split: self._generate_examples(split) for split in SPLITS}

  def _generate_examples(self, split: str):
    for rel, text in iter_split(self._src_dir, split, self._max_files):
      yield rel, {"path": rel, "text": text}


def source_key(src_dir: str | None, max_files: int | None) -> str:
  """A short hash of what the corpus is built from: the directory, `max_files`, and every kept file's
  path, size and modification time, so a changed source builds a new corpus instead of reusing the old."""
  root = os.path.realpath(src_dir or stdlib_root())
  h = hashlib.sha256(f"{root}\0{max_files}".encode())
  for rel in list_sources(root, max_files):
    st = os.stat(os.path.join(root, rel))
    h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode())
  return h.hexdigest()[:12]


def check_splits(src_dir: str | None, max_files: int | None) -> None:
  """ConfigError naming the directory when a split would get no file (the split hashes each path)."""
  from composer_jax.configs import ConfigError

  root = src_dir or stdlib_root()
  if not os.path.isdir(root):
    raise ConfigError(f"data.src_dir {root!r} is not a directory")
  rels = list_sources(root, max_files)
  counts = {split: sum(split_of(r) == split for r in rels) for split in SPLITS}
  empty = [split for split, n in counts.items() if n == 0]
  if empty:
    raise ConfigError(
      f"data.src_dir {root!r} has {len(rels)} .py file(s) (max_files {max_files}), and the "
      f"{', '.join(empty)} split got none: a hash of each path sends ~{VALIDATION_PERMILLE / 10:g}% of "
      f"files to validation, so use a tree of at least ~{3000 // VALIDATION_PERMILLE} files"
    )


def build_corpus(
  data_dir: str, *, src_dir: str | None = None, max_files: int | None = None, verbose: bool = True
) -> dict[str, Any]:
  """{split: ArrayRecordDataSource}; builds under `data_dir/<source key>` on first call, reuses it
  afterwards (another source, or changed files, get their own build).

  In a multi-process run process 0 builds while the others wait, then they read what it wrote, so
  `data_dir` must be on storage that every process sees.
  """
  check_splits(src_dir, max_files)
  data_dir = os.path.join(data_dir, source_key(src_dir, max_files))
  kwargs = dict(src_dir=src_dir, max_files=max_files, data_dir=data_dir, file_format="array_record")
  multi = jax.distributed.is_initialized() and jax.process_count() > 1
  if multi and jax.process_index() != 0:
    multihost_utils.sync_global_devices("build_corpus")  # process 0 has built it (or found it)
    builder = StdlibCode(**kwargs)
    if not builders.prepared(builder):
      raise RuntimeError(
        f"Process {jax.process_index()} does not see the corpus process 0 built under {data_dir}: "
        "in a multi-process run the workdir must be on storage every process sees."
      )
    return {split: ds for split, ds in builder.as_data_source().items()}
  builder = StdlibCode(**kwargs)
  if builders.prepared(builder):
    if verbose:
      logging.info("[corpus] stdlib_code: reusing %s", builder.data_dir)
  else:
    if verbose:
      logging.info("[corpus] stdlib_code: building from %s into %s ...", builder._src_dir, builder.data_dir)
    t0 = time.perf_counter()
    builders.prepare(builder)  # a few seconds of build: our own lines say what happens
    if verbose:
      splits = builder.info.splits
      sizes = ", ".join(f"{s} {splits[s].num_examples} files" for s in SPLITS)
      mb = sum(splits[s].num_bytes for s in SPLITS) / 1e6
      logging.info("[corpus] stdlib_code: built %s, %.1f MB in %.1f s", sizes, mb, time.perf_counter() - t0)
  if multi:
    multihost_utils.sync_global_devices("build_corpus")  # the others may read it now
  return {split: ds for split, ds in builder.as_data_source().items()}


def documents(source: Sequence, *, seed: int, shuffle: bool = True) -> grain.MapDataset:
  """Document texts; indices past len(source) are later epochs, each with its own permutation."""
  ds = grain.MapDataset.source(source)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  return ds.map(lambda record: record["text"].decode("utf-8"))


def batches(
  source: Sequence,
  tokenizer: Tokenizer,
  *,
  batch_size: int,
  seq_len: int,
  seed: int,
  shuffle: bool = True,
  num_epochs: int | None = None,
  min_fragment: int | None = None,
  rows: Sequence[int] | None = None,
  prefetch: int = 0,
) -> packing.RowPacker | Prefetch:
  """Packed batches {tokens, segment_ids, positions} [R, T] int32 of `rows` (global row ids; None: all
  `batch_size` rows) of the global batch, from one split's data source (`packing`: one document stream
  per row, so any set of hosts packing their rows assembles the same global batch).

  `num_epochs=None` repeats forever (training); a finite count ends with a padded partial batch
  (evaluation). `prefetch` > 0: a background thread packs up to that many batches ahead (`Prefetch`:
  `get_state` is the state after the last batch taken, not the last one packed; the worker's exception
  is raised by `next`); `close()` stops it. Resume with `it.set_state(saved)` on a fresh iterator built
  with the same arguments (any `rows` and `prefetch`).
  """
  eos = tokenizer.eos_id

  def tokenize(text: str) -> list[int]:
    return tokenizer.encode(text) + [eos]

  ds = packing.PackedRows(
    documents(source, seed=seed, shuffle=shuffle),
    tokenize,
    batch_size=batch_size,
    seq_len=seq_len,
    pad_id=tokenizer.pad_id,
    rows=rows,
    num_epochs=num_epochs,
    min_fragment=min_fragment,
  )
  return Prefetch(iter(ds), prefetch) if prefetch > 0 else iter(ds)
