"""The embedding lookup on the dense mesh (`model.layers.embed`): the same rows and the same table gradient
as a plain gather on one device, and no [V, D] table gathered or all-reduced on the way.

Shape suffixes: B batch, T time, V vocab, D d_model.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import sharding
from composer_jax.model.layers import embed

V, D = 96, 16  # V appears in no activation shape: a collective over [V, D] moves the whole table


def _reference(table_VD, tokens_BT):
  rows = jnp.take(table_VD, jnp.clip(tokens_BT, 0, V - 1), axis=0)
  bad = (tokens_BT < 0) | (tokens_BT >= V)
  return jnp.where(bad[..., None], jnp.nan, rows).astype(jnp.bfloat16)


def _loss(table_VD, tokens_BT, w_BTD, meshes):
  rows = embed(table_VD, tokens_BT, jnp.bfloat16, meshes).astype(jnp.float32)
  return jnp.sum(jnp.nan_to_num(rows) * w_BTD)


@pytest.mark.parametrize("dense", [(2, 2, 2), (1, 4, 2), (1, 8, 1), (4, 1, 2)])
@pytest.mark.parametrize("shape", [(8, 16), (4, 8), (1, 16), (8, 1)])
def test_lookup_and_its_gradient_equal_one_device(dense, shape):
  meshes = sharding.build_meshes(dense, (8, 1))
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  table_VD = jax.random.normal(k1, (V, D), jnp.float32)
  tokens_BT = jax.random.randint(k2, shape, 0, V).at[0, 0].set(V + 3)  # one id out of range: a NaN row
  w_BTD = jax.random.normal(k3, (*shape, D), jnp.float32)

  want = _reference(table_VD, tokens_BT)
  table_put = jax.device_put(table_VD, sharding.param_sharding(("vocab", "embed"), meshes, (V, D)))
  tokens_put = jax.device_put(tokens_BT, sharding.batch_sharding(shape, meshes))
  got = jax.jit(lambda t, x: embed(t, x, jnp.bfloat16, meshes))(table_put, tokens_put)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))  # NaN = NaN

  grad_want = jax.grad(_loss)(table_VD, tokens_BT, w_BTD, None)
  grad_got = jax.jit(jax.grad(lambda t, x, w: _loss(t, x, w, meshes)))(table_put, tokens_put, w_BTD)
  np.testing.assert_allclose(np.asarray(grad_got), np.asarray(grad_want), rtol=1e-6, atol=1e-6)


def test_no_collective_moves_the_table():
  """A d_model-split table: GSPMD's own gather all-gathers the whole table, and the gradient all-reduces a
  [V, D] table; the lookup and its gradient here move ids, rows, and the local block's gradient (reduced
  over the axes the table is replicated on, as every parameter's is)."""
  meshes = sharding.build_meshes((2, 2, 2), (8, 1))
  table_put = jax.device_put(
    jnp.zeros((V, D), jnp.float32), sharding.param_sharding(("vocab", "embed"), meshes, (V, D))
  )
  tokens_put = jax.device_put(jnp.zeros((8, 16), jnp.int32), sharding.batch_sharding((8, 16), meshes))
  w_BTD = jnp.ones((8, 16, D), jnp.float32)

  def whole_table_collectives(fn) -> list[str]:
    hlo = jax.jit(fn).lower(table_put, tokens_put, w_BTD).compile().as_text()
    ops = re.findall(r"= \S*\[([0-9,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter|all-to-all)\(", hlo)
    return [
      f"{op} [{dims}]" for dims, op in ops if dims.split(",")[-2:] in ([str(V), str(D)], [str(D), str(V)])
    ]

  plain = jax.grad(lambda t, x, w: jnp.sum(t.at[x].get().astype(jnp.bfloat16).astype(jnp.float32) * w))
  assert whole_table_collectives(plain), "the check cannot fail: GSPMD's plain gather moved no [V, ·] array"
  assert whole_table_collectives(jax.grad(lambda t, x, w: _loss(t, x, w, meshes))) == []
