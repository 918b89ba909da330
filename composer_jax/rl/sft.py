"""SFT warm-up on tool-use demonstrations: next-token loss on the assistant's tokens only.

Shape suffixes: B batch, T time, V vocab.

Without a warm-up a tiny model cannot produce a tool call, RL gets no reward and the hinted teacher
equals the student: RL refines what SFT teaches. The corpus is `toy.demonstrations`:
correct calls (loss mask 1) and wrong calls followed by the error and a hint (mask 0: seen, not taught),
so after SFT the model can follow a hint placed before a turn -- the position the feedback teacher uses.

  sft_batch(demos, pad_to)      → tokens, positions, segment_ids, target_mask (mask of the *next* token)
  make_sft_step(cfg, tx, ...)   → jitted step(state, batch) -> (state, metrics), state donated
  fit(state, step, demos, scfg) → (state, summary) through `train.loop` (progress, metrics, checkpoints,
                                  interrupts)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from composer_jax import model
from composer_jax.configs import SFTConfig
from composer_jax.rl import chat
from composer_jax.train import loop
from composer_jax.train import metrics as metrics_lib
from composer_jax.train.losses import masked_target_loss
from composer_jax.train.state import TrainState, guarded_update


def pad_length(n: int, multiple: int = 32) -> int:
  """Round a length up to a multiple (few distinct shapes ⇒ few compilations)."""
  return max(multiple, -(-n // multiple) * multiple)


def sft_batch(
  rows: Sequence[chat.Trajectory | Sequence[chat.Trajectory]],
  pad_to: int,
  pad_id: int = chat.BYTE_TOKENIZER.pad_id,
) -> dict[str, np.ndarray]:
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
  return out | {"target_mask": target}


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


def make_sft_step(
  cfg: model.ModelConfig,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  *,
  router_bias_rate: float,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """Jitted, donated step; a non-finite loss or gradient keeps the old params (as `pretrain`)."""

  def loss_fn(params, batch):
    logits_BTV, aux = model.apply(
      params, cfg, batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"]
    )
    total, count = masked_target_loss(logits_BTV, batch["tokens"], batch["target_mask"])
    return total / jnp.maximum(count, 1.0), (count, aux)

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    (loss, (count, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    balance = lambda p: model.update_router_bias(p, aux["expert_load"], router_bias_rate)  # noqa: E731
    new, _, grad_norm, ok = guarded_update(state, grads, loss, tx, after=balance)
    return new, {
      "loss": loss,
      "grad_norm": grad_norm,
      "tokens": count,
      "lr": jnp.asarray(schedule(state.step), jnp.float32),
      "skipped": 1 - ok.astype(jnp.int32),
    }

  return jax.jit(step, donate_argnums=0)


def fit(
  state: TrainState,
  step_fn: Callable,
  demos: Sequence[chat.Trajectory],
  scfg: SFTConfig,
  *,
  seed: int = 0,
  writer: metrics_lib.MetricsWriter | None = None,
  save: Callable[[TrainState, bool], None] | None = None,
  check: Callable[[], None] | None = None,
  pad_id: int = chat.BYTE_TOKENIZER.pad_id,
) -> tuple[TrainState, dict]:
  """Trains from `state.step` to `scfg.steps` on random batches of `demos` (the batch of step s is a pure
  function of (seed, s), so a resumed run sees the same data): `batch_size` rows, each one demo, or with
  `pack_len` as many as fit in a row of that length. An interrupt saves and returns."""
  pad_to = pad_length(max(max(len(d) for d in demos), scfg.pack_len))

  def next_batch(s: int, state: TrainState) -> tuple[dict, dict]:
    rng = np.random.default_rng([seed, s])
    if scfg.pack_len:
      rows = pack_rows(demos, scfg.batch_size, pad_to, rng)
      return sft_batch(rows, pad_to, pad_id), {"demos": float(sum(len(r) for r in rows))}
    idx = rng.choice(len(demos), size=scfg.batch_size, replace=len(demos) < scfg.batch_size)
    return sft_batch([demos[i] for i in idx], pad_to, pad_id), {}

  hooks = loop.Hooks(
    next_batch=next_batch,
    describe=lambda r: (
      f"loss {r['loss']:.4f} gnorm {r['grad_norm']:.3f} lr {r['lr']:.2e} step {r['step_s']:.2f}s"
    ),
    save=None if save is None else lambda st, step, final: save(st, final),
    check=check,
    writer=writer,
  )
  state, r = loop.fit(
    state, step_fn, loop.Schedule(scfg.steps, scfg.log_every, 0, scfg.checkpoint_every), hooks, name="sft"
  )
  losses = [h["loss"] for h in r.history]
  return state, {
    "start_step": r.start_step,
    "steps": r.steps,
    "interrupted": r.interrupted,
    "first_loss": losses[0] if losses else None,
    "last_loss": losses[-1] if losses else None,
    "losses": losses,
    "seconds": r.seconds,
  }
