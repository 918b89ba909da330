"""The RL loss: the policy-gradient objective over every model token, plus targeted feedback.

Shape suffixes: B batch (rollouts), T time (trajectory tokens), F flagged rows, L teacher tokens
(hint + turn), N tokens of the flagged turn, V vocab.

loss = (RL sum + λ · feedback sum) / RL count: both sums reduced the policy objective's way
(`objectives.on_objective_scale`), so λ is an exchange rate. Each term over its own count would make
one flagged token weigh as much as hundreds of RL tokens and let feedback swamp the policy gradient.
- RL: `policy_loss(logp, sg(logp), adv, mask, objective, sampler_logp)` — one update per batch, so π_old
  is the trainer's own recompute (ratio 1, clip fraction 0) and the sampler/trainer mismatch is corrected
  by truncated IS against the sampler's logprobs (the raw T=1 model logprobs the sampler recorded).
- Feedback: at most one turn per trajectory (the first one `feedback.detect` flags: the earliest
  mistake is the one that derails the rest). Teacher: frozen (the weights RL started from) or EMA, which
  encode the flagged rows' prefix themselves, or live (the current weights = the policy at rollout time),
  which reuses the student's KV cache. Either way student slots at positions ≥ the turn's start are
  hidden (segment id 0), then `sampler.extend` appends hint + turn k's tokens. Teacher logits at column j
  predict teacher token j+1; they are gathered onto the student's columns t = p - 1 for each sampled token
  p of turn k (column p - 1 + |hint| - start in the teacher's extension).
- Tokens: turn k's sampled tokens up to and including the first where log p − log q > τ
  (`first_divergence`); per-token divergence capped at `feedback_clip` nats (`divergence.token_divergence`).
  Loss form: that divergence; advantage form: λ·clip(sg(log q − log p)) added to those tokens' advantages.
- A batch with no detected turn contributes exactly 0 through the feedback term (or takes the step
  without the teacher).
- Arm "penalty" (`flag_penalty` > 0, `batch.flagged`): the same first flagged turn's sampled tokens get
  −flag_penalty added to their advantage: localisation without text or teacher. Arm "distill"
  (`policy_gradient` False): the advantages are 0, so only the feedback term trains (rewards unused).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from composer_jax import model, sharding
from composer_jax.configs import RLConfig
from composer_jax.rl import sampler
from composer_jax.rl.batch import RLBatch
from composer_jax.rl.divergence import token_divergence
from composer_jax.rl.objectives import (
  advantages,
  groups_with_signal,
  on_objective_scale,
  policy_loss,
  policy_metrics,
)
from composer_jax.train.losses import chunked_token_logp
from composer_jax.train.step import LossAux


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The few static numbers the RL loss reads (a static jit argument: only these recompile the step)."""

  objective: str = "drgrpo"  # rl.objectives.OBJECTIVES
  advantage: str = "drgrpo"  # rl.objectives.ADVANTAGES
  tis_cap: float = 2.0
  max_len: int = 64  # Dr. GRPO's constant normaliser: the rollout's token budget (turns x tokens per turn)
  dynamic_sampling: bool = False
  routing_replay: bool = False
  lambda_feedback: float = 0.0
  feedback_mode: str = "loss"
  divergence: str = "forward_kl"
  divergence_top_k: int = 0
  feedback_tokens: str = "first_divergence"
  divergence_threshold: float = 1.0
  feedback_clip: float = 2.0
  live_teacher: bool = False  # the teacher is the current weights (reuses the student's prefix KV)
  flag_penalty: float = 0.0
  policy_gradient: bool = True

  @classmethod
  def of(cls, rcfg: RLConfig) -> LossSettings:
    """The settings of an `rl` config section."""
    same = {f.name: getattr(rcfg, f.name) for f in dataclasses.fields(cls) if hasattr(rcfg, f.name)}
    return cls(**same, max_len=rcfg.max_turns * rcfg.max_turn_tokens, live_teacher=rcfg.teacher == "live")


def student_forward(
  params: Any,
  cfg: model.ModelConfig,
  rows: tuple[jax.Array, jax.Array, jax.Array],
  extra_slots: int,
  routed_experts: jax.Array | None = None,
  meshes: sharding.Meshes | None = None,
) -> tuple[jax.Array, dict]:
  """The training forward over padded trajectories (tokens, positions, segment ids), with a cache of
  T + extra_slots slots that holds every position's latents afterwards (aux["cache"]). Logits equal the
  cache-free forward. routed_experts: the routing to replay, in `model.apply`'s layout."""
  tokens_BT, pos_BT, seg_BT = rows
  B, T = tokens_BT.shape
  cache = model.init_cache(cfg, B, T + extra_slots)
  return model.apply(
    params, cfg, tokens_BT, pos_BT, cache, segment_ids=seg_BT, routed_experts=routed_experts, meshes=meshes
  )


def replayed_experts(batch: RLBatch, ls: LossSettings) -> jax.Array | None:
  """The sampler's experts as `model.apply(routed_experts=)` takes them, [L_moe, B, T, K]; None
  unless routing_replay (R3, arXiv 2510.11370: the training forward uses the inference engine's
  experts; the router still learns through the combine weights)."""
  if not ls.routing_replay:
    return None
  if batch.routed_experts is None:
    raise ValueError("routing_replay needs batch.routed_experts (collect with routing_replay=True).")
  return jnp.moveaxis(jnp.asarray(batch.routed_experts), 2, 0)


_CACHE_BATCH_AXIS = {"positions": 0, "segments": 0, "latent": 1, "k_rope": 1}  # model.init_cache's layout


def cache_rows(cache: dict, rows: jax.Array) -> dict:
  """The cache of the given batch rows; the shared write index is unchanged."""
  return {k: v if k == "index" else jnp.take(v, rows, axis=_CACHE_BATCH_AXIS[k]) for k, v in cache.items()}


def teacher_logits(
  params: Any,
  cfg: model.ModelConfig,
  student_cache: dict | None,
  batch: RLBatch,
  teacher_params: Any = None,
  meshes: sharding.Meshes | None = None,
) -> jax.Array:
  """Teacher logits [F, N, V] of the flagged rows, aligned with `fb_cols` (meaningful where fb_mask is 1).

  Live teacher (`teacher_params` None): the current weights with the student's prefix KV of those rows
  (stop-gradient) — the prefix is never recomputed. EMA teacher: other weights, so it encodes the rows
  itself first. Then student slots at positions ≥ hint_start are hidden (segment 0) and hint + turn k's
  tokens are appended at the cache's write index (position hint_start onwards, which `sampler.extend`
  derives from the visible slots)."""
  rows_F = batch.feedback.fb_rows
  T, L = batch.tokens.shape[1], batch.feedback.teacher_tokens.shape[1]
  if teacher_params is None:
    params = jax.lax.stop_gradient(params)
    cache = cache_rows(jax.lax.stop_gradient(student_cache), rows_F)
  else:
    params = jax.lax.stop_gradient(teacher_params)
    rows = tuple(x[rows_F] for x in (batch.tokens, batch.positions, batch.segment_ids))
    _, aux = student_forward(params, cfg, rows, L, meshes=meshes)
    cache = aux["cache"]
  slot_S = jnp.arange(cache["segments"].shape[1])
  hide_FS = (slot_S[None, :] >= batch.feedback.hint_start[:, None]) & (slot_S[None, :] < T)
  cache = {**cache, "segments": jnp.where(hide_FS, sampler.PAD_SEGMENT, cache["segments"])}
  fb = batch.feedback
  logits_FLV, _ = sampler.extend(params, cfg, cache, fb.teacher_tokens, fb.teacher_lengths, meshes=meshes)
  aligned_FNV = jnp.take_along_axis(logits_FLV, batch.feedback.teacher_cols[:, :, None], axis=1)
  return jax.lax.stop_gradient(aligned_FNV)


def student_feedback_logits(
  params: Any, cfg: model.ModelConfig, hidden_BTD: jax.Array, batch: RLBatch
) -> jax.Array:
  """The student's logits at the feedback columns, [F, N, V] (differentiable), from the head's input.

  Each trajectory has at most one flagged turn, so every batch row first takes its own columns (a
  gather within the row), and only those [B, N, D] states move to the teacher rows before the head
  runs (padding teacher rows read row 0's, masked out by fb_mask). Gathering rows of the [B, T, V]
  logits instead makes XLA replicate them on every device: Moonlight's RL step (64 rollouts of 4096
  tokens on v5p:4x4x4) needed 148 GB of temporaries per chip."""
  fb, B = batch.feedback, hidden_BTD.shape[0]
  owner_F = jnp.where(fb.teacher_lengths > 0, fb.fb_rows, B)  # padding teacher rows (row 0) write nothing
  cols_BN = jnp.zeros((B, fb.fb_cols.shape[1]), jnp.int32).at[owner_F].set(fb.fb_cols, mode="drop")
  h_BND = jnp.take_along_axis(hidden_BTD, cols_BN[:, :, None], axis=1)
  return model.head(params, cfg, h_BND[fb.fb_rows])


def first_divergence(gap_FN: jax.Array, mask_FN: jax.Array, threshold: float) -> jax.Array:
  """bool [F, N]: turn k's tokens up to and including the first token whose gap log p − log q exceeds
  `threshold` (where the student's sampled token leaves what the teacher would say); none in a row where
  no token does (the teacher agrees with what was sampled: nothing to teach). Before that token the
  two agree, after it the teacher only scores how to continue a prefix it would not have written."""
  N = gap_FN.shape[1]
  idx_1N = jnp.arange(N)[None, :]
  hit_FN = (gap_FN > threshold) & (mask_FN > 0)
  first_F1 = jnp.min(jnp.where(hit_FN, idx_1N, N), axis=1, keepdims=True)
  return (mask_FN > 0) & (idx_1N <= first_F1) & (first_F1 < N)


def _scatter_BT(x_FN: jax.Array, like_BT: jax.Array, batch: RLBatch) -> jax.Array:
  """[F, N] values onto the batch's token positions (row fb_rows, token fb_cols + 1), 0 elsewhere."""
  return jnp.zeros_like(like_BT).at[batch.feedback.fb_rows[:, None], batch.feedback.fb_cols + 1].add(x_FN)


def feedback_advantages(
  t_logits_FNV: jax.Array,
  logp_BT: jax.Array,
  batch: RLBatch,
  lam: float,
  *,
  select_FN: jax.Array | None = None,
  clip: float | None = None,
) -> jax.Array:
  """λ·sg(log q(y_t) − log p(y_t)) on turn k's sampled tokens y_t (`select_FN`, default all of them),
  clipped to [−clip, clip] per token, 0 elsewhere, [B, T] aligned with tokens.

  The sampled-token form of the reverse KL's gradient (E_y~p[sg(log p − log q)·∇log p] = ∇KL(p‖q),
  the score-function identity; on-policy distillation's Â = A − λ(log p − log q)): as an advantage it
  shares the RL loss's normaliser and clip, so λ is an exchange rate. It only pushes the sampled token:
  it cannot raise a token the student never samples (at p(y) ≈ 1, ∇log p(y) ≈ 0)."""
  rows_F1, tok_FN = batch.feedback.fb_rows[:, None], batch.feedback.fb_cols + 1
  y_FN = batch.tokens[rows_F1, tok_FN]
  logq_FN = jnp.take_along_axis(jax.nn.log_softmax(t_logits_FNV.astype(jnp.float32), -1), y_FN[..., None], -1)
  logp_FN = jax.lax.stop_gradient(logp_BT)[rows_F1, tok_FN]
  delta_FN = logq_FN[..., 0] - logp_FN
  if clip is not None:
    delta_FN = jnp.clip(delta_FN, -clip, clip)
  sel_FN = batch.feedback.fb_mask > 0 if select_FN is None else select_FN
  return jax.lax.stop_gradient(_scatter_BT(jnp.where(sel_FN, lam * delta_FN, 0.0), logp_BT, batch))


def feedback_terms(
  s_logits_FNV: jax.Array, t_logits_FNV: jax.Array, logp_BT: jax.Array, batch: RLBatch, ls: LossSettings
) -> tuple[jax.Array, jax.Array, dict]:
  """(per-token divergence [B, T] for the loss form, feedback advantage [B, T] for the advantage form,
  metrics) on the tokens `ls.feedback_tokens` selects, clipped per token at `ls.feedback_clip`."""
  rows_F1, tok_FN = batch.feedback.fb_rows[:, None], batch.feedback.fb_cols + 1
  y_FN = batch.tokens[rows_F1, tok_FN]
  logq_FN = jnp.take_along_axis(jax.nn.log_softmax(t_logits_FNV.astype(jnp.float32), -1), y_FN[..., None], -1)
  gap_FN = jax.lax.stop_gradient(logp_BT[rows_F1, tok_FN] - logq_FN[..., 0])
  turn_FN = batch.feedback.fb_mask > 0
  sel_FN = turn_FN
  if ls.feedback_tokens == "first_divergence":
    sel_FN = first_divergence(gap_FN, batch.feedback.fb_mask, ls.divergence_threshold)
  clip = ls.feedback_clip if ls.feedback_clip > 0 else None
  top_k = ls.divergence_top_k or None
  d_FN = token_divergence(s_logits_FNV, t_logits_FNV, sel_FN, kind=ls.divergence, top_k=top_k, clip=clip)
  adv_BT = feedback_advantages(t_logits_FNV, logp_BT, batch, ls.lambda_feedback, select_FN=sel_FN, clip=clip)
  n_sel = jnp.sum(sel_FN).astype(jnp.float32)
  m = {
    "feedback_kl": (jax.lax.stop_gradient(jnp.sum(d_FN)), n_sel),
    "feedback_selected": (n_sel, jnp.sum(turn_FN).astype(jnp.float32)),
    "feedback_gap": (jnp.sum(jnp.where(sel_FN, gap_FN, 0.0)), n_sel),
  }
  return _scatter_BT(d_FN, logp_BT, batch), adv_BT, m


def whole_batch_terms(batch: RLBatch, ls: LossSettings) -> RLBatch:
  """The batch with the terms that need every rollout of the update: the group-relative advantages
  `advantages` [B] (a group's rollouts may sit in different micro-batches) and `keep` [B], the rollouts in
  the policy loss (DAPO's dynamic sampling drops groups without signal; a row with a teacher row or, for
  arm "penalty", flagged tokens stays). The step computes them before it splits the batch."""
  adv_B = advantages(batch.rewards, batch.group_ids, kind=ls.advantage)
  if not ls.policy_gradient:
    adv_B = jnp.zeros_like(adv_B)
  keep_B = jnp.ones_like(adv_B, dtype=bool)
  if ls.dynamic_sampling:
    keep_B = groups_with_signal(batch.rewards, batch.group_ids)
  fb = batch.feedback
  if fb is not None:  # a flagged row carries feedback even when its group's rewards are all equal
    n = (
      batch.micro_batches
    )  # teacher row q belongs to micro-batch q % n, whose row j is batch row j·n + q % n
    rows_F = fb.fb_rows * n + jnp.arange(fb.fb_rows.shape[0]) % n
    keep_B = keep_B | jnp.zeros_like(keep_B).at[rows_F].max(fb.teacher_lengths > 0)
  if batch.flagged is not None and ls.flag_penalty > 0:
    keep_B = keep_B | jnp.any(batch.flagged > 0, axis=1)
  return batch.replace(advantages=adv_B.astype(jnp.float32), keep=keep_B.astype(jnp.float32))


def policy_count(batch: RLBatch, ls: LossSettings) -> jax.Array:
  """The policy objective's normaliser of a whole batch (`whole_batch_terms` applied): what every
  micro-batch's sum is divided by, so the accumulated gradient is the whole batch's."""
  mask_BT = batch.loss_mask * batch.keep[:, None]
  return on_objective_scale(jnp.zeros_like(mask_BT), mask_BT, objective=ls.objective, max_len=ls.max_len)[1]


def rl_loss(
  params: Any,
  batch: RLBatch,
  teacher_params: Any = None,
  *,
  cfg: model.ModelConfig,
  ls: LossSettings,
  meshes: sharding.Meshes | None = None,
) -> tuple[jax.Array, LossAux]:
  """(RL sum + λ · feedback sum, LossAux(RL count, metrics as (sum, count) pairs, model aux)): the loss
  is their ratio (`train.step`). The feedback term is computed when the batch carries teacher inputs
  (`batch.feedback`); `teacher_params`: a frozen or EMA teacher (None: live, the current weights).
  `batch` is the whole update or one micro-batch of it with `whole_batch_terms` already applied. With
  `cfg.loss_chunk` the head and log-softmax run on chunks of columns (`losses.chunked_token_logp`)."""
  if batch.advantages is None:
    batch = whole_batch_terms(batch, ls)
  routed = replayed_experts(batch, ls)
  rows = (batch.tokens, batch.positions, batch.segment_ids)
  fb = batch.feedback
  if fb is not None and ls.live_teacher:  # the live teacher extends the student's own KV cache
    _, aux = student_forward(params, cfg, rows, fb.teacher_tokens.shape[1], routed, meshes)
  else:
    _, aux = model.apply(
      params, cfg, *rows[:2], segment_ids=batch.segment_ids, routed_experts=routed, meshes=meshes
    )
  head = functools.partial(model.head, params, cfg)
  logp_BT, ent_BT = chunked_token_logp(aux["hidden"], head, batch.tokens, cfg.loss_chunk)
  adv_B, keep_B = batch.advantages, batch.keep > 0
  adv, fb_BT = adv_B, jnp.zeros_like(logp_BT)
  zero, share = jnp.zeros((), jnp.float32), jnp.asarray(1.0 / batch.micro_batches, jnp.float32)
  m = {"feedback_kl": (zero, zero), "feedback_tokens": (zero, share)}  # per update, summed over micro-batches
  if fb is not None:
    t_logits_FNV = teacher_logits(params, cfg, aux.get("cache"), batch, teacher_params, meshes)
    s_logits_FNV = student_feedback_logits(params, cfg, aux["hidden"], batch)
    fb_BT, fb_adv_BT, m_fb = feedback_terms(s_logits_FNV, t_logits_FNV, logp_BT, batch, ls)
    m |= m_fb | {"feedback_tokens": (m_fb["feedback_kl"][1], share)}
    if ls.feedback_mode == "advantage":
      adv, fb_BT = adv_B[:, None] + fb_adv_BT, jnp.zeros_like(fb_BT)
      m["feedback_advantage"] = (jnp.sum(fb_adv_BT), m["feedback_kl"][1])
  if batch.flagged is not None and ls.flag_penalty > 0:
    adv, pen_BT = penalized(adv, batch.flagged, ls.flag_penalty)
    m["flag_penalty"] = (jnp.sum(pen_BT), jnp.sum(batch.flagged > 0).astype(jnp.float32))
  mask_BT = batch.loss_mask * keep_B[:, None]
  kw = dict(objective=ls.objective, sampler_logp=batch.sampler_logprobs, tis_cap=ls.tis_cap)
  pl_sum, pl_count = policy_loss(
    logp_BT, jax.lax.stop_gradient(logp_BT), adv, mask_BT, max_len=ls.max_len, **kw
  )
  # The feedback term on the policy objective's scale: the same reduction and the same count.
  fb_sum, _ = on_objective_scale(fb_BT, mask_BT, objective=ls.objective, max_len=ls.max_len)
  m |= policy_metrics(logp_BT, jax.lax.stop_gradient(logp_BT), adv, mask_BT, **kw)
  m |= _diagnostics(ent_BT, logp_BT, mask_BT, batch)
  m["feedback_loss"] = (jax.lax.stop_gradient(ls.lambda_feedback * fb_sum), pl_count)
  m["policy_loss"] = (jax.lax.stop_gradient(pl_sum), pl_count)
  m["advantage_abs"] = (jnp.sum(jnp.abs(adv_B)), jnp.asarray(adv_B.shape[0], jnp.float32))
  m["kept_rollouts"] = (jnp.sum(keep_B).astype(jnp.float32), jnp.asarray(adv_B.shape[0], jnp.float32))
  return pl_sum + ls.lambda_feedback * fb_sum, LossAux(jax.lax.stop_gradient(pl_count), m, aux)


def penalized(adv: jax.Array, flagged_BT: jax.Array, penalty: float) -> tuple[jax.Array, jax.Array]:
  """(advantages [B, T] with −penalty on the flagged tokens, the penalty [B, T]); `adv` is [B] or [B, T]."""
  pen_BT = penalty * flagged_BT.astype(jnp.float32)
  adv_BT = adv[:, None] if adv.ndim == 1 else adv
  return adv_BT - pen_BT, pen_BT


def _diagnostics(ent_BT: jax.Array, logp_BT: jax.Array, mask_BT: jax.Array, batch: RLBatch) -> dict:
  """Entropy of the policy (`ent_BT`, aligned with the tokens it predicts) and |sampler − trainer|
  log-prob gap on the trained tokens."""
  m_BT = mask_BT > 0
  n = jnp.sum(m_BT).astype(jnp.float32)
  gap_BT = jnp.abs(batch.sampler_logprobs - jax.lax.stop_gradient(logp_BT))
  return {
    "entropy": (jnp.sum(jnp.where(m_BT, ent_BT, 0.0)), n),
    "logp_abs_diff": (jnp.sum(jnp.where(m_BT, gap_BT, 0.0)), n),
  }
