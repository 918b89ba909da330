"""SFT warm-up on tool-use demonstrations: next-token loss on the assistant's tokens only.

Shape suffixes: B batch, T time, V vocab.

Without a warm-up a tiny model cannot produce a tool call, RL gets no reward and the hinted teacher
equals the student: RL refines what SFT teaches. The corpus is `toy.demonstrations`:
correct calls (loss mask 1) and wrong calls followed by the error and a hint (mask 0: seen, not taught),
so after SFT the model can follow a hint placed before a turn -- the position the feedback teacher uses.

  sft_batch(demos, pad_to)          → TokenBatch with target_mask (the mask of the *next* token)
  hooks(demos, scfg, seed, meshes)  → the `train.loop.Hooks` of SFT: the batch of step s, its progress line

The step is pretraining's (`train.step.next_token_loss`): a TokenBatch whose target mask picks the
assistant's tokens. Starting from the pretrained weights, SFT teaches the turn format and the tools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from composer_jax import sharding
from composer_jax.configs import SFTConfig
from composer_jax.rl import chat
from composer_jax.train import batch as batch_lib
from composer_jax.train import loop
from composer_jax.train.batch import TokenBatch


def pad_length(n: int, multiple: int = 32) -> int:
  """Round a length up to a multiple (few distinct shapes ⇒ few compilations)."""
  return max(multiple, -(-n // multiple) * multiple)


def sft_batch(
  rows: Sequence[chat.Trajectory | Sequence[chat.Trajectory]],
  pad_to: int,
  pad_id: int = chat.BYTE_TOKENIZER.pad_id,
) -> TokenBatch:
  """Padded arrays, one row per demo or per list of demos packed into one row (segment ids 1, 2, ...;
  positions restart per demo, and attention never crosses a segment). `target_mask[b, t]` = loss_mask of
  token t+1 (logits at t predict it) when t+1 is in t's demo, else 0."""
  packed = [[r] if isinstance(r, chat.Trajectory) else list(r) for r in rows]
  out = {k: np.zeros((len(packed), pad_to), np.int32) for k in ("tokens", "positions", "segment_ids")}
  out["tokens"][:] = pad_id
  mask = np.zeros((len(packed), pad_to), np.float32)
  for b, demos in enumerate(packed):
    at = 0
    for i, d in enumerate(demos):
      n = len(d)
      if at + n > pad_to:
        raise ValueError(f"row {b}: {at + n} tokens > pad_to {pad_to}")
      out["tokens"][b, at : at + n] = d.tokens
      out["positions"][b, at : at + n] = np.arange(n)
      out["segment_ids"][b, at : at + n] = i + 1
      mask[b, at : at + n] = d.loss_mask
      at += n
  target = np.zeros_like(mask)
  same = out["segment_ids"][:, 1:] == out["segment_ids"][:, :-1]
  target[:, :-1] = np.where(same, mask[:, 1:], 0.0)
  return TokenBatch(out["tokens"], out["positions"], out["segment_ids"], target)


def pack_rows(demos: Sequence[chat.Trajectory], rows: int, row_len: int, rng: np.random.Generator) -> list:
  """`rows` rows of random demos, each filled until a drawn demo does not fit (3 tries): ~1.5x the
  useful tokens per step of one padded demo per row, at one fixed shape."""
  out = []
  for _ in range(rows):
    row, used, misses = [], 0, 0
    while misses < 3:
      d = demos[int(rng.integers(len(demos)))]
      if used + len(d) <= row_len:
        row.append(d)
        used += len(d)
      else:
        misses += 1
    out.append(row)
  return out


def row_length(demos: Sequence[chat.Trajectory], scfg: SFTConfig) -> int:
  """The padded row length of every SFT batch (one shape, one compiled step)."""
  return pad_length(max(max(len(d) for d in demos), scfg.pack_len))


def make_batch(
  demos: Sequence[chat.Trajectory], scfg: SFTConfig, seed: int, s: int, pad_id: int
) -> TokenBatch:
  """The host batch of step s, a pure function of (seed, s) (a resumed run sees the same data):
  `batch_size` rows, each one demo, or with `pack_len` as many as fit in a row of that length."""
  pad_to = row_length(demos, scfg)
  rng = np.random.default_rng([seed, s])
  if scfg.pack_len:
    return sft_batch(pack_rows(demos, scfg.batch_size, pad_to, rng), pad_to, pad_id)
  idx = rng.choice(len(demos), size=scfg.batch_size, replace=len(demos) < scfg.batch_size)
  return sft_batch([demos[i] for i in idx], pad_to, pad_id)


def hooks(
  demos: Sequence[chat.Trajectory],
  scfg: SFTConfig,
  *,
  seed: int,
  meshes: sharding.Meshes | None,
  pad_id: int,
  save: Callable[[Any, bool], None] | None = None,
  **common: Any,
) -> loop.Hooks:
  """SFT's hooks: the batch of step s placed on the meshes, and its progress line. `common`: the
  stage-independent hooks (check, writer)."""

  def next_batch(s: int, state: Any) -> tuple[TokenBatch, dict]:
    return batch_lib.place(make_batch(demos, scfg, seed, s, pad_id), meshes), {}

  return loop.Hooks(
    next_batch=next_batch,
    describe=lambda r: (
      f"loss {r['loss']:.4f} gnorm {r['grad_norm']:.3f} lr {r['lr']:.2e} step {r['step_s']:.2f}s"
    ),
    save=None if save is None else lambda st, step, final: save(st, final),
    **common,
  )
