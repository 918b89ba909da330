"""QK-clip for MLA (Kimi K2's MuonClip): cap each head's attention logit by rescaling its weights.

After an optimizer step, each head h whose largest logit in the step's forward pass, S_h, exceeds
τ gets γ_h = τ / S_h (γ_h = 1 otherwise). In MLA a head's logit is q_nope·k_nope + q_rope·k_rope
where q_nope, q_rope come from the query projection's head slice and k_nope from the key part of
`kv_b_proj`, while the rotary key k_rope is shared by all heads. Scaling q_nope and k_nope by
√γ_h and q_rope by γ_h multiplies the whole logit by γ_h and leaves the shared key untouched
(from the Kimi K2 report, arXiv 2507.20534). Values and the output projection are not changed.

Shape suffixes: L layers, H heads, K qk head dim, N qk_nope head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.model.config import ModelConfig
from composer_jax.model.transformer import stacks


def clip_factors(max_logit_LH: jax.Array, tau: float) -> jax.Array:
  """γ [L, H] = min(1, τ / S): 1 for heads at or under τ (and for non-positive S)."""
  s = max_logit_LH.astype(jnp.float32)
  return jnp.where(s > tau, tau / jnp.maximum(s, tau), 1.0)


def qk_clip(params: dict, max_logit_LH: jax.Array, cfg: ModelConfig, tau: float) -> dict:
  """New params with every layer's query and key-nope weights rescaled per head (see module doc).

  `max_logit_LH` has one row per decoder layer in order; each stack (`model.stacks`) takes its rows
  and scales its stacked q [L, in, H, K] and kv_b [L, C, H, N+V] leaves in one broadcast.
  """
  gamma_LH = clip_factors(max_logit_LH, tau)
  root_LH = jnp.sqrt(gamma_LH)
  H, N = cfg.n_heads, cfg.qk_nope_head_dim
  out, start = dict(params), 0
  for name, n in stacks(cfg):
    gamma, root = gamma_LH[start : start + n, :, None], root_LH[start : start + n, :, None]
    # Per (layer, head, column) factor: √γ on the nope columns, γ on the rope columns of the query.
    q_scale_LHK = jnp.concatenate(
      [jnp.broadcast_to(root, (n, H, N)), jnp.broadcast_to(gamma, (n, H, cfg.qk_rope_head_dim))], axis=-1
    )
    kv_scale_LHK = jnp.concatenate(
      [jnp.broadcast_to(root, (n, H, N)), jnp.ones((n, H, cfg.v_head_dim), jnp.float32)], axis=-1
    )
    attn = dict(params[name]["attn"])
    q_name = "q_b_proj" if "q_b_proj" in attn else "q_proj"
    attn[q_name] = (attn[q_name] * q_scale_LHK[:, None]).astype(attn[q_name].dtype)
    attn["kv_b_proj"] = (attn["kv_b_proj"] * kv_scale_LHK[:, None]).astype(attn["kv_b_proj"].dtype)
    out[name] = {**params[name], "attn": attn}
    start += n
  return out
