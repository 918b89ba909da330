"""Rotary position embedding with YaRN, laid out as DeepSeek-V3 does (interleaved pairs).

Shape suffixes: B batch, T time, H heads, R rotary dims.

The reference (HF `DeepseekV3RotaryEmbedding` + `apply_rotary_pos_emb_interleave`) rotates the
pairs (x[2i], x[2i+1]) by frequency i and writes the result de-interleaved: first the rotated
even slots, then the odd ones. Queries and keys get the same layout, so their dot products equal
the textbook interleaved rotation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.model.config import ModelConfig, RopeConfig, yarn_mscale


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
  """(inv_freq [dim/2], attention_factor) as HF `_compute_{default,yarn}_parameters`.

  YaRN (Peng et al. 2023, §3.2) blends interpolated (1/(factor·base^(2i/d))) and extrapolated
  (1/base^(2i/d)) frequencies with a linear ramp between the dims that complete `beta_slow` and
  `beta_fast` rotations over the original context; cos/sin are scaled by `attention_factor`.
  Computed in float32 like the reference so the bits agree.
  """
  pos = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  extrapolated = (1.0 / pos).astype(np.float32)
  if rope.kind == "default":
    return extrapolated, 1.0
  interpolated = (1.0 / (rope.factor * pos)).astype(np.float32)

  def correction_dim(rotations: float) -> float:
    return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

  low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
  if rope.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # the reference's guard against a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
  extrapolation_weight = 1 - ramp
  inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight

  factor = rope.attention_factor
  if factor is None:
    if rope.mscale and rope.mscale_all_dim:
      factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
      factor = yarn_mscale(rope.factor)
  return inv_freq.astype(np.float32), float(factor)


def cos_sin(cfg: ModelConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, R/2] in float32 for integer positions."""
  inv_freq, attention_factor = inverse_frequencies(cfg.rope, cfg.qk_rope_head_dim)
  angles_BTR = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
  return jnp.cos(angles_BTR) * attention_factor, jnp.sin(angles_BTR) * attention_factor


def apply_rope(
  x_BTHR: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array, interleave: bool = True
) -> jax.Array:
  """Rotates the last axis of x [B, T, H, R] (H may be 1 for the shared MLA rope key)."""
  cos, sin = cos_BTR[:, :, None, :].astype(x_BTHR.dtype), sin_BTR[:, :, None, :].astype(x_BTHR.dtype)
  if interleave:
    x1, x2 = x_BTHR[..., 0::2], x_BTHR[..., 1::2]
  else:
    half = x_BTHR.shape[-1] // 2
    x1, x2 = x_BTHR[..., :half], x_BTHR[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
