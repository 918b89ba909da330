"""Next-token pretraining on packed rows: the loss, the jitted step, an eval step and the loop.

Shape suffixes: B batch, T time, V vocab, L MoE layers, E experts.

The step is one pure function `train_step(state, batch) -> (state, metrics)`, jitted once with the
state donated and explicit in/out shardings. The loop dispatches step t before it reads step t-1's
metrics, so the host never waits on the device except to print.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from composer_jax import model, optim, sharding
from composer_jax.train import metrics as metrics_lib
from composer_jax.train.state import TrainState, replicated


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 200
  batch_size: int = 8  # divisible by replica·fsdp
  seq_len: int = 128  # divisible by context
  log_every: int = 10
  eval_every: int = 50
  eval_batches: int = 4  # fixed validation batches (the same ones every time)
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  router_bias_rate: float = 1e-3  # DeepSeek-V3 §2.1.2 bias update speed γ
  peak_flops: float = 180e9  # for MFU; ~2 XLA:CPU cores (notes/environment.md §7), set per accelerator
  grad_accum: int = 1  # micro-batches per step (batch_size/grad_accum divisible by replica·fsdp)


def next_token_loss(
  logits_BTV: jax.Array, tokens_BT: jax.Array, segment_ids_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(sum of -log p(next token), number of counted tokens).

  Position t predicts t+1 only inside one document: the next token must have the same segment id
  and not be padding (segment 0), so packing never teaches the model to predict across documents.
  """
  logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  target_BT = tokens_BT[:, 1:]
  nll_BT = -jnp.take_along_axis(logp_BTV, target_BT[..., None], axis=-1)[..., 0]
  seg_next_BT = segment_ids_BT[:, 1:]
  mask_BT = (seg_next_BT == segment_ids_BT[:, :-1]) & (seg_next_BT != 0)
  return jnp.sum(jnp.where(mask_BT, nll_BT, 0.0)), jnp.sum(mask_BT).astype(jnp.float32)


def loss_fn(
  params: Any,
  cfg: model.ModelConfig,
  batch: dict,
  meshes: sharding.Meshes | None,
  token_count: jax.Array | None = None,
  n_micro: int = 1,
):
  """next-token nll / token_count + α·balance loss / n_micro; returns (total, (nll sum, count, aux)).

  With the defaults this is the batch's mean loss. Gradient accumulation passes the token count of
  the whole batch and the number of micro-batches, so the summed micro-batch gradients are exactly
  the gradient of the whole batch's mean (not a mean of per-micro-batch means).
  """
  logits_BTV, aux = model.apply(
    params, cfg, batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"], meshes=meshes
  )
  total_nll, count = next_token_loss(logits_BTV, batch["tokens"], batch["segment_ids"])
  denom = count if token_count is None else token_count
  loss = total_nll / jnp.maximum(denom, 1.0) + cfg.router_aux_loss_coef * aux["balance_loss"] / n_micro
  return loss, (total_nll, count, aux)


def target_count(segment_ids_BT: jax.Array) -> jax.Array:
  """Tokens whose next token is counted by `next_token_loss` (same document, not padding)."""
  nxt = segment_ids_BT[:, 1:]
  return jnp.sum((nxt == segment_ids_BT[:, :-1]) & (nxt != 0)).astype(jnp.float32)


def batch_sharding(meshes: sharding.Meshes | None) -> Any:
  if meshes is None:
    return None
  s = sharding.activation_sharding(("batch", "seq"), meshes)
  return {"tokens": s, "segment_ids": s, "positions": s}


def global_batch(batch: dict, meshes: sharding.Meshes | None) -> dict:
  """A host batch {name: [B, T]} as arrays sharded like `batch_sharding`, on one or many processes.

  Every process packs the same whole batch (the packer is deterministic, so its checkpointed state
  is the same everywhere) and places only the shards of its own devices. `device_put` would instead
  all-gather the whole batch from every process each step to check that they agree. With one
  process this is `device_put`: same values, same shardings.
  """
  put = batch_sharding(meshes)
  if put is None:
    return jax.device_put(batch)
  host = {k: np.asarray(v) for k, v in batch.items()}
  return {k: jax.make_array_from_process_local_data(put[k], v, v.shape) for k, v in host.items()}


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _micro_batches(batch: dict, n: int) -> dict:
  """[B, T] → [n, B/n, T] taking rows i, i+n, i+2n… as micro-batch i.

  Strided rather than contiguous: a device holding a contiguous block of rows keeps holding a
  block of every micro-batch, so splitting moves no data between devices.
  """
  B = batch["tokens"].shape[0]
  if B % n:
    raise ValueError(f"batch_size {B} is not divisible by grad_accum {n}")
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(B // n, n, *x.shape[1:]), 0, 1), batch)


def grads_and_aux(
  params: Any,
  cfg: model.ModelConfig,
  batch: dict,
  meshes: sharding.Meshes | None,
  *,
  grad_accum: int = 1,
  grad_sharding: Any = None,
) -> tuple[Any, tuple[jax.Array, jax.Array, dict]]:
  """Gradient of the batch's mean loss and (nll sum, token count, aux), over `grad_accum`
  micro-batches run one after another (a scan: activations of one micro-batch live at a time)."""
  grad_fn = jax.grad(loss_fn, has_aux=True)
  if grad_accum == 1:
    return grad_fn(params, cfg, batch, meshes)
  token_count = target_count(batch["segment_ids"])
  put = batch_sharding(meshes)

  def body(acc, micro):
    if put is not None:
      micro = jax.lax.with_sharding_constraint(micro, put)
    g, (nll, count, aux) = grad_fn(params, cfg, micro, meshes, token_count, grad_accum)
    g_sum, nll_sum, count_sum, load, overflow, balance, max_logit = acc
    g_sum = jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_sum, g)
    if grad_sharding is not None:
      g_sum = jax.lax.with_sharding_constraint(g_sum, grad_sharding)
    acc = (
      g_sum,
      nll_sum + nll,
      count_sum + count,
      load + aux["expert_load"],
      overflow + aux["overflow"],
      balance + aux["balance_loss"] / grad_accum,
      jnp.maximum(max_logit, aux["max_logit"]),
    )
    return acc, None

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  if grad_sharding is not None:
    zeros = jax.lax.with_sharding_constraint(zeros, grad_sharding)
  n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
  f32 = jnp.float32
  init = (
    zeros,
    jnp.zeros((), f32),
    jnp.zeros((), f32),
    jnp.zeros((n_moe, cfg.n_experts), f32),
    jnp.zeros((), f32),
    jnp.zeros((), f32),
    jnp.full((cfg.n_layers, cfg.n_heads), -jnp.inf, f32),
  )
  (g, nll, count, load, overflow, balance, max_logit), _ = jax.lax.scan(
    body, init, _micro_batches(batch, grad_accum)
  )
  g = jax.tree.map(lambda a, p: a.astype(p.dtype), g, params)
  aux = {"expert_load": load, "overflow": overflow, "balance_loss": balance, "max_logit": max_logit}
  return g, (nll, count, aux)


def _rms(tree: Any, labels: Any, label: str) -> jax.Array:
  """RMS over all entries of the leaves labelled `label` (0 when there are none)."""
  leaves = [x for x, lab in zip(jax.tree.leaves(tree), jax.tree.leaves(labels), strict=True) if lab == label]
  if not leaves:
    return jnp.zeros((), jnp.float32)
  sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
  return jnp.sqrt(sq / sum(x.size for x in leaves))


def make_train_step(
  cfg: model.ModelConfig,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  state_sharding: Any,
  meshes: sharding.Meshes | None,
  *,
  router_bias_rate: float,
  grad_accum: int = 1,
  qk_clip_tau: float = 0.0,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """The jitted step. A non-finite loss or gradient keeps the old params and optimizer state.

  `lr` is the schedule at `state.step`; it equals the applied lr while no step was skipped
  (a skipped step does not advance the optimizer's own counter). `qk_clip_tau` > 0 applies
  QK-clip after the update with the max logits of this step's forward pass (Kimi K2 MuonClip).
  Update RMS is reported per optimizer branch (the applied update: lr, scaling and decay included).
  """
  if grad_accum < 1:
    raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
  trainable = model.trainable_mask(cfg)
  branch = optim.labels(cfg)
  grad_sharding = None if state_sharding is None else state_sharding.params

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    grads, (nll, count, aux) = grads_and_aux(
      state.params, cfg, batch, meshes, grad_accum=grad_accum, grad_sharding=grad_sharding
    )
    ce = nll / jnp.maximum(count, 1.0)
    grad_norm = optax.tree.norm(jax.tree.map(lambda g, t: g if t else jnp.zeros(()), grads, trainable))
    ok = jnp.isfinite(ce) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Aux-loss-free balancing: move the router bias by the load of this batch, outside the gradient.
    params = model.update_router_bias(params, aux["expert_load"], router_bias_rate)
    max_logit_LH = aux["max_logit"]
    if qk_clip_tau > 0:
      params = optim.qk_clip(params, max_logit_LH, cfg, qk_clip_tau)
    new = TrainState(
      step=state.step + 1,
      params=_select(ok, params, state.params),
      opt_state=_select(ok, opt_state, state.opt_state),
    )
    load_LE = aux["expert_load"].astype(jnp.float32)
    imbalance = (
      jnp.max(load_LE.max(-1) / jnp.maximum(load_LE.mean(-1), 1e-9)) if load_LE.size else jnp.zeros(())
    )
    out = {
      "loss": ce,
      "balance_loss": aux["balance_loss"],
      "grad_norm": grad_norm,
      "lr": jnp.asarray(schedule(state.step), jnp.float32),
      "tokens": count,
      "expert_load_max_over_mean": imbalance,
      "overflow": jnp.asarray(aux["overflow"], jnp.float32),
      "max_attention_logit": jnp.max(max_logit_LH),
      "qk_clipped_heads": jnp.sum(max_logit_LH > qk_clip_tau).astype(jnp.float32)
      if qk_clip_tau > 0
      else jnp.zeros(()),
      "muon_update_rms": _rms(updates, branch, "muon"),
      "adam_update_rms": _rms(updates, branch, "adam"),
      "skipped": 1 - ok.astype(jnp.int32),
    }
    return new, out

  rep = replicated(meshes)
  return jax.jit(
    train_step,
    in_shardings=(state_sharding, batch_sharding(meshes)),
    out_shardings=(state_sharding, rep),
    donate_argnums=0,
  )


def make_eval_step(cfg: model.ModelConfig, params_sharding: Any, meshes: sharding.Meshes | None):
  """Jitted (sum of nll, token count) of one batch: summed over batches for a token-weighted mean."""

  def eval_step(params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    logits_BTV, _ = model.apply(
      params, cfg, batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"], meshes=meshes
    )
    return next_token_loss(logits_BTV, batch["tokens"], batch["segment_ids"])

  rep = replicated(meshes)
  return jax.jit(eval_step, in_shardings=(params_sharding, batch_sharding(meshes)), out_shardings=(rep, rep))


def evaluate(eval_step: Callable, params: Any, eval_batches: list[dict]) -> float:
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


def fit(
  state: TrainState,
  train_step: Callable,
  eval_step: Callable,
  train_iter: Iterator[dict],
  eval_batches: list[dict],
  tcfg: TrainConfig,
  *,
  meshes: sharding.Meshes | None,
  writer: metrics_lib.MetricsWriter,
  save: Callable[[TrainState, dict, bool], None] | None = None,
  flops_per_token: float = 0.0,
  log: Callable[[str], None] = print,
) -> tuple[TrainState, dict]:
  """Trains from `state.step` to `tcfg.steps`; returns (state, summary).

  `save(state, data_state, force)` is called every `checkpoint_every` steps and at the end, with
  the iterator state right after the last dispatched step's batch (so a resume sees the next batch).
  Ctrl-C stops after the step in flight, saves, and returns with `interrupted=True` in the summary.
  """
  start = int(state.step)
  history: dict[str, list] = {"train": [], "validation": []}
  pending: tuple[int, dict, float] | None = None
  t_start, tokens_seen, interrupted, skipped = time.perf_counter(), 0.0, False, 0
  window = [t_start, 0.0]  # (time, tokens_seen) at the last progress line: tok/s of recent steps
  first_done: list[float] = []  # when the first step (compile included) finished
  data_state = train_iter.get_state()

  def drain(item: tuple[int, dict, float]) -> None:
    nonlocal tokens_seen, skipped
    step, m, t_dispatch = item
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    dt = time.perf_counter() - t_dispatch
    tokens_seen += m["tokens"]
    skipped += int(m["skipped"])
    history["train"].append((step, m["loss"]))
    now = time.perf_counter()
    first_done.append(now)
    if step % tcfg.log_every == 0 or step == tcfg.steps:
      elapsed = now - t_start
      tok_s = (tokens_seen - window[1]) / max(now - window[0], 1e-9)
      window[:] = [now, tokens_seen]
      m |= {"tokens_per_s": tok_s, "mfu": flops_per_token * tok_s / tcfg.peak_flops, "skipped_total": skipped}
      writer.write(step, m)
      eta = (tcfg.steps - step) * elapsed / max(step - start, 1)
      log(
        f"{_bar(step, tcfg.steps)} step {step}/{tcfg.steps} loss {m['loss']:.4f} gnorm {m['grad_norm']:.3f} "
        f"lr {m['lr']:.2e} {tok_s:,.0f} tok/s mfu {m['mfu']:.1%} step {dt:.2f}s eta {eta:.0f}s"
        + (f" skipped {skipped}" if skipped else "")
      )

  if start == 0 and eval_batches:  # the untrained model's validation loss: the curve's origin
    history["validation"].append((0, evaluate(eval_step, state.params, eval_batches)))
    writer.write(0, {"validation_loss": history["validation"][0][1]})
    log(f"step 0: validation loss {history['validation'][0][1]:.4f}")
  try:
    for step in range(start + 1, tcfg.steps + 1):
      batch = global_batch(next(train_iter), meshes)
      t0 = time.perf_counter()
      state, m = train_step(state, batch)  # dispatched; runs while the previous metrics are read
      data_state = train_iter.get_state()
      if pending is not None:
        drain(pending)
      pending = (step, m, t0)
      if step % tcfg.eval_every == 0 or step == tcfg.steps:
        drain(pending)
        pending = None
        val = evaluate(eval_step, state.params, eval_batches)
        history["validation"].append((step, val))
        writer.write(step, {"validation_loss": val})
        log(f"step {step}: validation loss {val:.4f}")
      if save is not None and step % tcfg.checkpoint_every == 0:
        save(state, data_state, False)
  except KeyboardInterrupt:
    interrupted = True
    log(f"interrupted at step {int(state.step)}: saving a final checkpoint")
  if pending is not None:
    drain(pending)
  if save is not None:
    save(state, data_state, True)
  writer.flush()
  elapsed = time.perf_counter() - t_start
  train, val = history["train"], history["validation"]
  summary = {
    "start_step": start,
    "steps": int(state.step),
    "interrupted": interrupted,
    "skipped_steps": skipped,
    "first_train_loss": train[0][1] if train else None,
    "last_train_loss": train[-1][1] if train else None,
    "first_validation_loss": val[0][1] if val else None,
    "last_validation_loss": val[-1][1] if val else None,
    "train_losses": [loss for _, loss in train],
    "validation_losses": val,
    "seconds": elapsed,
    "tokens_per_s": tokens_seen / max(elapsed, 1e-9),
    # wall time per step after the first (compilation) step, evaluation and checkpoints included
    "seconds_per_step": (first_done[-1] - first_done[0]) / max(len(first_done) - 1, 1)
    if first_done
    else None,
  }
  return state, summary


def _bar(step: int, total: int, width: int = 20) -> str:
  done = int(width * step / max(total, 1))
  return "[" + "#" * done + "." * (width - done) + "]"


def fixed_batches(it: Iterator[dict], n: int, meshes: sharding.Meshes | None) -> list[dict]:
  """The first `n` batches of an iterator, on device (validation uses the same ones each time)."""
  out = []
  for batch in it:
    out.append(global_batch(batch, meshes))
    if len(out) == n:
      break
  return out
