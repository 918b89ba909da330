"""The one train step of every stage: a stage supplies its loss function and typed batch, this builds the
jitted, donated, guarded update on the two meshes (Levanter-style: the trainer owns the step).

Shape suffixes: L layers (MoE layers for the expert load), H heads, E experts.

  step = make_step(loss_fn, tx, cfg, schedule=optim.lr_schedule(ocfg), meshes=meshes,
                   state_sharding=state_shardings(state), router_bias_rate=1e-3)
  state, metrics = step(state, batch)                         # state donated; metrics are scalars

`loss_fn(params, batch, state) -> (numerator, LossAux)`: the loss is numerator / max(count, 1), with the
count carrying no gradient; the state is there for what a loss reads beside the params (the RL teacher
held in the optimizer state). Pretraining and SFT use `next_token_loss` (they differ only in the batch's
target mask), RL `rl.loss.rl_loss`. The step then does, the same for all: value_and_grad (over
`grad_accum` micro-batches if asked), the guarded optimizer update (a non-finite loss or gradient keeps the
old state), the router-bias move by this batch's expert load, QK-clip, and the standard metrics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from composer_jax import context_balance, model, optim, sharding
from composer_jax.train import batch as batch_lib
from composer_jax.train.losses import chunked_target_loss, next_token_targets, target_loss
from composer_jax.train.state import TrainState, guarded_update, replicated


class LossAux(NamedTuple):
  """What a loss function returns beside the numerator it is differentiated through."""

  count: jax.Array  # the normaliser: loss = numerator / max(count, 1); no gradient flows through it
  metrics: dict  # {name: (sum, count)}, reported as sum / max(count, 1); summed over micro-batches
  aux: dict  # the model's aux: expert_load [L_moe, E], overflow, balance_loss, max_logit [L, H]


LossFn = Callable[[Any, Any, TrainState], tuple[jax.Array, LossAux]]


# --- the next-token loss of pretraining and SFT --------------------------------------------------


def balance_shards(cfg: model.ModelConfig, meshes: sharding.Meshes | None) -> int:
  """How many context shards training rows are load-balanced over: the dense mesh's context degree
  with `cfg.context_load_balance`, else 1 (rows in natural order)."""
  return sharding.degrees(meshes).seq if cfg.context_load_balance and meshes is not None else 1


def forward_nll(
  params: Any, cfg: model.ModelConfig, batch: batch_lib.TokenBatch, meshes: sharding.Meshes | None
):
  """(Σ next-token nll over the trained targets, targets counted, model aux) of a packed batch.

  Targets: each column's next token inside its document, and only where `batch.target_mask` is set when
  it is given. With `cfg.loss_chunk` the head and loss run chunk by chunk (`losses.chunked_target_loss`).
  With context load balancing (`balance_shards` > 1) tokens, positions, segment ids, targets and their
  mask are all put in `context_balance.balance_sequence` order before the model, so each context shard
  does equal causal attention work; the loss is a sum over columns, unchanged up to float order.
  """
  shards = balance_shards(cfg, meshes)
  targets_BT, mask_BT = next_token_targets(batch.tokens, batch.segment_ids)
  if batch.target_mask is not None:
    mask_BT = mask_BT & (batch.target_mask > 0)
  columns = (batch.tokens, batch.positions, batch.segment_ids, targets_BT, mask_BT)
  tokens_BT, pos_BT, seg_BT, targets_BT, mask_BT = (
    context_balance.balance_sequence(x, shards) for x in columns
  )
  logits_BTV, aux = model.apply(
    params, cfg, tokens_BT, pos_BT, segment_ids=seg_BT, meshes=meshes, balanced=shards > 1
  )
  if cfg.loss_chunk:  # the logits above are then unused: XLA drops them
    head = functools.partial(model.head, params, cfg)
    return (*chunked_target_loss(aux["hidden"], head, targets_BT, mask_BT, cfg.loss_chunk), aux)
  return (*target_loss(logits_BTV, targets_BT, mask_BT), aux)


def next_token_loss(cfg: model.ModelConfig, meshes: sharding.Meshes | None) -> LossFn:
  """The loss of pretraining and SFT: mean next-token nll over the trained targets, plus
  α·(sequence-wise balance loss) (`cfg.router_aux_loss_coef`)."""

  def loss_fn(params: Any, batch: batch_lib.TokenBatch, state: TrainState) -> tuple[jax.Array, LossAux]:
    nll, count, aux = forward_nll(params, cfg, batch, meshes)
    numerator = nll + cfg.router_aux_loss_coef * aux["balance_loss"] * jax.lax.stop_gradient(count)
    one = jnp.ones((), jnp.float32)
    return numerator, LossAux(count, {"loss": (nll, count), "balance_loss": (aux["balance_loss"], one)}, aux)

  loss_fn.count = target_count  # the normaliser from the batch alone: what grad accumulation divides by
  return loss_fn


def target_count(batch: batch_lib.TokenBatch) -> jax.Array:
  """How many targets `forward_nll` counts in a batch (next tokens inside documents, target mask set)."""
  _, mask_BT = next_token_targets(batch.tokens, batch.segment_ids)
  if batch.target_mask is not None:
    mask_BT = mask_BT & (batch.target_mask > 0)
  return jnp.sum(mask_BT).astype(jnp.float32)


# --- gradients -------------------------------------------------------------------------------------


def _micro_batches(batch: Any, n: int) -> Any:
  """[B, ...] → [n, B/n, ...] taking rows i, i+n, i+2n… as micro-batch i: a device holding a contiguous
  block of rows keeps holding a block of every micro-batch, so splitting moves no data between devices."""

  def split(x):
    B = x.shape[0]
    if B % n:
      raise ValueError(f"batch of {B} rows is not divisible by grad_accum {n}")
    return jnp.swapaxes(x.reshape(B // n, n, *x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def _add_aux(acc: dict, aux: dict, n: int) -> dict:
  """Micro-batch aux folded into the batch's: loads and overflow add, balance loss averages, logits max."""
  return {
    "expert_load": acc["expert_load"] + aux["expert_load"],
    "overflow": acc["overflow"] + aux["overflow"],
    "balance_loss": acc["balance_loss"] + aux["balance_loss"] / n,
    "max_logit": jnp.maximum(acc["max_logit"], aux["max_logit"]),
  }


def gradients(
  loss_fn: LossFn, state: TrainState, batch: Any, *, grad_accum: int = 1, grad_sharding: Any = None,
  batch_sharding: Any = None,
) -> tuple[Any, jax.Array, LossAux]:  # fmt: skip
  """(gradient of the batch's loss, the loss, LossAux) — over `grad_accum` micro-batches run one after
  another when > 1 (a scan: one micro-batch's activations live at a time). There every micro-batch's
  numerator is divided by the whole batch's count (`loss_fn.count(batch)`, known before any forward), so
  the summed gradients are exactly the whole batch's mean, not a mean of micro-batch means.

  A batch may carry its own count (`micro_batches`, static: an RL batch arranged on the host for it), and
  a loss may need terms of the whole batch first (`loss_fn.whole_batch(batch)`, e.g. RL's group
  advantages, whose groups span micro-batches): they are computed before the split."""
  own = getattr(batch, "micro_batches", 1)
  if own > 1 and grad_accum > 1 and own != grad_accum:
    raise ValueError(f"the batch is arranged for {own} micro-batches, the step for grad_accum {grad_accum}")
  grad_accum = max(own, grad_accum)
  whole_batch = getattr(loss_fn, "whole_batch", None)
  if whole_batch is not None:
    batch = whole_batch(batch)
  if grad_accum == 1:
    count = None
  elif getattr(loss_fn, "count", None) is None:
    raise ValueError("grad_accum > 1 needs a loss whose count is known from the batch (loss_fn.count)")
  else:
    count = jnp.maximum(loss_fn.count(batch), 1.0)

  def mean(params, b, count):
    numerator, la = loss_fn(params, b, state)
    return numerator / (jnp.maximum(jax.lax.stop_gradient(la.count), 1.0) if count is None else count), la

  value_and_grad = jax.value_and_grad(mean, has_aux=True)
  if grad_accum == 1:
    (loss, la), grads = value_and_grad(state.params, batch, None)
    return grads, loss, la
  micro0 = jax.tree.map(lambda x: x[: x.shape[0] // grad_accum], batch)
  shapes = jax.eval_shape(value_and_grad, state.params, micro0, count)
  (_, la0), _ = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
  aux0 = {k: la0.aux[k] for k in ("expert_load", "overflow", "balance_loss")}
  la0 = la0._replace(aux=aux0 | {"max_logit": jnp.full_like(la0.aux["max_logit"], -jnp.inf)})
  g0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)

  def body(acc, micro):
    if batch_sharding is not None:
      micro = jax.lax.with_sharding_constraint(micro, batch_sharding)
    (loss, la), g = value_and_grad(state.params, micro, count)
    g_sum, loss_sum, la_sum = acc
    g_sum = jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_sum, g)
    if grad_sharding is not None:
      g_sum = jax.lax.with_sharding_constraint(g_sum, grad_sharding)
    metrics = jax.tree.map(jnp.add, la_sum.metrics, la.metrics)
    la_sum = LossAux(la_sum.count + la.count, metrics, _add_aux(la_sum.aux, la.aux, grad_accum))
    return (g_sum, loss_sum + loss, la_sum), None

  zero = jnp.zeros((), jnp.float32)
  (g_sum, loss, la), _ = jax.lax.scan(body, (g0, zero, la0), _micro_batches(batch, grad_accum))
  return jax.tree.map(lambda g, p: g.astype(p.dtype), g_sum, state.params), loss, la


# --- the step --------------------------------------------------------------------------------------


def _rms(tree: Any, labels: Any, label: str) -> jax.Array:
  """RMS over all entries of the leaves labelled `label` (0 when there are none)."""
  leaves = [x for x, lab in zip(jax.tree.leaves(tree), jax.tree.leaves(labels), strict=True) if lab == label]
  if not leaves:
    return jnp.zeros((), jnp.float32)
  sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
  # A Python float: an int count past 2^31 (a 1T model's Muon leaves) would overflow int32 when traced.
  return jnp.sqrt(sq / float(sum(x.size for x in leaves)))


def standard_metrics(aux: dict, qk_clip_tau: float) -> dict:
  """Expert balance, dropped assignments and attention-logit size of one step's forward pass."""
  load_LE = aux["expert_load"].astype(jnp.float32)
  imbalance = (
    jnp.max(load_LE.max(-1) / jnp.maximum(load_LE.mean(-1), 1e-9)) if load_LE.size else jnp.zeros(())
  )
  max_logit_LH = aux["max_logit"]
  clipped = jnp.sum(max_logit_LH > qk_clip_tau).astype(jnp.float32) if qk_clip_tau > 0 else jnp.zeros(())
  return {
    "expert_load_max_over_mean": imbalance,
    "overflow": jnp.asarray(aux["overflow"], jnp.float32),
    "max_attention_logit": jnp.max(max_logit_LH),
    "qk_clipped_heads": clipped,
  }


def make_step(
  loss_fn: LossFn,
  tx: optax.GradientTransformation,
  cfg: model.ModelConfig,
  *,
  schedule: optax.Schedule,
  meshes: sharding.Meshes | None = None,
  state_sharding: Any = None,
  batch_sharding: Any = None,
  router_bias_rate: float = 0.0,
  qk_clip_tau: float = 0.0,
  grad_accum: int = 1,
) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
  """The jitted step `(state, batch) -> (state, metrics)`, state donated.

  With `state_sharding` the state keeps its layout across steps (out_shardings); `batch_sharding` fixes
  the batch's (otherwise the placed batch's own shardings are used, so one jitted function serves batch
  types of several tree structures: the RL batch with and without its teacher inputs). `lr` is the
  schedule at `state.step`; it equals the applied lr while no step was skipped. `qk_clip_tau` > 0 applies
  QK-clip after the update with this step's max logits (Kimi K2 MuonClip). Update RMS is reported per
  optimizer branch (the applied update: lr, scaling and decay included).
  """
  if grad_accum < 1:
    raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
  trainable = model.trainable_mask(cfg)
  branch = optim.labels(cfg)
  grad_sharding = None if state_sharding is None else state_sharding.params

  def step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
    grads, loss, la = gradients(
      loss_fn, state, batch, grad_accum=grad_accum, grad_sharding=grad_sharding, batch_sharding=batch_sharding
    )
    aux = la.aux

    def after(params):
      # Aux-loss-free balancing: move the router bias by the load of this batch, outside the gradient.
      params = model.update_router_bias(params, aux["expert_load"], router_bias_rate)
      return optim.qk_clip(params, aux["max_logit"], cfg, qk_clip_tau) if qk_clip_tau > 0 else params

    new, updates, grad_norm, ok = guarded_update(state, grads, loss, tx, after=after, trainable=trainable)
    out = {
      "loss": loss,
      "tokens": la.count,
      "grad_norm": grad_norm,
      "lr": jnp.asarray(schedule(state.step), jnp.float32),
      "muon_update_rms": _rms(updates, branch, "muon"),
      "adam_update_rms": _rms(updates, branch, "adam"),
      "skipped": 1 - ok.astype(jnp.int32),
    }
    out |= standard_metrics(aux, qk_clip_tau)
    out |= {k: s / jnp.maximum(c, 1.0) for k, (s, c) in la.metrics.items()}
    return new, out

  if state_sharding is None:
    return jax.jit(step, donate_argnums=0)
  in_shardings = (state_sharding, batch_sharding) if batch_sharding is not None else None
  jit = functools.partial(jax.jit, in_shardings=in_shardings) if in_shardings else jax.jit
  return jit(step, out_shardings=(state_sharding, replicated(meshes)), donate_argnums=0)
