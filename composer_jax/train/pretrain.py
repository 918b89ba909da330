"""Next-token pretraining on packed rows: the loss, the jitted step, an eval step and the loop's hooks.

Shape suffixes: B batch, T time, V vocab, L MoE layers, E experts.

The step is one pure function `train_step(state, batch) -> (state, metrics)`, jitted once with the
state donated and explicit in/out shardings; `fit` runs it in `train.loop` (the host reads step t-1's
metrics while step t runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from composer_jax import model, optim, sharding
from composer_jax.configs import TrainConfig
from composer_jax.train import loop
from composer_jax.train import metrics as metrics_lib
from composer_jax.train.losses import next_token_targets, target_count, target_loss
from composer_jax.train.state import TrainState, guarded_update, replicated


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
  total_nll, count, aux = forward_nll(params, cfg, batch, meshes)
  denom = count if token_count is None else token_count
  loss = total_nll / jnp.maximum(denom, 1.0) + cfg.router_aux_loss_coef * aux["balance_loss"] / n_micro
  return loss, (total_nll, count, aux)


def balance_shards(cfg: model.ModelConfig, meshes: sharding.Meshes | None) -> int:
  """How many context shards training rows are load-balanced over: the dense mesh's context degree
  with `cfg.context_load_balance`, else 1 (rows in natural order)."""
  return sharding.degrees(meshes).seq if cfg.context_load_balance and meshes is not None else 1


def forward_nll(params: Any, cfg: model.ModelConfig, batch: dict, meshes: sharding.Meshes | None):
  """(Σ next-token nll within documents, tokens counted, model aux) of a packed batch.

  With context load balancing (`balance_shards` > 1) tokens, positions, segment ids, next-token
  targets and their mask are all put in `sharding.balance_sequence` order before the model, so each
  context shard does equal causal attention work; the loss is a sum over columns, unchanged up to
  float order. The model sees the carried positions (RoPE, masks), never the column index.
  """
  shards = balance_shards(cfg, meshes)
  targets_BT, mask_BT = next_token_targets(batch["tokens"], batch["segment_ids"])
  columns = (batch["tokens"], batch["positions"], batch["segment_ids"], targets_BT, mask_BT)
  tokens_BT, pos_BT, seg_BT, targets_BT, mask_BT = (sharding.balance_sequence(x, shards) for x in columns)
  logits_BTV, aux = model.apply(
    params, cfg, tokens_BT, pos_BT, segment_ids=seg_BT, meshes=meshes, balanced=shards > 1
  )
  return (*target_loss(logits_BTV, targets_BT, mask_BT), aux)


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
  # A Python float: an int count past 2^31 (a 1T model's Muon leaves) would overflow int32 when traced.
  return jnp.sqrt(sq / float(sum(x.size for x in leaves)))


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
    max_logit_LH = aux["max_logit"]

    def after(params):
      # Aux-loss-free balancing: move the router bias by the load of this batch, outside the gradient.
      params = model.update_router_bias(params, aux["expert_load"], router_bias_rate)
      return optim.qk_clip(params, max_logit_LH, cfg, qk_clip_tau) if qk_clip_tau > 0 else params

    new, updates, grad_norm, ok = guarded_update(state, grads, ce, tx, after=after, trainable=trainable)
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
    return forward_nll(params, cfg, batch, meshes)[:2]

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
  train_iter: Any,
  eval_batches: list[dict],
  tcfg: TrainConfig,
  *,
  meshes: sharding.Meshes | None,
  writer: metrics_lib.MetricsWriter | None = None,
  save: Callable[[TrainState, dict, bool], None] | None = None,
  check: Callable[[], None] | None = None,
  flops_per_token: float = 0.0,
) -> tuple[TrainState, dict]:
  """Trains from `state.step` to `tcfg.steps` in `train.loop`; returns (state, summary).

  `save(state, data_state, final)` runs every `checkpoint_every` steps and at the end, with the data
  iterator's state right after the last dispatched batch (a resume sees the next batch). An interrupt
  saves and returns with `interrupted=True` in the summary.
  """
  data_state = [train_iter.get_state()]

  def next_batch(step: int, state: TrainState) -> tuple[dict, dict]:
    batch = global_batch(next(train_iter), meshes)
    data_state[0] = train_iter.get_state()
    return batch, {}

  def describe(r: dict) -> str:
    return (
      f"loss {r['loss']:.4f} gnorm {r['grad_norm']:.3f} lr {r['lr']:.2e} {r['tokens_per_s']:,.0f} tok/s "
      f"mfu {r['mfu']:.1%} step {r['step_s']:.2f}s"
    )

  hooks = loop.Hooks(
    next_batch=next_batch,
    describe=describe,
    annotate=lambda r: {"mfu": flops_per_token * r["tokens_per_s"] / tcfg.peak_flops},
    evaluate=(lambda st: {"validation_loss": evaluate(eval_step, st.params, eval_batches)})
    if eval_batches
    else None,
    save=None if save is None else lambda st, step, final: save(st, data_state[0], final),
    check=check,
    writer=writer,
    throughput_key="tokens",
  )
  schedule = loop.Schedule(
    tcfg.steps,
    tcfg.log_every,
    tcfg.eval_every,
    tcfg.checkpoint_every,
    max_skipped_in_a_row=tcfg.max_skipped_in_a_row,
  )
  state, r = loop.fit(state, train_step, schedule, hooks, name="pretrain")
  return state, _summary(r)


def _summary(r: loop.Result) -> dict:
  train = [(h["step"], h["loss"]) for h in r.history]
  val = [(e["step"], e["validation_loss"]) for e in r.evals]
  tokens = sum(h["tokens"] for h in r.history)
  return {
    "start_step": r.start_step,
    "steps": r.steps,
    "interrupted": r.interrupted,
    "skipped_steps": r.skipped_steps,
    "first_train_loss": train[0][1] if train else None,
    "last_train_loss": train[-1][1] if train else None,
    "first_validation_loss": val[0][1] if val else None,
    "last_validation_loss": val[-1][1] if val else None,
    "train_losses": [loss for _, loss in train],
    "validation_losses": val,
    "seconds": r.seconds,
    "tokens_per_s": tokens / max(r.seconds, 1e-9),
    "seconds_per_step": r.seconds_per_step,
  }


def fixed_batches(it: Iterator[dict], n: int, meshes: sharding.Meshes | None) -> list[dict]:
  """The first `n` batches of an iterator, on device (validation uses the same ones each time)."""
  out = []
  for batch in it:
    out.append(global_batch(batch, meshes))
    if len(out) == n:
      break
  return out
