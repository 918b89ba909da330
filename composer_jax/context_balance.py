"""Causal load balancing over the dense mesh's context axis: the sequence order in which every context
shard does the same causal attention work (`model.context_load_balance`).

Cut a sequence into 2·shards equal chunks; shard i of a contiguous split holds chunks i and 2·shards−1−i.
Pure reorderings of NumPy or jax arrays: nothing here knows a mesh, only the number of shards.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def balanced_chunks(shards: int) -> np.ndarray:
  """The chunk order of the load-balanced sequence layout: the sequence cut into 2·shards equal chunks,
  shard i (of a contiguous split over `shards`) holds chunks i and 2·shards−1−i. Under a causal mask
  chunk j sees j + 1 chunks of keys, so every shard sees 2·shards + 1: equal work (MaxText's
  load-balanced context parallelism)."""
  return np.array([c for i in range(shards) for c in (i, 2 * shards - 1 - i)], np.int32)


def balance_sequence(x: Any, shards: int, axis: int = 1) -> Any:
  """x (a NumPy or jax array) with its `axis` (length T) in the load-balanced order of `balanced_chunks`;
  `balance_sequence(np.arange(T), shards, 0)` is the natural index of each slot. Identity for shards = 1."""
  return _reorder_chunks(x, shards, axis, balanced_chunks(shards))


def restore_sequence(x: Any, shards: int, axis: int = 1) -> Any:
  """The inverse of `balance_sequence`: natural order along `axis` again."""
  return _reorder_chunks(x, shards, axis, np.argsort(balanced_chunks(shards)))


def _reorder_chunks(x: Any, shards: int, axis: int, order: np.ndarray) -> Any:
  if shards == 1:
    return x
  n, length = 2 * shards, x.shape[axis]
  if length % n:
    raise ValueError(f"a sequence of {length} cannot be cut into 2·context = {n} equal chunks")
  chunks = x.reshape(*x.shape[:axis], n, length // n, *x.shape[axis + 1 :])
  return chunks[(slice(None),) * axis + (order,)].reshape(x.shape)
