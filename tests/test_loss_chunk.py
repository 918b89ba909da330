"""The chunked next-token loss (`model.loss_chunk`): the same loss and gradients as the whole-sequence
loss, on one device and on 8, and no [B, T, V] logits in the compiled step.

Shape suffixes: B batch, T time, D d_model, V vocab.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from tiny import TINY

from composer_jax import model, sharding
from composer_jax.train import batch as batch_lib
from composer_jax.train.losses import chunked_target_loss, target_loss
from composer_jax.train.step import forward_nll

B, T = 4, 32


def test_chunked_loss_and_its_gradients_equal_the_whole_sequence():
  k = jax.random.split(jax.random.key(1), 4)
  h_BTD = jax.random.normal(k[0], (B, T, 16))
  w_DV = jax.random.normal(k[1], (16, 50)) * 0.3
  targets_BT = jax.random.randint(k[2], (B, T), 0, 50)
  mask_BT = jax.random.bernoulli(k[3], 0.7, (B, T))

  def loss(h, w, chunk):
    s, c = chunked_target_loss(h, lambda x: x @ w, targets_BT, mask_BT, chunk)
    return s / c

  want, grads_want = jax.value_and_grad(loss, argnums=(0, 1))(h_BTD, w_DV, 0)
  np.testing.assert_allclose(
    want, target_loss(h_BTD @ w_DV, targets_BT, mask_BT)[0] / mask_BT.sum(), rtol=1e-6
  )
  for chunk in (4, 8, 16):
    got, grads = jax.value_and_grad(loss, argnums=(0, 1))(h_BTD, w_DV, chunk)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, gw in zip(grads, grads_want, strict=True):
      np.testing.assert_allclose(g, gw, rtol=1e-4, atol=1e-6)


def _batch(meshes):
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, TINY.vocab_size, (B, T)).astype(np.int32)
  seg = np.repeat(np.array([[1] * 20 + [2] * 12]), B, 0).astype(np.int32)
  pos = np.concatenate([np.arange(20), np.arange(12)])[None].repeat(B, 0).astype(np.int32)
  return batch_lib.place(batch_lib.TokenBatch(tokens, pos, seg), meshes)


def test_forward_nll_with_chunks_on_4_devices_equals_one_device_without():
  meshes = sharding.build_meshes((2, 1, 2), (4, 1), jax.devices()[:4])
  params = model.init(TINY, jax.random.key(0))
  chunked = dataclasses.replace(TINY, loss_chunk=8)

  def nll(p, cfg, m):
    s, c, _ = forward_nll(p, cfg, _batch(m), m)
    return s / c

  want, g_want = jax.value_and_grad(nll)(params, TINY, None)
  got, g_got = jax.jit(jax.value_and_grad(lambda p: nll(p, chunked, meshes)))(params)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5), g_got, g_want)


@pytest.mark.parametrize("chunk", [0, 8])
def test_the_compiled_loss_holds_whole_logits_only_without_chunks(chunk):
  cfg = dataclasses.replace(TINY, loss_chunk=chunk, vocab_size=96)  # 96: in no other shape
  params = model.init(cfg, jax.random.key(0))
  batch = _batch(None)
  hlo = jax.jit(jax.grad(lambda p: forward_nll(p, cfg, batch, None)[0])).lower(params).compile().as_text()
  whole = re.search(rf"f32\[{B},{T},96\]", hlo) is not None
  assert whole == (chunk == 0), (
    f"loss_chunk={chunk}: whole [B, T, V] fp32 logits {'missing' if chunk == 0 else 'present'}"
  )
