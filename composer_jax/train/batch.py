"""Typed batches of token rows and their placement on the dense mesh.

Shape suffixes: B batch, T time.

  batch = TokenBatch(tokens_BT, positions_BT, segment_ids_BT)                 # pretraining rows
  batch = TokenBatch(tokens_BT, positions_BT, segment_ids_BT, target_mask_BT)  # SFT: chosen targets
  batch = place(batch, meshes)                       # rows over replica·fsdp, time over context

Batches are `flax.struct` dataclasses, so they are pytrees: a jitted step takes them whole, and an optional
field left `None` is a different tree structure, hence its own compiled program (the RL step with and
without the teacher is one function).
"""

from __future__ import annotations

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


def place(batch: Any, meshes: sharding.Meshes | None) -> Any:
  """A host batch (any pytree of arrays) as global arrays sharded like `shardings`, on one or many
  processes: every process holds the same whole batch and places only its own devices' shards
  (`device_put` would all-gather the batch each step to check that the processes agree). With one
  process this is `device_put`: same values, same shardings."""
  put = shardings(batch, meshes)
  if put is None:
    return jax.device_put(batch)
  if jax.process_count() == 1:
    return jax.device_put(batch, put)
  return jax.tree.map(
    lambda s, x: jax.make_array_from_process_local_data(s, np.asarray(x), np.shape(x)), put, batch
  )
