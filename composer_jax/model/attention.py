"""Multi-head Latent Attention (DeepSeek-V2 §2.1) with an optional q-LoRA and a latent KV cache.

Shape suffixes: B batch, T query time, S key time, D d_model, H heads, C kv_lora_rank,
Q q_lora_rank, K qk head dim (nope + rope), N qk_nope dims, R qk_rope dims, V v head dim.

Keys and values are compressed into a C-dim latent plus one shared R-dim rotary key; the cache
stores exactly those (C + R numbers per token instead of H·(K+V)). Attention always runs in the
absorbed form (the key/value up-projections folded into the query and the output), for training
and decoding alike: no per-head K/V is materialised, and the matmuls fold heads into rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax import sharding
from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import ones, param, project, rms_norm
from composer_jax.model.rope import apply_rope

_MASKED = -1e30  # finite, so a query with no visible key (padding) gives zeros, not NaN
# The q-LoRA and KV latents are normalised with a fixed eps, not `rms_norm_eps`: HF `DeepseekV3Attention`
# builds `q_a_layernorm` / `kv_a_layernorm` as `DeepseekV3RMSNorm(rank)` (default eps 1e-6), as the
# DeepSeek-V3 reference does (`RMSNorm(q_lora_rank)`, `RMSNorm(kv_lora_rank)`). With rms_norm_eps = 1e-5
# (Moonlight, Kimi K2.5) using the config's value moved logits by ~4e-4 relative.
LATENT_NORM_EPS = 1e-6


def attend(
  q_BTHK: jax.Array,
  keys_BSK: jax.Array,
  values_BSC: jax.Array,
  scale: float,
  q_pos_BT: jax.Array,
  k_pos_BS: jax.Array,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of per-head queries over keys/values shared by all heads (MLA's latent).

  Returns the output [B, T, H, C] and each head's largest visible logit [H] (scale included, no
  gradient): the quantity QK-clip caps (Kimi K2 MuonClip).

  Query t sees key s iff same segment and pos_s <= pos_t: positions and segment ids (not array
  indices) cover causal training, packed documents and a partly filled KV cache with one rule.
  The mask is an additive bias broadcast over heads; softmax in float32. Because keys are shared,
  (t, h) fold into one matmul dimension: [T·H, K] × [K, S] per batch row, no transposes.
  """
  visible_BTS = (k_pos_BS[:, None, :] <= q_pos_BT[:, :, None]) & (
    k_seg_BS[:, None, :] == q_seg_BT[:, :, None]
  )
  bias_BT1S = jnp.where(visible_BTS, 0.0, _MASKED)[:, :, None, :]
  scores_BTHS = jnp.einsum("bthk,bsk->bths", q_BTHK, keys_BSK, preferred_element_type=jnp.float32) * scale
  probs_BTHS = jax.nn.softmax(scores_BTHS + bias_BT1S, axis=-1).astype(values_BSC.dtype)
  out_BTHC = jnp.einsum("bths,bsc->bthc", probs_BTHS, values_BSC, preferred_element_type=jnp.float32)
  max_logit_H = jnp.max(jax.lax.stop_gradient(scores_BTHS) + bias_BT1S, axis=(0, 1, 3))
  return out_BTHC.astype(values_BSC.dtype), max_logit_H


class MLA(nnx.Module):
  """MLA projections; parameter names follow the reference's modules for a direct import."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    D, H, C, R = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
      self.q_a_proj = param(rngs, cfg, (D, cfg.q_lora_rank), ("embed", "q_lora"))
      self.q_a_norm = ones(cfg, cfg.q_lora_rank)
      self.q_b_proj = param(rngs, cfg, (cfg.q_lora_rank, H, cfg.qk_head_dim), ("q_lora", "heads", "head_dim"))
    else:
      self.q_proj = param(rngs, cfg, (D, H, cfg.qk_head_dim), ("embed", "heads", "head_dim"))
    self.kv_a_proj = param(rngs, cfg, (D, C + R), ("embed", "kv_lora"))
    self.kv_a_norm = ones(cfg, C)
    self.kv_b_proj = param(
      rngs, cfg, (C, H, cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora", "heads", "head_dim")
    )
    self.o_proj = param(rngs, cfg, (H, cfg.v_head_dim, D), ("heads", "head_dim", "embed"))
    self.cfg = cfg

  def latent(self, x_BTD: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What the cache stores: normalised latent [B, T, C] and rotated shared key [B, T, R]."""
    cfg = self.cfg
    ckv_BTc = project("btd,dc->btc", x_BTD, self.kv_a_proj[...], cfg.dtype)
    latent_BTC = rms_norm(ckv_BTc[..., : cfg.kv_lora_rank], self.kv_a_norm[...], LATENT_NORM_EPS)
    k_rope_BTR = apply_rope(ckv_BTc[:, :, None, cfg.kv_lora_rank :], cos_BTR, sin_BTR, cfg.rope_interleave)[
      :, :, 0
    ]
    return latent_BTC, k_rope_BTR

  def query(self, x_BTD: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array) -> jax.Array:
    cfg = self.cfg
    if cfg.q_lora_rank:
      q_BTQ = project("btd,dq->btq", x_BTD, self.q_a_proj[...], cfg.dtype)
      q_BTQ = rms_norm(q_BTQ, self.q_a_norm[...], LATENT_NORM_EPS)
      q_BTHK = project("btq,qhk->bthk", q_BTQ, self.q_b_proj[...], cfg.dtype)
    else:
      q_BTHK = project("btd,dhk->bthk", x_BTD, self.q_proj[...], cfg.dtype)
    q_rope = apply_rope(q_BTHK[..., cfg.qk_nope_head_dim :], cos_BTR, sin_BTR, cfg.rope_interleave)
    return jnp.concatenate([q_BTHK[..., : cfg.qk_nope_head_dim], q_rope], axis=-1)

  def __call__(self, x_BTD, cos_BTR, sin_BTR, q_pos_BT, q_seg_BT, *, cache=None, meshes=None):
    """Attention output [B, T, D], the updated cache entry and the per-head max logit [H].

    `cache` = (latent_BSC, k_rope_BSR, index, k_pos_BS, k_seg_BS): this layer's latent cache, the
    slot where x's tokens go, and the positions/segments of all slots (already including x's).
    Without a cache, x attends within itself.
    """
    cfg = self.cfg
    # Per-head activations keep the token layout (batch over replica·fsdp, seq over context).
    q_BTHK = sharding.constrain(
      self.query(x_BTD, cos_BTR, sin_BTR), ("batch", "seq", "act_heads", None), meshes
    )
    latent_BTC, k_rope_BTR = self.latent(x_BTD, cos_BTR, sin_BTR)
    if cache is None:
      latent_BSC, k_rope_BSR, k_pos_BS, k_seg_BS, new_cache = latent_BTC, k_rope_BTR, q_pos_BT, q_seg_BT, None
    else:
      old_latent, old_k_rope, index, k_pos_BS, k_seg_BS = cache
      latent_BSC = jax.lax.dynamic_update_slice_in_dim(
        old_latent, latent_BTC.astype(old_latent.dtype), index, 1
      )
      k_rope_BSR = jax.lax.dynamic_update_slice_in_dim(
        old_k_rope, k_rope_BTR.astype(old_k_rope.dtype), index, 1
      )
      new_cache = (latent_BSC, k_rope_BSR)
    # Absorbed MLA (DeepSeek-V2 §2.1.2): q_nope·(W_k c) = (W_kᵀ q_nope)·c and Σ p·(W_v c) = W_v (Σ p·c),
    # so attention runs on the C+R-dim latent keys shared by all heads and K/V are never expanded.
    w_k_CHN, w_v_CHV = (
      self.kv_b_proj[...][..., : cfg.qk_nope_head_dim],
      self.kv_b_proj[...][..., cfg.qk_nope_head_dim :],
    )
    q_latent_BTHC = project("bthn,chn->bthc", q_BTHK[..., : cfg.qk_nope_head_dim], w_k_CHN, cfg.dtype)
    q_BTHk = jnp.concatenate([q_latent_BTHC, q_BTHK[..., cfg.qk_nope_head_dim :]], axis=-1)
    keys_BSk = jnp.concatenate([latent_BSC, k_rope_BSR.astype(latent_BSC.dtype)], axis=-1)
    out_BTHC, max_logit_H = attend(
      q_BTHk, keys_BSk, latent_BSC, cfg.softmax_scale, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS
    )
    out_BTHV = project("bthc,chv->bthv", out_BTHC, w_v_CHV, cfg.dtype)
    return project("bthv,hvd->btd", out_BTHV, self.o_proj[...], cfg.dtype), new_cache, max_logit_H
