"""Token-level divergences between a student and a (stop-gradient) teacher distribution.

Shape suffixes: B batch, T time, V vocab, K top-k buckets (k kept tokens + 1 tail).

Used by targeted text feedback: the teacher is the same model with a hint inserted
before turn k, the student is the original context, and the loss is a per-token divergence on turn
k's tokens. Directions (KL(a‖b) = Σ a (log a - log b)):
  reverse_kl = KL(P_S‖P_T)  (mode seeking; SDFT/SDPO's reverse direction),
  forward_kl = KL(P_T‖P_S)  (mass covering; cross-entropy to the teacher + const),
  jsd        = β·KL(P_T‖M) + (1-β)·KL(P_S‖M), M = β·P_T + (1-β)·P_S (GKD, arXiv 2306.13649).
JSD_β → 0 at both ends (≈ β·KL(P_T‖P_S) near β=0, ≈ (1-β)·KL(P_S‖P_T) near β=1), so, as in GKD and
TRL's `generalized_jsd_loss`, the endpoints are defined as the limiting directions themselves:
β=0 is exactly forward_kl and β=1 exactly reverse_kl.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

KINDS = ("reverse_kl", "forward_kl", "jsd")
_TAIL_FLOOR = 1e-6  # the tail bucket's smallest mass: float32 1 - Σ p_k can round to 0 or below


def _kl(logp_a: jax.Array, logp_b: jax.Array) -> jax.Array:
  """KL(a‖b) over the last axis from log-probabilities; terms with a = 0 are exactly 0."""
  p_a = jnp.exp(logp_a)
  pos = p_a > 0
  diff = jnp.where(pos, logp_a - logp_b, 0.0)
  return jnp.sum(jnp.where(pos, p_a * diff, 0.0), axis=-1)


def _divergence(logp_s: jax.Array, logp_t: jax.Array, kind: str, beta: float) -> jax.Array:
  if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
    return _kl(logp_s, logp_t)
  if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
    return _kl(logp_t, logp_s)
  logp_m = jnp.logaddexp(logp_t + math.log(beta), logp_s + math.log(1.0 - beta))
  return beta * _kl(logp_t, logp_m) + (1.0 - beta) * _kl(logp_s, logp_m)


def _top_k_buckets(logp_s_BTV: jax.Array, logp_t_BTV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Student's top-k token ids; both distributions gathered there plus one tail bucket
  log(1 - Σ_k p) (floored), so each side is still a distribution over K = k + 1 buckets."""
  _, ids_BTk = jax.lax.top_k(jax.lax.stop_gradient(logp_s_BTV), k)

  def buckets(logp_BTV):
    logp_BTk = jnp.take_along_axis(logp_BTV, ids_BTk, axis=-1)
    mass_BT = jnp.sum(jnp.exp(logp_BTk), axis=-1)
    tail_BT = jnp.log(jnp.maximum(1.0 - mass_BT, _TAIL_FLOOR))
    return jnp.concatenate([logp_BTk, tail_BT[..., None]], axis=-1)

  return buckets(logp_s_BTV), buckets(logp_t_BTV)


def token_divergence(
  student_logits: jax.Array,
  teacher_logits: jax.Array,
  mask: jax.Array,
  *,
  kind: str = "reverse_kl",
  top_k: int | None = None,
  beta: float = 0.5,
  clip: float | None = None,
) -> jax.Array:
  """Per-token D(P_S,t, P_T,t) for logits [B, T, V] aligned token by token, [B, T]; exactly 0 (value and
  gradient) where mask is 0. The teacher is stop-gradient; both softmaxes run in float32.

  kind: "reverse_kl", "forward_kl" or "jsd" (with beta; see the module docstring). top_k: compare on the
  student's top-k token ids plus a tail bucket (SDPO's `add_tail`); None, or k >= V, uses the full
  vocabulary. clip: cap each token's value at `clip` by scaling it (and so its gradient) by
  sg(min(1, clip / D_t)) -- the direction is kept, no token weighs more than `clip` nats (per-token
  clipping as in SDPO/OPSD; a hard min would drop exactly the tokens that disagree most). None: off.
  """
  if kind not in KINDS:
    raise ValueError(f"unknown divergence kind {kind!r}; known: {', '.join(KINDS)}")
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"beta must lie in [0, 1], got {beta}")
  if top_k is not None and top_k < 1:
    raise ValueError(f"top_k must be a positive int or None, got {top_k}")
  if clip is not None and clip <= 0:
    raise ValueError(f"clip must be positive or None, got {clip}")
  m_BT = mask > 0
  m_BT1 = m_BT[..., None]
  # Zero the logits at masked positions first, so padding garbage (inf/NaN) never reaches the sum
  # or the gradient.
  s_BTV = jnp.where(m_BT1, student_logits.astype(jnp.float32), 0.0)
  t_BTV = jnp.where(m_BT1, jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), 0.0)
  logp_s = jax.nn.log_softmax(s_BTV, axis=-1)
  logp_t = jax.nn.log_softmax(t_BTV, axis=-1)
  if top_k is not None and top_k < s_BTV.shape[-1]:
    logp_s, logp_t = _top_k_buckets(logp_s, logp_t, top_k)
  d_BT = _divergence(logp_s, logp_t, kind, float(beta))
  if clip is not None:
    d_BT = d_BT * jax.lax.stop_gradient(jnp.minimum(1.0, clip / jnp.maximum(d_BT, 1e-12)))
  return jnp.where(m_BT, d_BT, 0.0)


def feedback_loss(
  student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array, **options: Any
) -> tuple[jax.Array, jax.Array]:
  """(Σ_t mask_t·D(P_S,t, P_T,t), Σ_t mask_t): `token_divergence` summed, with its token count;
  `options` are `token_divergence`'s (kind, top_k, beta, clip).

  The count is for reporting; the RL step puts the sum on the policy objective's normaliser
  (`rl.loss.rl_loss`), never on its own count (that made one flagged token weigh ~300 RL tokens)."""
  d_BT = token_divergence(student_logits, teacher_logits, mask, **options)
  return jnp.sum(d_BT), jnp.sum(mask > 0).astype(jnp.float32)
