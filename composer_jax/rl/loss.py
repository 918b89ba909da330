"""The RL loss: the policy-gradient objective over every model token, plus targeted feedback.

Shape suffixes: B batch (rollouts), T time (trajectory tokens), F flagged rows, L teacher tokens
(hint + turn), N tokens of the flagged turn, V vocab.

loss = RL loss / its count + λ · feedback loss / its count (notes/rl.md §5).
- RL: `policy_loss(logp, sg(logp), adv, mask, objective, sampler_logp)` — one update per batch, so π_old
  is the trainer's own recompute (ratio 1, clip fraction 0) and the sampler/trainer mismatch is corrected
  by truncated IS against the sampler's logprobs (the raw T=1 model logprobs the sampler recorded).
- Feedback: at most one turn per trajectory (the first one `feedback.detect` flags: the earliest
  mistake is the one that derails the rest). The student forward runs with a KV cache; the teacher reuses
  it: stop-gradient, slots at positions ≥ the turn's start hidden (segment id 0), then `sampler.extend`
  with hint + turn k's tokens. The teacher computes |hint| + |turn| tokens, not the whole prefix.
  Teacher logits at column j predict teacher token j+1; they are gathered onto the student's columns
  t = p - 1 for each sampled token p of turn k (column p - 1 + |hint| - start in the teacher's extension).
- A batch with no detected turn goes to the step without the teacher, where the term is exactly 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from composer_jax import model
from composer_jax.configs import RLConfig
from composer_jax.rl import sampler
from composer_jax.rl.divergence import feedback_loss
from composer_jax.rl.objectives import advantages, groups_with_signal, policy_loss, policy_metrics
from composer_jax.train.losses import token_logp


def student_forward(
  params: Any, cfg: model.ModelConfig, batch: dict, extra_slots: int, routed_experts: jax.Array | None = None
) -> tuple[jax.Array, dict]:
  """The training forward over the padded trajectories, with a cache of T + extra_slots slots that
  holds every position's latents afterwards (aux["cache"]). Logits equal the cache-free forward.
  routed_experts: the routing to replay, in `model.apply`'s layout (see `replayed_experts`)."""
  B, T = batch["tokens"].shape
  return model.apply(
    params,
    cfg,
    batch["tokens"],
    batch["positions"],
    model.init_cache(cfg, B, T + extra_slots),
    segment_ids=batch["segment_ids"],
    routed_experts=routed_experts,
  )


def replayed_experts(batch: dict, rcfg: RLConfig) -> jax.Array | None:
  """The sampler's experts as `model.apply(routed_experts=)` takes them, [L_moe, B, T, K]; None
  unless routing_replay (R3, arXiv 2510.11370: the training forward uses the inference engine's
  experts; the router still learns through the combine weights)."""
  if not rcfg.routing_replay:
    return None
  if "routed_experts" not in batch:
    raise ValueError("routing_replay needs batch['routed_experts'] (collect with routing_replay=True).")
  return jnp.moveaxis(jnp.asarray(batch["routed_experts"]), 2, 0)


_CACHE_BATCH_AXIS = {"positions": 0, "segments": 0, "latent": 1, "k_rope": 1}  # model.init_cache's layout


def cache_rows(cache: dict, rows: jax.Array) -> dict:
  """The cache of the given batch rows; the shared write index is unchanged."""
  return {k: v if k == "index" else jnp.take(v, rows, axis=_CACHE_BATCH_AXIS[k]) for k, v in cache.items()}


def teacher_logits(
  params: Any, cfg: model.ModelConfig, student_cache: dict, batch: dict, teacher_params: Any = None
) -> jax.Array:
  """Teacher logits [F, N, V] of the flagged rows, aligned with `fb_cols` (meaningful where fb_mask is 1).

  Live teacher (`teacher_params` None): the current weights with the student's prefix KV of those rows
  (stop-gradient) — the prefix is never recomputed. EMA teacher: other weights, so it encodes the rows
  itself first. Then student slots at positions ≥ hint_start are hidden (segment 0) and hint + turn k's
  tokens are appended at the cache's write index (position hint_start onwards, which `sampler.extend`
  derives from the visible slots)."""
  rows_F = batch["fb_rows"]
  T, L = batch["tokens"].shape[1], batch["teacher_tokens"].shape[1]
  if teacher_params is None:
    params = jax.lax.stop_gradient(params)
    cache = cache_rows(jax.lax.stop_gradient(student_cache), rows_F)
  else:
    params = jax.lax.stop_gradient(teacher_params)
    rows = {k: batch[k][rows_F] for k in ("tokens", "positions", "segment_ids")}
    _, aux = student_forward(params, cfg, rows, L)
    cache = aux["cache"]
  slot_S = jnp.arange(cache["segments"].shape[1])
  hide_FS = (slot_S[None, :] >= batch["hint_start"][:, None]) & (slot_S[None, :] < T)
  cache = {**cache, "segments": jnp.where(hide_FS, sampler.PAD_SEGMENT, cache["segments"])}
  logits_FLV, _ = sampler.extend(params, cfg, cache, batch["teacher_tokens"], batch["teacher_lengths"])
  aligned_FNV = jnp.take_along_axis(logits_FLV, batch["teacher_cols"][:, :, None], axis=1)
  return jax.lax.stop_gradient(aligned_FNV)


def student_feedback_logits(logits_BTV: jax.Array, batch: dict) -> jax.Array:
  """The student's logits at the feedback columns, [F, N, V] (differentiable)."""
  return logits_BTV[batch["fb_rows"][:, None], batch["fb_cols"]]


def feedback_advantages(t_logits_FNV: jax.Array, logp_BT: jax.Array, batch: dict, lam: float) -> jax.Array:
  """λ·sg(log q(y_t) − log p(y_t)) on turn k's sampled tokens y_t, 0 elsewhere, [B, T] aligned with tokens.

  The sampled-token form of the reverse KL's gradient (E_y~p[sg(log p − log q)·∇log p] = ∇KL(p‖q),
  notes/rl.md §1, on-policy distillation): as an advantage it shares the RL loss's normaliser and clip,
  so its weight against the policy gradient does not depend on how many tokens were flagged."""
  rows_F1, tok_FN = batch["fb_rows"][:, None], batch["fb_cols"] + 1
  y_FN = batch["tokens"][rows_F1, tok_FN]
  logq_FN = jnp.take_along_axis(jax.nn.log_softmax(t_logits_FNV.astype(jnp.float32), -1), y_FN[..., None], -1)
  logp_FN = jax.lax.stop_gradient(logp_BT)[rows_F1, tok_FN]
  delta_FN = jnp.where(batch["fb_mask"] > 0, lam * (logq_FN[..., 0] - logp_FN), 0.0)
  return jnp.zeros_like(logp_BT).at[rows_F1, tok_FN].add(jax.lax.stop_gradient(delta_FN))


def rl_loss(
  params: Any,
  cfg: model.ModelConfig,
  batch: dict,
  rcfg: RLConfig,
  with_feedback: bool,
  teacher_params: Any = None,
):
  """(total loss, metrics as (sum, count) pairs). `teacher_params`: the EMA teacher (None: live)."""
  mask_BT = batch["loss_mask"]
  if with_feedback:
    logits_BTV, aux = student_forward(
      params, cfg, batch, batch["teacher_tokens"].shape[1], replayed_experts(batch, rcfg)
    )
    t_logits_FNV = teacher_logits(params, cfg, aux["cache"], batch, teacher_params)
    top_k = rcfg.divergence_top_k or None
    fb_sum, fb_count = feedback_loss(
      student_feedback_logits(logits_BTV, batch),
      t_logits_FNV,
      batch["fb_mask"],
      kind=rcfg.divergence,
      top_k=top_k,
    )
  else:
    logits_BTV, aux = model.apply(
      params,
      cfg,
      batch["tokens"],
      batch["positions"],
      segment_ids=batch["segment_ids"],
      routed_experts=replayed_experts(batch, rcfg),
    )
    fb_sum = fb_count = jnp.zeros((), jnp.float32)
  logp_BT = token_logp(logits_BTV, batch["tokens"])
  adv_B = advantages(batch["rewards"], batch["group_ids"], kind=rcfg.advantage)
  adv, fb_weight = adv_B, rcfg.lambda_feedback
  keep_B = jnp.ones_like(adv_B, dtype=bool)
  if rcfg.dynamic_sampling:
    keep_B = groups_with_signal(batch["rewards"], batch["group_ids"])
  m = {}
  if with_feedback and rcfg.feedback_mode == "advantage":
    fb_adv_BT = feedback_advantages(t_logits_FNV, logp_BT, batch, rcfg.lambda_feedback)
    adv, fb_weight = adv_B[:, None] + fb_adv_BT, 0.0
    keep_B = keep_B | jnp.zeros_like(keep_B).at[batch["fb_rows"]].max(batch["teacher_lengths"] > 0)
    m["feedback_advantage"] = (jnp.sum(fb_adv_BT), fb_count)
  mask_BT = mask_BT * keep_B[:, None]
  kw = dict(objective=rcfg.objective, sampler_logp=batch["sampler_logprobs"], tis_cap=rcfg.tis_cap)
  max_len = rcfg.max_turns * rcfg.max_turn_tokens  # Dr. GRPO's constant normaliser: the token budget
  pl_sum, pl_count = policy_loss(logp_BT, jax.lax.stop_gradient(logp_BT), adv, mask_BT, max_len=max_len, **kw)
  loss = pl_sum / jnp.maximum(pl_count, 1.0) + fb_weight * fb_sum / jnp.maximum(fb_count, 1.0)
  m |= policy_metrics(logp_BT, jax.lax.stop_gradient(logp_BT), adv, mask_BT, **kw)
  m_BT = mask_BT > 0
  n = jnp.sum(m_BT).astype(jnp.float32)
  logp_all_BTV = jax.nn.log_softmax(jax.lax.stop_gradient(logits_BTV[:, :-1]).astype(jnp.float32), axis=-1)
  ent_BT = jnp.pad(-jnp.sum(jnp.exp(logp_all_BTV) * logp_all_BTV, axis=-1), ((0, 0), (1, 0)))
  m["entropy"] = (jnp.sum(jnp.where(m_BT, ent_BT, 0.0)), n)
  gap_BT = jnp.abs(batch["sampler_logprobs"] - jax.lax.stop_gradient(logp_BT))
  m["logp_abs_diff"] = (jnp.sum(jnp.where(m_BT, gap_BT, 0.0)), n)
  m["feedback_kl"] = (jax.lax.stop_gradient(fb_sum), fb_count)
  m["policy_loss"] = (jax.lax.stop_gradient(pl_sum), pl_count)
  m["advantage_abs"] = (jnp.sum(jnp.abs(adv_B)), jnp.asarray(adv_B.shape[0], jnp.float32))
  m["kept_rollouts"] = (jnp.sum(keep_B).astype(jnp.float32), jnp.asarray(adv_B.shape[0], jnp.float32))
  return loss, (m, aux)
