"""Small shared pieces: parameter creation with logical axes, RMSNorm, projections, SwiGLU MLP.

Shape suffixes: B batch, T time, D d_model, F MLP hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.model.config import ModelConfig


class KeyStream:
  """Init keys without NNX state: `params()` returns fold_in(key, n) for n = 0, 1, 2, ...

  Duck-types the `nnx.Rngs.params()` call the modules use. The counter is a Python int: `nnx.Rngs`
  updates a Variable per draw, and under a trace each update probes the tracer's sharding, whose
  error path scans the whole trace so far — construction became quadratic in depth (≈10 s at 32
  layers, ≈40 s at 61) instead of linear.
  """

  def __init__(self, key: jax.Array | int):
    self.key = jax.random.key(key) if isinstance(key, int) else key
    self.count = 0

  def params(self) -> jax.Array:
    self.count += 1
    return jax.random.fold_in(self.key, self.count - 1)


class RouterBias(nnx.Variable):
  """DeepSeek-V3's aux-loss-free balancing bias: selects experts, gets no gradient, never decayed."""


def param(
  rngs: KeyStream | nnx.Rngs,
  cfg: ModelConfig,
  shape: Sequence[int],
  axes: Sequence[str | None],
  *,
  std=None,
):
  """A normal(0, std) parameter whose metadata carries its logical axis names."""
  std = cfg.init_std if std is None else std
  value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
  return nnx.Param(value.astype(cfg.param_dtype), out_sharding=tuple(axes))


def ones(cfg: ModelConfig, size: int) -> nnx.Param:
  return nnx.Param(jnp.ones((size,), cfg.param_dtype), out_sharding=(None,))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, cast back before the scale (as the reference does)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale.astype(x.dtype)[(None,) * (x.ndim - 1)] * normed.astype(x.dtype)


def project(eqn: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """einsum in the compute dtype with float32 accumulation (bf16→bf16 dots are slow on XLA:CPU)."""
  out = jnp.einsum(eqn, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  return out.astype(dtype)


def swiglu(
  x_BTD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array, dtype
) -> jax.Array:
  """down(silu(x·gate) ⊙ x·up), the DeepSeek/LLaMA MLP."""
  F = w_gate_DF.shape[1]
  gate_up = project(
    "...d,df->...f", x_BTD, jnp.concatenate([w_gate_DF, w_up_DF], axis=1), dtype
  )  # one matmul
  return project("...f,fd->...d", jax.nn.silu(gate_up[..., :F]) * gate_up[..., F:], w_down_FD, dtype)


class MLP(nnx.Module):
  """SwiGLU MLP on the dense mesh: the first `first_k_dense` layers and the shared experts."""

  def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs):
    self.gate_proj = param(rngs, cfg, (cfg.d_model, width), ("embed", "mlp"))
    self.up_proj = param(rngs, cfg, (cfg.d_model, width), ("embed", "mlp"))
    self.down_proj = param(rngs, cfg, (width, cfg.d_model), ("mlp", "embed"))
    self.dtype = cfg.dtype

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    return swiglu(x_BTD, self.gate_proj[...], self.up_proj[...], self.down_proj[...], self.dtype)
