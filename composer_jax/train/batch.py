"""Typed batches of token rows and their placement on the dense mesh.

Shape suffixes: B batch, R the rows of it one process packs, T time.

  batch = TokenBatch(tokens_BT, positions_BT, segment_ids_BT)                 # pretraining rows
  batch = TokenBatch(tokens_BT, positions_BT, segment_ids_BT, target_mask_BT)  # SFT: chosen targets
  batch = place(batch, meshes)                       # rows over replica·fsdp, time over context
  rows = local_rows((B, T), meshes)                  # the rows this process's devices hold
  batch = place(local_batch_RT, meshes, rows)        # ... from only those rows, packed on this host

Batches are `flax.struct` dataclasses, so they are pytrees: a jitted step takes them whole, and an optional
field left `None` is a different tree structure, hence its own compiled program (the RL step with and
without the teacher is one function).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import struct

from composer_jax import sharding


@struct.dataclass
class TokenBatch:
  """Packed rows of documents. Column t predicts token t + 1 inside its document (same segment id, not
  padding 0); `target_mask` [B, T], when given, also picks which of those targets are trained (SFT trains
  the assistant's tokens only)."""

  tokens: Any  # int32 [B, T]
  positions: Any  # int32 [B, T], restarting per document
  segment_ids: Any  # int32 [B, T], 1, 2, ... per document, 0 for padding
  target_mask: Any = None  # float32 [B, T] or None: every next token inside its document

  @classmethod
  def of(cls, rows: dict) -> TokenBatch:
    """From a dict with the same keys (a data iterator's element)."""
    return cls(
      **{k: rows[k] for k in ("tokens", "positions", "segment_ids")}, target_mask=rows.get("target_mask")
    )


def shardings(batch: Any, meshes: sharding.Meshes | None) -> Any:
  """The batch's tree of shardings (`sharding.batch_sharding` per array); None without meshes."""
  if meshes is None:
    return None
  return jax.tree.map(lambda x: sharding.batch_sharding(np.shape(x), meshes), batch)


@dataclasses.dataclass(frozen=True)
class Rows:
  """The rows of a global batch of `total` rows that one process packs and places: `ids`, ascending."""

  ids: tuple[int, ...]
  total: int

  @property
  def all(self) -> bool:
    return self.ids == tuple(range(self.total))


def rows_held(shape: Sequence[int], meshes: sharding.Meshes | None, devices: Sequence[Any]) -> Rows:
  """The rows of a host batch of `shape` that any of `devices` holds a piece of, under `batch_sharding`
  (whole rows: a row split over time is packed whole, then sliced)."""
  if meshes is None:
    return Rows(tuple(range(shape[0])), shape[0])
  indices = sharding.batch_sharding(shape, meshes).devices_indices_map(tuple(shape))
  ids = set()
  for device in devices:
    ids.update(range(*indices[device][0].indices(shape[0])))
  return Rows(tuple(sorted(ids)), shape[0])


def local_rows(shape: Sequence[int], meshes: sharding.Meshes | None) -> Rows:
  """The rows this process's devices hold: the only rows it needs to read and pack."""
  devices = jax.local_devices() if meshes is None else meshes.dense.local_devices
  return rows_held(shape, meshes, devices)


def place(batch: Any, meshes: sharding.Meshes | None, rows: Rows | None = None) -> Any:
  """A host batch (any pytree of arrays) as global arrays sharded like `shardings`, on one or many
  processes. `rows`: the batch holds only these rows of the global batch (at least those this process's
  devices hold, `local_rows`); None: the whole batch, which every process holds and of which each places
  only its own devices' shards (`device_put` would all-gather the batch each step to check that the
  processes agree). With one process and every row this is `device_put`: same values, same shardings."""
  if rows is not None and not rows.all:
    return jax.tree.map(lambda x: _from_rows(np.asarray(x), rows, meshes), batch)
  put = shardings(batch, meshes)
  if put is None:
    return jax.device_put(batch)
  if jax.process_count() == 1:
    return jax.device_put(batch, put)
  return jax.tree.map(
    lambda s, x: jax.make_array_from_process_local_data(s, np.asarray(x), np.shape(x)), put, batch
  )


def _from_rows(x_R: np.ndarray, rows: Rows, meshes: sharding.Meshes) -> jax.Array:
  """The global array [rows.total, ...] whose devices' shards come from `x_R`, this host's rows."""
  shape = (rows.total, *x_R.shape[1:])
  where = {r: i for i, r in enumerate(rows.ids)}

  def shard(index: tuple[slice, ...]) -> np.ndarray:
    wanted = range(*index[0].indices(rows.total))
    if any(r not in where for r in wanted):
      raise ValueError(f"a device of this process holds rows {list(wanted)}, not all packed here {rows.ids}")
    return x_R[[where[r] for r in wanted]][(slice(None), *index[1:])]

  return jax.make_array_from_callback(shape, sharding.batch_sharding(shape, meshes), shard)
