"""Small shared pieces: parameter creation with logical axes, RMSNorm, projections, SwiGLU MLP, the
embedding lookup.

Shape suffixes: B batch, T time, D d_model, F MLP hidden, V vocab; lower case: one device's block.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax import sharding
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


def _rows(table_VD: jax.Array, tokens_BT: jax.Array, dtype) -> jax.Array:
  # Out-of-range ids read NaN rows (never a silently clamped row), so bad data shows in the loss.
  rows = table_VD.at[tokens_BT].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
  return rows.astype(dtype)


def embed(table_VD: jax.Array, tokens_BT: jax.Array, dtype, meshes: sharding.Meshes | None) -> jax.Array:
  """The table's rows for `tokens_BT`, in `dtype`, laid out like the batch ([B, T, D]).

  On meshes the table is never gathered whole (left to GSPMD, a gather from a d_model-split table
  all-gathers all V rows on every device, and its gradient is a full fp32 [V, D] table per device plus
  an all-reduce of it: 4.4 GiB each on Kimi). Instead each device looks up its fsdp group's ids in its
  own column block and an all-to-all hands every device its rows whole (`sharding.lookup_layout`); the
  gradient stays a scatter into the local block.
  """
  if meshes is None:
    return _rows(table_VD, tokens_BT, dtype)
  lay = sharding.lookup_layout(table_VD.shape, tokens_BT.shape, meshes)

  def local(table_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    if not (lay.split and lay.rows_split):
      return _rows(table_vd, tokens_bt, dtype)  # [b, t, D / split]: `lay.out` keeps the columns split
    group_ids = jax.lax.all_gather(tokens_bt, lay.split, axis=0, tiled=True)  # the group's ids
    cols = _rows(table_vd, group_ids, dtype)  # my columns of the group's rows
    return jax.lax.all_to_all(
      cols, lay.split, split_axis=0, concat_axis=2, tiled=True
    )  # my rows, all columns

  return jax.shard_map(local, mesh=meshes.dense, in_specs=(lay.table, lay.tokens), out_specs=lay.out)(
    table_VD, tokens_BT
  )
