"""Synthetic tasks as a TFDS dataset (array_record, read with `as_data_source`; TensorFlow never needed).

One record per task, exactly the schema of `Task.to_record()` (see `SCHEMA`). Strings are tfds `Text`
(bytes on read; `read_tasks` decodes them back to `str` / `list[str]`).

Why a content fingerprint in the builder config name: tfds reuses any prepared dataset it finds under
`data_dir/<name>/<config>/<version>`, so a fixed config would silently serve stale tasks after the
records change. Each distinct record list gets its own config `fp_<sha256[:16]>`; `data_dir/<name>/LATEST`
(replaced atomically) names the config that `read_tasks` opens. Rebuilding identical records reuses the
prepared copy; older configs are left in place for readers that still hold them.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from composer_jax.data import builders

DATASET_VERSION = "1.0.0"  # bump when the schema or encoding changes
SPLIT = "train"
_STR = ("instance_id", "mode", "patch", "gold_patch", "statement", "created_at", "repo_dir", "venv")
_STR += ("test_files_json",)
_LIST = ("feature", "FAIL_TO_PASS", "PASS_TO_PASS", "hidden_tests")
_SOURCE = ("name", "version", "sha256")
SCHEMA = ("instance_id", "source", "feature", "mode", "patch", "gold_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
SCHEMA += ("hidden_tests", "statement", "created_at", "repo_dir", "venv", "test_files_json")


def features() -> tfds.features.FeaturesDict:
  text = tfds.features.Text
  spec: dict[str, Any] = {k: text() for k in _STR}
  spec.update({k: tfds.features.Sequence(text()) for k in _LIST})
  spec["source"] = tfds.features.FeaturesDict({k: text() for k in _SOURCE})
  return tfds.features.FeaturesDict(spec)


def validate(record: dict, index: int | None = None) -> None:
  """ValueError naming the first missing, unexpected or mistyped key."""
  where = f"record {index}" if index is not None else "record"
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a dict, got {type(record).__name__}")
  where = f"{where} ({record.get('instance_id', '?')!r})"
  for k in SCHEMA:
    if k not in record:
      raise ValueError(f"{where}: missing key {k!r}")
  extra = sorted(set(record) - set(SCHEMA))
  if extra:
    raise ValueError(f"{where}: unexpected keys {extra}")
  for k in _STR:
    if not isinstance(record[k], str):
      raise ValueError(f"{where}: {k!r} must be str, got {type(record[k]).__name__}")
  for k in _LIST:
    v = record[k]
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
      raise ValueError(f"{where}: {k!r} must be a list of str")
  src = record["source"]
  if not isinstance(src, dict):
    raise ValueError(f"{where}: 'source' must be a dict with keys {list(_SOURCE)}")
  for k in _SOURCE:
    if k not in src:
      raise ValueError(f"{where}: missing key 'source.{k}'")
    if not isinstance(src[k], str):
      raise ValueError(f"{where}: 'source.{k}' must be str")
  if set(src) - set(_SOURCE):
    raise ValueError(f"{where}: unexpected keys in 'source': {sorted(set(src) - set(_SOURCE))}")


def fingerprint(records: Sequence[dict]) -> str:
  """sha256 over the canonical JSON of the records (order matters: it is the dataset order)."""
  canon = [{**r, **{k: list(r[k]) for k in _LIST}} for r in records]
  blob = json.dumps([DATASET_VERSION, canon], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
  return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@functools.cache
def _builder_class(name: str, config: str) -> type:
  """A GeneratorBasedBuilder named `name` (tfds takes the dataset name from the class) whose one declared
  config is `config`: a config the class declares is not a "custom data configuration" tfds warns about."""

  class _Tasks(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version(DATASET_VERSION)
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=config, version=DATASET_VERSION)]

    def __init__(self, *, records: Sequence[dict] = (), **kwargs):
      self._records = list(records)
      super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
      return tfds.core.DatasetInfo(
        builder=self,
        description="Synthetic feature-deletion tasks (composer_jax.synth), one record per task.",
        features=features(),
        disable_shuffling=True,  # keep the caller's order
      )

    def _split_generators(self, dl_manager):
      del dl_manager
      return {SPLIT: self._generate_examples()}

    def _generate_examples(self):
      for i, r in enumerate(self._records):
        yield f"{i:09d}", {**r, **{k: list(r[k]) for k in _LIST}}

  _Tasks.name = name
  _Tasks.__name__ = _Tasks.__qualname__ = "".join(p.title() for p in name.split("_"))
  return _Tasks


def _builder(data_dir: str, name: str, config: str, records: Sequence[dict] = ()):
  cls = _builder_class(name, config)
  return cls(
    records=records,
    config=config,
    data_dir=data_dir,
    file_format="array_record",
  )


def write_tasks(records: Sequence[dict], data_dir: str | os.PathLike, *, name: str = "synth_tasks") -> str:
  """Build (or reuse, when the records are identical) the dataset; returns its directory."""
  records = list(records)
  if not records:
    raise ValueError("no records to write")
  for i, r in enumerate(records):
    validate(r, i)
  ids = [r["instance_id"] for r in records]
  dup = sorted(i for i, k in collections.Counter(ids).items() if k > 1)
  if dup:
    raise ValueError(f"duplicate instance_id: {dup[:5]}")
  data_dir = os.fspath(data_dir)
  config = f"fp_{fingerprint(records)[:16]}"
  builder = _builder(data_dir, name, config, records)
  if not builders.prepared(builder):
    builders.prepare(builder)
  _write_latest(os.path.join(data_dir, name), config)
  return os.fspath(builder.data_dir)


def _write_latest(root: str, config: str) -> None:
  os.makedirs(root, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".LATEST.", dir=root)
  try:
    with os.fdopen(fd, "w") as f:
      f.write(config + "\n")
    os.replace(tmp, os.path.join(root, "LATEST"))
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _text(x) -> str:
  return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _decode(ex: dict) -> dict:
  out: dict[str, Any] = {k: _text(ex[k]) for k in _STR}
  out.update({k: [_text(x) for x in np.asarray(ex[k]).tolist()] for k in _LIST})
  out["source"] = {k: _text(ex["source"][k]) for k in _SOURCE}
  return {k: out[k] for k in SCHEMA}


def read_tasks(data_dir: str | os.PathLike, *, name: str = "synth_tasks") -> list[dict]:
  """The records of the latest `write_tasks` under `data_dir`, in write order, as str / list[str]."""
  data_dir = os.fspath(data_dir)
  latest = os.path.join(data_dir, name, "LATEST")
  try:
    with open(latest) as f:
      config = f.read().strip()
  except FileNotFoundError:
    raise FileNotFoundError(f"no {name!r} tasks under {data_dir} (write_tasks not run?)") from None
  builder = _builder(data_dir, name, config)
  if not builders.prepared(builder):
    raise FileNotFoundError(f"{latest} names {config!r}, which is not prepared under {data_dir}")
  source = builder.as_data_source(split=SPLIT)
  return [_decode(source[i]) for i in range(len(source))]
