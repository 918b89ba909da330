"""SFT warm-up on tool-use demonstrations: next-token loss on the assistant's tokens only.

Shape suffixes: B batch, T time, V vocab.

Without a warm-up a tiny model cannot produce a tool call, RL gets no reward and the hinted teacher
equals the student (notes/rl.md §6: "RL refines, SFT teaches"). The corpus is `toy.demonstrations`:
correct calls (loss mask 1) and wrong calls followed by the error and a hint (mask 0: seen, not taught),
so after SFT the model can follow a hint placed before a turn -- the position the feedback teacher uses.

  sft_batch(demos, pad_to)      → tokens, positions, segment_ids, target_mask (mask of the *next* token)
  make_sft_step(cfg, tx, ...)   → jitted step(state, batch) -> (state, metrics), state donated
  fit(state, step, demos, scfg) → (state, summary); progress lines, JSONL metrics, checkpoints, Ctrl-C saves
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from composer_jax import model
from composer_jax.rl import chat
from composer_jax.train import metrics as metrics_lib
from composer_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  steps: int = 300
  batch_size: int = 32
  demos: int = 2000  # demonstrations generated once (seeded); batches sample from them
  lr: float = 3e-3
  warmup_steps: int = 20
  log_every: int = 25
  checkpoint_every: int = 100
  keep_checkpoints: int = 1
  mistake_fraction: float = 0.3  # toy.demonstrations: share of demos with an invalid call + error
  hint_fraction: float = 0.7  # of those, share followed by the hint message
  router_bias_rate: float = 1e-3


def pad_length(n: int, multiple: int = 32) -> int:
  """Round a length up to a multiple (few distinct shapes ⇒ few compilations)."""
  return max(multiple, -(-n // multiple) * multiple)


def sft_batch(demos: Sequence[chat.Trajectory], pad_to: int) -> dict[str, np.ndarray]:
  """Padded arrays; `target_mask[b, t]` = loss_mask of token t+1 (logits at t predict it), last column 0."""
  a = chat.to_arrays(demos, pad_to)
  target = np.zeros_like(a["loss_mask"])
  target[:, :-1] = a["loss_mask"][:, 1:]
  return {
    "tokens": a["tokens"],
    "positions": a["positions"],
    "segment_ids": a["segment_ids"],
    "target_mask": target,
  }


def sft_loss(
  logits_BTV: jax.Array, tokens_BT: jax.Array, target_mask_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(Σ -log p(token t+1) over targets with mask 1, number of targets)."""
  logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  nll_BT = -jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  m_BT = target_mask_BT[:, :-1] > 0
  return jnp.sum(jnp.where(m_BT, nll_BT, 0.0)), jnp.sum(m_BT).astype(jnp.float32)


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
    total, count = sft_loss(logits_BTV, batch["tokens"], batch["target_mask"])
    return total / jnp.maximum(count, 1.0), (count, aux)

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    (loss, (count, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = model.update_router_bias(
      optax.apply_updates(state.params, updates), aux["expert_load"], router_bias_rate
    )
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
    new = TrainState(
      step=state.step + 1, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state)
    )
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
  log: Callable[[str], None] = print,
) -> tuple[TrainState, dict]:
  """Trains from `state.step` to `scfg.steps` on random batches of `demos` (the batch of step s is a pure
  function of (seed, s), so a resumed run sees the same data). Ctrl-C saves and returns."""
  pad_to = pad_length(max(len(d) for d in demos))
  start, losses, interrupted = int(state.step), [], False
  t0 = time.perf_counter()
  pending = None

  def drain(item):
    s, m, t_dispatch = item
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    losses.append(m["loss"])
    if s % scfg.log_every == 0 or s == scfg.steps or s == start + 1:
      if writer is not None:
        writer.write(s, m)
      log(
        f"[sft] step {s}/{scfg.steps} loss {m['loss']:.4f} gnorm {m['grad_norm']:.3f} lr {m['lr']:.2e} "
        f"step {time.perf_counter() - t_dispatch:.2f}s elapsed {time.perf_counter() - t0:.0f}s"
      )

  try:
    for s in range(start + 1, scfg.steps + 1):
      rng = np.random.default_rng([seed, s])
      idx = rng.choice(len(demos), size=scfg.batch_size, replace=len(demos) < scfg.batch_size)
      batch = sft_batch([demos[i] for i in idx], pad_to)
      t_dispatch = time.perf_counter()
      state, m = step_fn(state, batch)
      if pending is not None:
        drain(pending)
      pending = (s, m, t_dispatch)
      if save is not None and s % scfg.checkpoint_every == 0:
        save(state, False)
  except KeyboardInterrupt:
    interrupted = True
    log(f"[sft] interrupted at step {int(state.step)}: saving")
  if pending is not None:
    drain(pending)
  if save is not None:
    save(state, True)
  if writer is not None:
    writer.flush()
  return state, {
    "start_step": start,
    "steps": int(state.step),
    "interrupted": interrupted,
    "first_loss": losses[0] if losses else None,
    "last_loss": losses[-1] if losses else None,
    "losses": losses,
    "seconds": time.perf_counter() - t0,
  }
