"""Next-token pretraining on packed rows: the eval step and the hooks that make `train.loop.fit` pretraining.

Shape suffixes: B batch, T time.

The step itself is `train.step.make_step(train.step.next_token_loss(cfg, meshes), ...)`, the same builder
SFT and RL use; what is particular to pretraining is its data (a checkpointed iterator of packed rows),
its validation loss and its progress line (tokens/s, MFU).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from composer_jax import model, sharding
from composer_jax.train import batch as batch_lib
from composer_jax.train import loop
from composer_jax.train.batch import TokenBatch
from composer_jax.train.state import TrainState, replicated
from composer_jax.train.step import forward_nll


def make_eval_step(cfg: model.ModelConfig, params_sharding: Any, meshes: sharding.Meshes | None):
  """Jitted (sum of nll, token count) of one batch: summed over batches for a token-weighted mean."""

  def eval_step(params: Any, batch: TokenBatch) -> tuple[jax.Array, jax.Array]:
    return forward_nll(params, cfg, batch, meshes)[:2]

  rep = replicated(meshes)
  return jax.jit(eval_step, in_shardings=(params_sharding, None), out_shardings=(rep, rep))


def evaluate(eval_step: Callable, params: Any, eval_batches: list[TokenBatch]) -> float:
  sums = [eval_step(params, b) for b in eval_batches]
  total, count = (sum(float(x[i]) for x in sums) for i in (0, 1))
  return total / max(count, 1.0)


def active_params(cfg: model.ModelConfig) -> int:
  """Parameters one token touches: all but the input embedding, routed experts × top_k/E."""
  axes = model.logical_axes(cfg)
  shapes = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))
  n = 0
  for (path, ax), leaf in zip(
    jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(x, tuple)),
    jax.tree.leaves(shapes),
    strict=True,
  ):
    size = math.prod(leaf.shape)
    if jax.tree_util.keystr(path, simple=True, separator="/") == "embed":
      continue
    n += size * cfg.top_k // cfg.n_experts if sharding.is_expert_param(ax) else size
  return n


def hooks(
  train_iter: Any,
  eval_step: Callable,
  eval_batches: list[TokenBatch],
  *,
  meshes: sharding.Meshes | None,
  peak_flops: float,
  flops_per_token: float = 0.0,
  save: Callable[[TrainState, dict, bool], None] | None = None,
  rows: batch_lib.Rows | None = None,
  **common: Any,
) -> loop.Hooks:
  """Pretraining's hooks: batches from the checkpointed iterator, validation loss, tokens/s and MFU.

  `save(state, data_state, final)` gets the iterator's state right after the last batch taken from it
  (with prefetch, batches packed ahead are not in it), so a resume sees the next batch. `rows`: the
  iterator packs only these rows of the global batch (`batch.place`). `common`: the stage-independent
  hooks (check, writer)."""
  data_state = [train_iter.get_state()]

  def next_batch(step: int, state: TrainState) -> tuple[TokenBatch, dict]:
    batch = batch_lib.place(TokenBatch.of(next(train_iter)), meshes, rows)
    data_state[0] = train_iter.get_state()
    return batch, {}

  def describe(r: dict) -> str:
    return (
      f"loss {r['loss']:.4f} gnorm {r['grad_norm']:.3f} lr {r['lr']:.2e} {r['tokens_per_s']:,.0f} tok/s "
      f"mfu {r['mfu']:.1%} step {r['step_s']:.2f}s"
    )

  return loop.Hooks(
    next_batch=next_batch,
    describe=describe,
    annotate=lambda r: {"mfu": flops_per_token * r["tokens_per_s"] / peak_flops},
    evaluate=(lambda st: {"validation_loss": evaluate(eval_step, st.params, eval_batches)})
    if eval_batches
    else None,
    save=None if save is None else lambda st, step, final: save(st, data_state[0], final),
    throughput_key="tokens",
    **common,
  )


def fixed_batches(
  it: Iterator[dict], n: int, meshes: sharding.Meshes | None, rows: batch_lib.Rows | None = None
) -> list[TokenBatch]:
  """The first `n` batches of a finite iterator, on device (validation uses the same ones each time).

  With `rows` (this process packs only those), processes agree on the count: the global iterator ends
  when every row has, so a process whose rows ran out first pads (`packing.RowPacker.padding`) up to the
  longest process's count, as the rows of one process packing everything would be."""
  local = list(itertools.islice(it, n))
  count = len(local)
  if rows is not None and jax.process_count() > 1:
    from jax.experimental import multihost_utils

    count = int(np.max(multihost_utils.process_allgather(np.int32(count))))
  local += [it.padding() for _ in range(count - len(local))]
  return [batch_lib.place(TokenBatch.of(b), meshes, rows) for b in local]
