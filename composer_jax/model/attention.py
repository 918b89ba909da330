"""Multi-head Latent Attention (DeepSeek-V2 §2.1) with an optional q-LoRA and a latent KV cache.

Shape suffixes: B batch, T query time, S key time, D d_model, H heads, C kv_lora_rank,
Q q_lora_rank, K qk head dim (nope + rope), N qk_nope dims, R qk_rope dims, V v head dim.

Keys and values are compressed into a C-dim latent plus one shared R-dim rotary key; the cache
stores exactly those (C + R numbers per token instead of H·(K+V)) and re-expands on read, which
reproduces the full forward to float tolerance.
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


def attend(
  q_BTHK: jax.Array,
  k_BSHK: jax.Array,
  v_BSHV: jax.Array,
  scale: float,
  q_pos_BT: jax.Array,
  k_pos_BS: jax.Array,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
) -> jax.Array:
  """Softmax attention where query t sees key s iff same segment and pos_s <= pos_t.

  Masking by positions and segment ids (not array indices) covers causal training, packed
  documents and a partly filled KV cache with one rule. Softmax in float32. Heads move next to
  batch before the two batched matmuls, and the mask enters as an additive bias broadcast over
  heads: on XLA:CPU this runs ~4x faster than contracting in [B, T, H, K] with a `where` mask.
  """
  q_BHTK, k_BHSK, v_BHSV = (x.transpose(0, 2, 1, 3) for x in (q_BTHK, k_BSHK, v_BSHV))
  visible_BTS = (k_pos_BS[:, None, :] <= q_pos_BT[:, :, None]) & (
    k_seg_BS[:, None, :] == q_seg_BT[:, :, None]
  )
  bias_B1TS = jnp.where(visible_BTS, 0.0, _MASKED)[:, None]
  scores_BHTS = jnp.einsum("bhtk,bhsk->bhts", q_BHTK, k_BHSK, preferred_element_type=jnp.float32) * scale
  probs_BHTS = jax.nn.softmax(scores_BHTS + bias_B1TS, axis=-1).astype(v_BSHV.dtype)
  out_BHTV = jnp.einsum("bhts,bhsv->bhtv", probs_BHTS, v_BHSV, preferred_element_type=jnp.float32)
  return out_BHTV.astype(v_BSHV.dtype).transpose(0, 2, 1, 3)


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
    latent_BTC = rms_norm(ckv_BTc[..., : cfg.kv_lora_rank], self.kv_a_norm[...], cfg.rms_norm_eps)
    k_rope_BTR = apply_rope(ckv_BTc[:, :, None, cfg.kv_lora_rank :], cos_BTR, sin_BTR, cfg.rope_interleave)[
      :, :, 0
    ]
    return latent_BTC, k_rope_BTR

  def query(self, x_BTD: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array) -> jax.Array:
    cfg = self.cfg
    if cfg.q_lora_rank:
      q_BTQ = project("btd,dq->btq", x_BTD, self.q_a_proj[...], cfg.dtype)
      q_BTQ = rms_norm(q_BTQ, self.q_a_norm[...], cfg.rms_norm_eps)
      q_BTHK = project("btq,qhk->bthk", q_BTQ, self.q_b_proj[...], cfg.dtype)
    else:
      q_BTHK = project("btd,dhk->bthk", x_BTD, self.q_proj[...], cfg.dtype)
    q_rope = apply_rope(q_BTHK[..., cfg.qk_nope_head_dim :], cos_BTR, sin_BTR, cfg.rope_interleave)
    return jnp.concatenate([q_BTHK[..., : cfg.qk_nope_head_dim], q_rope], axis=-1)

  def __call__(self, x_BTD, cos_BTR, sin_BTR, q_pos_BT, q_seg_BT, *, cache=None, meshes=None):
    """Attention output [B, T, D] and the updated cache entry.

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
    kv_BSHc = project("bsc,chk->bshk", latent_BSC, self.kv_b_proj[...], cfg.dtype)
    k_nope_BSHN, v_BSHV = kv_BSHc[..., : cfg.qk_nope_head_dim], kv_BSHc[..., cfg.qk_nope_head_dim :]
    k_rope_BSHR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], (*k_nope_BSHN.shape[:3], cfg.qk_rope_head_dim))
    k_BSHK = jnp.concatenate([k_nope_BSHN, k_rope_BSHR.astype(k_nope_BSHN.dtype)], axis=-1)
    out_BTHV = attend(q_BTHK, k_BSHK, v_BSHV, cfg.softmax_scale, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)
    return project("bthv,hvd->btd", out_BTHV, self.o_proj[...], cfg.dtype), new_cache
