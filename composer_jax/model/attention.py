"""Multi-head Latent Attention (DeepSeek-V2 §2.1) with an optional q-LoRA and a latent KV cache.

Shape suffixes: B batch, T query time, S key time, D d_model, H heads, C kv_lora_rank,
Q q_lora_rank, K qk head dim (nope + rope), N qk_nope dims, R qk_rope dims, V v head dim.

Keys and values are compressed into a C-dim latent plus one shared R-dim rotary key; the cache
stores exactly those (C + R numbers per token instead of H·(K+V)). Two forms of the same function:
- **expanded** (training, no cache): per-head keys [N + R] and values [V] from the latent, then a
  fused attention kernel (`attention_kernels`, per backend). Scores cost T·S·H·(N+R) multiply-adds,
  (N+R)/(C+R) = 192/576 of the absorbed form's at Kimi's shapes. Under context parallelism the latent
  (C + R per token, not H·(N+R+V)) is what gets gathered along the sequence; each shard expands it.
- **absorbed** (a cache: prefill and decode): the key/value up-projections folded into the query and
  the output (DeepSeek-V2 §2.1.2), attention over the latent cache shared by all heads, so the cache
  is never expanded; heads fold into the matmul rows. `attention_impl="absorbed"` uses it for
  training too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax import backend, context_balance, sharding
from composer_jax.model import attention_kernels
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
  q_latent_BTHC: jax.Array,
  q_rope_BTHR: jax.Array,
  latent_BSC: jax.Array,
  k_rope_BSR: jax.Array,
  scale: float,
  q_pos_BT: jax.Array,
  k_pos_BS: jax.Array,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
  *,
  chunk: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of per-head queries over MLA's latent keys/values, shared by all heads.

  Scores are q_latent·latent + q_rope·k_rope (two matmuls: the [C + R] keys are never concatenated,
  which in a decode step would copy the whole cache slice per layer); values are the latent itself.
  Returns the output [B, T, H, C] and each head's largest visible logit [H] (scale included, no
  gradient): the quantity QK-clip caps (Kimi K2 MuonClip).

  Query t sees key s iff same segment and pos_s <= pos_t: positions and segment ids (not array
  indices) cover causal training, packed documents and a partly filled KV cache with one rule.
  The mask is an additive bias broadcast over heads; softmax in float32. Because keys are shared,
  (t, h) fold into one matmul dimension: [T·H, K] × [K, S] per batch row, no transposes.
  `chunk` > 0: queries in chunks of at most that many positions (`attention_kernels.by_query_chunks`).
  """
  if attention_kernels.chunk_count(q_pos_BT.shape[1], chunk) > 1:
    keys = (latent_BSC, k_rope_BSR, scale)
    whole = lambda ql, qr, qp, qs: attend(ql, qr, *keys, qp, k_pos_BS, qs, k_seg_BS)  # noqa: E731
    return attention_kernels.by_query_chunks(whole, (q_latent_BTHC, q_rope_BTHR, q_pos_BT, q_seg_BT), chunk)
  visible_BTS = attention_kernels.visible(q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)
  bias_BT1S = jnp.where(visible_BTS, 0.0, _MASKED)[:, :, None, :]
  f32 = jnp.float32
  scores_BTHS = jnp.einsum("bthc,bsc->bths", q_latent_BTHC, latent_BSC, preferred_element_type=f32)
  scores_BTHS = scores_BTHS + jnp.einsum(
    "bthr,bsr->bths", q_rope_BTHR, k_rope_BSR.astype(q_rope_BTHR.dtype), preferred_element_type=f32
  )
  scores_BTHS = scores_BTHS * scale
  probs_BTHS = jax.nn.softmax(scores_BTHS + bias_BT1S, axis=-1).astype(latent_BSC.dtype)
  out_BTHC = jnp.einsum("bths,bsc->bthc", probs_BTHS, latent_BSC, preferred_element_type=jnp.float32)
  max_logit_H = jnp.max(jax.lax.stop_gradient(scores_BTHS) + bias_BT1S, axis=(0, 1, 3))
  return out_BTHC.astype(latent_BSC.dtype), max_logit_H


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

  def __call__(self, x_BTD, cos_BTR, sin_BTR, q_pos_BT, q_seg_BT, *, cache=None, meshes=None, balanced=False):
    """Attention output [B, T, D], the updated cache and the per-head max logit [H].

    `cache` = (latent_LBSC, k_rope_LBSR, layer, index, k_pos_BS, k_seg_BS): the latent cache of all
    layers, this layer's index in it, the slot where x's tokens go, and the positions/segments of all
    slots (already including x's); returned updated in place. Without a cache, x attends within itself.
    `balanced`: x's sequence is in `context_balance.balance_sequence` order over the context shards (no
    cache).
    """
    cfg = self.cfg
    # Per-head activations keep the token layout (batch over replica·fsdp, seq over context).
    q_BTHK = sharding.constrain(
      self.query(x_BTD, cos_BTR, sin_BTR), ("batch", "seq", "act_heads", None), meshes
    )
    latent_BTC, k_rope_BTR = self.latent(x_BTD, cos_BTR, sin_BTR)
    impl = backend.attention_impl(cfg.attention_impl, meshes)
    layout = None if meshes is None else sharding.attention_layout(meshes)
    T = q_BTHK.shape[1]
    if impl == "splash" and cfg.attention_impl == "auto" and not attention_kernels.splash_fits(T, T, layout):
      impl = "xla"  # "auto" picks the fused kernel only for shapes it takes
    backend.chosen("attention_impl", impl if cache is None else "absorbed")
    if cache is None and impl != "absorbed":
      out_BTHV, max_logit_H = self._expanded(
        q_BTHK, latent_BTC, k_rope_BTR, q_pos_BT, q_seg_BT, impl, meshes, balanced
      )
      new_cache = None
    else:
      out_BTHV, max_logit_H, new_cache = self._absorbed(
        q_BTHK, latent_BTC, k_rope_BTR, q_pos_BT, q_seg_BT, cache
      )
    return project("bthv,hvd->btd", out_BTHV, self.o_proj[...], cfg.dtype), new_cache, max_logit_H

  def _kv_weights(self) -> tuple[jax.Array, jax.Array]:
    n = self.cfg.qk_nope_head_dim
    return self.kv_b_proj[...][..., :n], self.kv_b_proj[...][..., n:]

  def _expanded(self, q_BTHK, latent_BSC, k_rope_BSR, pos_BT, seg_BT, impl, meshes, balanced):
    """Per-head K [N + R] and V from the latent (gathered whole along the sequence first), then `impl`.

    With `balanced` queries the gathered latent, rope keys, positions and segments are put back in
    natural order (a local reorder of whole arrays): the kernels see permuted query rows against keys
    in index order, the layout the splash mask is built for (`attention_kernels._splash_kernel`)."""
    cfg = self.cfg
    latent_BSC = sharding.constrain(latent_BSC, ("batch", None, None), meshes)
    k_rope_BSR = sharding.constrain(k_rope_BSR, ("batch", None, None), meshes)
    k_pos_BS = sharding.constrain(pos_BT, ("batch", None), meshes)
    k_seg_BS = sharding.constrain(seg_BT, ("batch", None), meshes)
    if balanced:
      shards = sharding.degrees(meshes).seq
      latent_BSC, k_rope_BSR, k_pos_BS, k_seg_BS = (
        context_balance.restore_sequence(a, shards) for a in (latent_BSC, k_rope_BSR, k_pos_BS, k_seg_BS)
      )
    w_k_CHN, w_v_CHV = self._kv_weights()
    k_nope_BSHN = project("bsc,chn->bshn", latent_BSC, w_k_CHN, cfg.dtype)
    v_BSHV = project("bsc,chv->bshv", latent_BSC, w_v_CHV, cfg.dtype)
    B, S, H, _ = k_nope_BSHN.shape
    k_rope_BSHR = jnp.broadcast_to(
      k_rope_BSR.astype(k_nope_BSHN.dtype)[:, :, None, :], (B, S, H, k_rope_BSR.shape[-1])
    )
    k_BSHK = jnp.concatenate([k_nope_BSHN, k_rope_BSHR], axis=-1)
    splash = impl == "splash" and meshes is not None
    kw = {"layout": sharding.attention_layout(meshes, balanced)} if splash else {}
    if impl == "xla":
      kw["chunk"] = cfg.attention_chunk
    args = (q_BTHK.astype(cfg.dtype), k_BSHK, v_BSHV, cfg.softmax_scale, pos_BT, k_pos_BS, seg_BT, k_seg_BS)
    return attention_kernels.attention(impl, *args, **kw)

  def _absorbed(self, q_BTHK, latent_BTC, k_rope_BTR, q_pos_BT, q_seg_BT, cache):
    """Absorbed MLA (DeepSeek-V2 §2.1.2): q_nope·(W_k c) = (W_kᵀ q_nope)·c and Σ p·(W_v c) = W_v (Σ p·c),
    so attention runs on the C+R-dim latent keys shared by all heads and K/V are never expanded."""
    cfg = self.cfg
    if cache is None:
      latent_BSC, k_rope_BSR, k_pos_BS, k_seg_BS, new_cache = latent_BTC, k_rope_BTR, q_pos_BT, q_seg_BT, None
    else:
      latent_LBSC, k_rope_LBSR, layer, index, k_pos_BS, k_seg_BS = cache
      at = (layer, 0, index, 0)
      latent_LBSC = jax.lax.dynamic_update_slice(latent_LBSC, latent_BTC[None].astype(latent_LBSC.dtype), at)
      k_rope_LBSR = jax.lax.dynamic_update_slice(k_rope_LBSR, k_rope_BTR[None].astype(k_rope_LBSR.dtype), at)
      latent_BSC = jax.lax.dynamic_index_in_dim(latent_LBSC, layer, 0, keepdims=False)
      k_rope_BSR = jax.lax.dynamic_index_in_dim(k_rope_LBSR, layer, 0, keepdims=False)
      new_cache = (latent_LBSC, k_rope_LBSR)
    w_k_CHN, w_v_CHV = self._kv_weights()
    q_latent_BTHC = project("bthn,chn->bthc", q_BTHK[..., : cfg.qk_nope_head_dim], w_k_CHN, cfg.dtype)
    q_rope_BTHR = q_BTHK[..., cfg.qk_nope_head_dim :]
    out_BTHC, max_logit_H = attend(
      q_latent_BTHC,
      q_rope_BTHR,
      latent_BSC,
      k_rope_BSR,
      cfg.softmax_scale,
      q_pos_BT,
      k_pos_BS,
      q_seg_BT,
      k_seg_BS,
      chunk=cfg.attention_chunk,
    )
    return project("bthc,chv->bthv", out_BTHC, w_v_CHV, cfg.dtype), max_logit_H, new_cache
