"""RL objectives as pure jnp functions: group advantages, clipped policy losses, DAPO shaping.

Shape suffixes: B batch (rollouts), T time (response tokens), G groups.

Every loss returns `(sum, count)`: the objective's numerator and its normaliser, both float32
scalars. Summing both over micro-batches and dividing once gives exactly the full batch's value, so
gradient accumulation never averages per-micro-batch means. The normaliser is what distinguishes
the objectives (GRPO arXiv 2402.03300, Dr.GRPO 2503.20783, DAPO 2503.14476):

| objective | per-token term                           | sum                          | count          |
|-----------|------------------------------------------|------------------------------|----------------|
| grpo      | -min(r·A, clip(r, 1-ε_l, 1+ε_h)·A)       | Σ_seq (token mean of seq)    | sequences      |
| drgrpo    | same                                     | Σ_seq (token sum / max_len)  | sequences      |
| dapo      | same (clip-higher ε_h 0.28)              | Σ over all tokens            | tokens         |
| cispo     | -sg(clip(r, 1-ε_l, 1+ε_h))·A·log π       | Σ over all tokens            | tokens         |
| gspo      | -min(s·A, clip(s, 1-ε_l, 1+ε_h)·A)       | Σ_seq (token mean of seq)    | sequences      |

r = π_θ/π_old per token, s = exp(mean_t log r) per sequence (GSPO-token form: per-token value s and
per-token gradient s·∇log π_t, identical to sequence GSPO when A is per sequence, and it also accepts
per-token advantages). "sequences" counts rows with at least one unmasked token, so all-padding rows
do not dilute the mean. The loss is to be minimised (it is the negated objective).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

_LOG_RATIO_CLAMP = 20.0


def _group_index(group_ids_B: jax.Array) -> jax.Array:
  """Arbitrary integer group ids → dense ids in [0, B) (a static number of segments, B)."""
  B = group_ids_B.shape[0]
  _, idx_B = jnp.unique(group_ids_B, return_inverse=True, size=B, fill_value=0)
  return idx_B.reshape(B)


def groups_with_signal(rewards_B: jax.Array, group_ids_B: jax.Array) -> jax.Array:
  """DAPO dynamic sampling (arXiv 2503.14476 §3.2): False for rollouts whose group's rewards are all
  equal (no learning signal: every advantage is zero), True otherwise. bool [B]."""
  B = rewards_B.shape[0]
  idx_B = _group_index(group_ids_B)
  r_B = rewards_B.astype(jnp.float32)
  hi_G = jax.ops.segment_max(r_B, idx_B, num_segments=B)
  lo_G = jax.ops.segment_min(r_B, idx_B, num_segments=B)
  return (hi_G > lo_G)[idx_B]


def _grpo(centred_B: jax.Array, n_B: jax.Array, idx_B: jax.Array, eps: float) -> jax.Array:
  B = centred_B.shape[0]
  var_B = jax.ops.segment_sum(centred_B * centred_B, idx_B, num_segments=B)[idx_B] / jnp.maximum(n_B - 1, 1)
  return centred_B / (jnp.sqrt(var_B) + eps)


# Group-relative advantage from the centred reward r - mean_g, the group size n and the group index.
ADVANTAGES: dict[str, Callable[..., jax.Array]] = {
  "grpo": _grpo,
  "drgrpo": lambda centred_B, n_B, idx_B, eps: centred_B,
  "rloo": lambda centred_B, n_B, idx_B, eps: centred_B * n_B / jnp.maximum(n_B - 1.0, 1.0),
}
ADVANTAGE_KINDS = tuple(ADVANTAGES)


def advantages(rewards_B: jax.Array, group_ids_B: jax.Array, *, kind: str, eps: float = 1e-6) -> jax.Array:
  """Per-rollout advantages from scalar rewards within groups (same prompt ⇒ same group id). [B].

  grpo:   (r - mean_g) / (std_g + eps), std with ddof=1 (DeepSeekMath, arXiv 2402.03300 §4.1.2;
          Tunix's ddof).
  drgrpo: r - mean_g (Dr. GRPO, arXiv 2503.20783: no std normalisation).
  rloo:   r - mean of the *other* members = n/(n-1)·(r - mean_g) (Ahmadian et al. 2024).
  Groups whose rewards are all equal (including singletons) get exactly 0.
  """
  if kind not in ADVANTAGES:
    raise ValueError(f"unknown advantage kind {kind!r}; known: {', '.join(ADVANTAGES)}")
  B = rewards_B.shape[0]
  idx_B = _group_index(group_ids_B)
  r_B = rewards_B.astype(jnp.float32)
  n_B = jax.ops.segment_sum(jnp.ones_like(r_B), idx_B, num_segments=B)[idx_B]
  mean_B = jax.ops.segment_sum(r_B, idx_B, num_segments=B)[idx_B] / jnp.maximum(n_B, 1.0)
  adv_B = ADVANTAGES[kind](r_B - mean_B, n_B, idx_B, eps)
  return jnp.where(groups_with_signal(rewards_B, group_ids_B), adv_B, 0.0)


def overlong_penalty(lengths_B: jax.Array, *, max_len: int, buffer: int, penalty: float = 1.0) -> jax.Array:
  """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13), added to the reward. float32 [B].

  0 up to max_len - buffer tokens, then linear down to -penalty at max_len, -penalty beyond.
  Lengths are in tokens (Tunix measures characters; tokens are what the budget limits).
  """
  if buffer <= 0:
    raise ValueError(f"buffer must be positive, got {buffer}")
  excess_B = lengths_B.astype(jnp.float32) - (max_len - buffer)
  return penalty * jnp.clip(-excess_B / buffer, -1.0, 0.0)


def _ppo_term(log_ratio_BT, logp_BT, adv_BT, m_BT, lo, hi):
  """PPO/GRPO clipped surrogate, negated: -min(r·A, clip(r, 1-ε_l, 1+ε_h)·A)."""
  ratio_BT = jnp.exp(log_ratio_BT)
  return -jnp.minimum(ratio_BT * adv_BT, jnp.clip(ratio_BT, 1.0 - lo, 1.0 + hi) * adv_BT)


def _gspo_term(log_ratio_BT, logp_BT, adv_BT, m_BT, lo, hi):
  """GSPO-token (arXiv 2507.18071 §4.3): value s_i, gradient s_i·∇log π_t."""
  seq_BT = jax.lax.stop_gradient(_seq_log_ratio(log_ratio_BT, m_BT))[:, None]
  ratio_BT = jnp.exp(seq_BT + logp_BT - jax.lax.stop_gradient(logp_BT))
  return -jnp.minimum(ratio_BT * adv_BT, jnp.clip(ratio_BT, 1.0 - lo, 1.0 + hi) * adv_BT)


def _cispo_term(log_ratio_BT, logp_BT, adv_BT, m_BT, lo, hi):
  """MiniMax-M1 §3.1: REINFORCE with a clipped, detached IS weight; a clipped token keeps its gradient."""
  ratio_BT = jax.lax.stop_gradient(jnp.clip(jnp.exp(log_ratio_BT), 1.0 - lo, 1.0 + hi))
  return -ratio_BT * adv_BT * logp_BT


def _seq_mean(loss_BT, n_tok_B, n_seq, norm):
  return jnp.sum(jnp.sum(loss_BT, axis=1) / jnp.maximum(n_tok_B, 1.0)), n_seq


def _over_budget(loss_BT, n_tok_B, n_seq, norm):
  return jnp.sum(loss_BT) / norm, n_seq


def _token_mean(loss_BT, n_tok_B, n_seq, norm):
  return jnp.sum(loss_BT), jnp.sum(n_tok_B)


def _directional_clip(ratio, adv, lo, hi):
  """The clipped branch is active (the token gets no gradient): r > 1+ε_h with A > 0, r < 1-ε_l with A < 0."""
  return ((ratio > 1.0 + hi) & (adv > 0)) | ((ratio < 1.0 - lo) & (adv < 0))


def _weight_clip(ratio, adv, lo, hi):
  """The IS weight is truncated (CISPO), whatever the advantage's sign."""
  return (ratio > 1.0 + hi) | (ratio < 1.0 - lo)


@dataclasses.dataclass(frozen=True)
class Objective:
  """One policy-gradient objective: clip range, per-token term, normaliser, what counts as clipped."""

  eps: tuple[float, float]  # default (ε_low, ε_high)
  term: Callable  # (log_ratio, logp, adv, mask, ε_low, ε_high) → per-token loss [B, T]
  reduce: Callable  # (loss [B, T], tokens per row, rows, max_len) → (sum, count)
  clipped: Callable = _directional_clip  # (ratio, adv, ε_low, ε_high) → bool, for clip_frac
  per_sequence: bool = False  # diagnostics per sequence (the ratio is a sequence's)


# CISPO: lower bound off (MiniMax-M1 §3.1 sets ε_low large), upper truncation 1 + 4 = 5 in the spirit of
# ScaleRL's ε_max (from memory, verify before tuning).
OBJECTIVES: dict[str, Objective] = {
  "grpo": Objective((0.2, 0.2), _ppo_term, _seq_mean),
  "drgrpo": Objective((0.2, 0.2), _ppo_term, _over_budget),
  "dapo": Objective((0.2, 0.28), _ppo_term, _token_mean),
  "cispo": Objective((1.0, 4.0), _cispo_term, _token_mean, clipped=_weight_clip),
  "gspo": Objective((3e-4, 4e-4), _gspo_term, _seq_mean, per_sequence=True),
}


def _objective(name: str, eps_low: float | None, eps_high: float | None) -> tuple[Objective, float, float]:
  if name not in OBJECTIVES:
    raise ValueError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
  o = OBJECTIVES[name]
  return o, (o.eps[0] if eps_low is None else eps_low), (o.eps[1] if eps_high is None else eps_high)


def _prepare(logp_BT, old_logp_BT, advantages, mask_BT, sampler_logp_BT, tis_cap):
  """Masked, clamped log-ratio, per-token advantages and detached TIS weights (1 without a sampler)."""
  chex.assert_rank(logp_BT, 2)
  chex.assert_equal_shape(
    [logp_BT, old_logp_BT, mask_BT] + ([] if sampler_logp_BT is None else [sampler_logp_BT])
  )
  chex.assert_equal_shape_prefix([logp_BT, advantages], advantages.ndim)
  m_BT = mask_BT > 0
  # Zero masked entries before any arithmetic: padding may hold -inf/NaN, and a masked token must
  # receive an exactly-zero gradient.
  logp_BT = jnp.where(m_BT, logp_BT.astype(jnp.float32), 0.0)
  old_BT = jnp.where(m_BT, jax.lax.stop_gradient(old_logp_BT).astype(jnp.float32), 0.0)
  log_ratio_BT = jnp.clip(logp_BT - old_BT, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  adv = jax.lax.stop_gradient(advantages).astype(jnp.float32)
  if adv.ndim == 1:
    adv = adv[:, None]
  adv_BT = jnp.where(m_BT, jnp.broadcast_to(adv, logp_BT.shape), 0.0)
  if sampler_logp_BT is None:
    w_BT = jnp.ones_like(logp_BT)
  else:
    # Truncated IS (Yao, Liu et al. 2025): the batch was sampled by μ, π_old was recomputed by the
    # trainer; w = min(π_old/μ, C), detached, corrects the sampler/trainer mismatch per token.
    smp_BT = jnp.where(m_BT, sampler_logp_BT.astype(jnp.float32), 0.0)
    mismatch_BT = jnp.clip(old_BT - smp_BT, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    w_BT = jax.lax.stop_gradient(jnp.minimum(jnp.exp(mismatch_BT), tis_cap))
  return m_BT, logp_BT, log_ratio_BT, adv_BT, w_BT


def _seq_log_ratio(log_ratio_BT: jax.Array, m_BT: jax.Array) -> jax.Array:
  n_B = jnp.sum(m_BT, axis=1).astype(jnp.float32)
  return jnp.sum(jnp.where(m_BT, log_ratio_BT, 0.0), axis=1) / jnp.maximum(n_B, 1.0)


def policy_loss(
  logp_BT: jax.Array,
  old_logp_BT: jax.Array,
  advantages: jax.Array,
  mask_BT: jax.Array,
  *,
  objective: str,
  sampler_logp: jax.Array | None = None,
  eps_low: float | None = None,
  eps_high: float | None = None,
  max_len: int | None = None,
  tis_cap: float = 2.0,
) -> tuple[jax.Array, jax.Array]:
  """(loss sum, count) of one policy-gradient objective; loss = sum / count (see module table).

  logp_BT: log π_θ(y_t) of the sampled tokens (differentiated); old_logp_BT: log π_old (detached);
  advantages: [B] per sequence or [B, T] per token (detached); mask_BT: 1 on trained (model) tokens.
  sampler_logp: the sampler's log μ(y_t); when given, each token's term is multiplied by the
  truncated-IS weight min(π_old/μ, tis_cap) (detached). eps_low/eps_high override the objective's
  clip range; max_len is Dr. GRPO's constant normaliser (default T, the padded response length).
  The log-ratio is clamped to [-20, 20] before exponentiation.
  """
  o, lo, hi = _objective(objective, eps_low, eps_high)
  m_BT, logp_BT, log_ratio_BT, adv_BT, w_BT = _prepare(
    logp_BT, old_logp_BT, advantages, mask_BT, sampler_logp, tis_cap
  )
  n_tok_B = jnp.sum(m_BT, axis=1).astype(jnp.float32)
  n_seq = jnp.sum(n_tok_B > 0).astype(jnp.float32)
  loss_BT = jnp.where(m_BT, o.term(log_ratio_BT, logp_BT, adv_BT, m_BT, lo, hi) * w_BT, 0.0)
  norm = float(logp_BT.shape[1] if max_len is None else max_len)
  return o.reduce(loss_BT, n_tok_B, n_seq, norm)


def on_objective_scale(
  values_BT: jax.Array, mask_BT: jax.Array, *, objective: str, max_len: int | None = None
) -> tuple[jax.Array, jax.Array]:
  """(sum, count) of per-token values reduced exactly as `policy_loss` reduces its per-token terms, with
  the same count for the same mask: adding the sums and dividing once by that count puts an extra
  per-token term (the feedback divergence) on the policy objective's own scale, so its weight λ is an
  exchange rate (one nat of divergence on a token ≈ one unit of advantage on it), not a ratio of
  two differently normalised means."""
  o, _, _ = _objective(objective, None, None)
  chex.assert_equal_shape([values_BT, mask_BT])
  m_BT = mask_BT > 0
  n_tok_B = jnp.sum(m_BT, axis=1).astype(jnp.float32)
  n_seq = jnp.sum(n_tok_B > 0).astype(jnp.float32)
  v_BT = jnp.where(m_BT, values_BT.astype(jnp.float32), 0.0)
  return o.reduce(v_BT, n_tok_B, n_seq, float(values_BT.shape[1] if max_len is None else max_len))


def policy_metrics(
  logp_BT: jax.Array, old_logp_BT: jax.Array, advantages: jax.Array, mask_BT: jax.Array, **kw
) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Diagnostics as {name: (sum, count)} (sum the pairs over micro-batches, divide once); takes
  `policy_loss`'s keyword arguments (max_len is not used), so one **kw serves both.

  clip_frac: tokens whose objective term is clipped (PPO family: the clipped branch is active, so the
    token gets no gradient; CISPO: the IS weight is truncated; GSPO: per sequence).
  ratio: mean π_θ/π_old per token (GSPO: the sequence ratio s per sequence).
  approx_kl: k3 estimate of KL(π_old‖π_θ), (r - 1) - log r per token (Schulman 2020).
  With sampler_logp: tis_weight (mean truncated-IS weight) and tis_capped (fraction at the cap).
  """
  kw.pop("max_len", None)
  sampler_logp, tis_cap = kw.pop("sampler_logp", None), kw.pop("tis_cap", 2.0)
  o, lo, hi = _objective(kw.pop("objective"), kw.pop("eps_low", None), kw.pop("eps_high", None))
  if kw:
    raise TypeError(f"policy_metrics got unexpected keyword arguments {sorted(kw)}")
  m_BT, _, log_ratio_BT, adv_BT, w_BT = _prepare(
    logp_BT, old_logp_BT, advantages, mask_BT, sampler_logp, tis_cap
  )
  log_ratio_BT = jax.lax.stop_gradient(log_ratio_BT)
  n_tok = jnp.sum(m_BT).astype(jnp.float32)
  ratio_BT = jnp.exp(log_ratio_BT)
  out = {}
  if o.per_sequence:
    n_tok_B = jnp.sum(m_BT, axis=1)
    has_B = n_tok_B > 0
    s_B = jnp.exp(_seq_log_ratio(log_ratio_BT, m_BT))
    adv_B = jnp.sum(adv_BT, axis=1) / jnp.maximum(n_tok_B, 1).astype(jnp.float32)
    n_seq = jnp.sum(has_B).astype(jnp.float32)
    out["clip_frac"] = (jnp.sum(o.clipped(s_B, adv_B, lo, hi) & has_B).astype(jnp.float32), n_seq)
    out["ratio"] = (jnp.sum(jnp.where(has_B, s_B, 0.0)), n_seq)
  else:
    out["clip_frac"] = (jnp.sum(o.clipped(ratio_BT, adv_BT, lo, hi) & m_BT).astype(jnp.float32), n_tok)
    out["ratio"] = (jnp.sum(jnp.where(m_BT, ratio_BT, 0.0)), n_tok)
  out["approx_kl"] = (jnp.sum(jnp.where(m_BT, ratio_BT - 1.0 - log_ratio_BT, 0.0)), n_tok)
  if sampler_logp is not None:
    out["tis_weight"] = (jnp.sum(jnp.where(m_BT, w_BT, 0.0)), n_tok)
    out["tis_capped"] = (jnp.sum(m_BT & (w_BT >= tis_cap)).astype(jnp.float32), n_tok)
  return out
