"""Training attention kernels (model/attention_kernels.py) against the absorbed latent form.

The expanded form with the "xla" kernel must give the same logits and per-head max logits as the
absorbed form (what decoding uses) on packed rows; the fused kernels must equal "xla". cuDNN needs a
GPU; splash needs tokamax (its interpret mode then runs on CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import random_params
from tiny import TINY

from composer_jax import model, sharding
from composer_jax.model import attention_kernels

B, T = 2, 16


def _packed_rows():
  """Two rows of three documents each (positions restart per document)."""
  rng = np.random.default_rng(3)
  tokens_BT = rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32)
  seg_BT = np.repeat(np.array([[1, 2, 3], [1, 2, 3]], np.int32), [5, 7, 4], axis=1)
  pos_BT = np.concatenate([np.arange(n) for n in (5, 7, 4)])[None].repeat(B, 0).astype(np.int32)
  return tokens_BT, pos_BT, seg_BT


@pytest.fixture(scope="module")
def params():
  return random_params(TINY, seed=4)


def _apply(params, impl: str):
  cfg = dataclasses.replace(TINY, attention_impl=impl)
  tokens_BT, pos_BT, seg_BT = _packed_rows()
  logits_BTV, aux = jax.jit(lambda p: model.apply(p, cfg, tokens_BT, pos_BT, segment_ids=seg_BT))(params)
  return np.asarray(logits_BTV), np.asarray(aux["max_logit"])


def test_expanded_xla_matches_absorbed_form(params):
  logits_x, max_x = _apply(params, "xla")
  logits_a, max_a = _apply(params, "absorbed")
  assert np.abs(logits_a).max() > 0.1  # not a trivially small signal
  np.testing.assert_allclose(logits_x, logits_a, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(max_x, max_a, rtol=1e-5, atol=1e-5)


def test_chunked_max_logits_matches_the_materialised_scores():
  """The max-logit pass that the cuDNN kernel relies on, against the "xla" kernel's own max (CPU)."""
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((B, T, 4, 8)).astype(np.float32) for _ in range(3))
  _, pos_BT, seg_BT = _packed_rows()
  _, want_H = attention_kernels.xla(q, k, v, 0.3, pos_BT, pos_BT, seg_BT, seg_BT)
  got_H = attention_kernels.chunked_max_logits(q, k, 0.3, pos_BT, pos_BT, seg_BT, seg_BT)
  np.testing.assert_allclose(got_H, want_H, rtol=1e-6)


def _qkv_rows(T: int, B: int = B):
  """Random q, k [B, T, 2, 64], v [B, T, 2, 32] and two documents per row (segments 1 and 2)."""
  rng = np.random.default_rng(6)
  q, k = (jnp.asarray(rng.standard_normal((B, T, 2, 64)).astype(np.float32)) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((B, T, 2, 32)).astype(np.float32))
  seg_BT = np.repeat(np.array([1, 2], np.int32), [T // 3, T - T // 3])[None].repeat(B, 0)
  pos_BT = np.concatenate([np.arange(T // 3), np.arange(T - T // 3)])[None].repeat(B, 0).astype(np.int32)
  return q, k, v, pos_BT, seg_BT


def _kernel_matches_xla(impl: str, T: int = 128, rows: int = B, **kw):
  """Output, per-head max logits and the gradients of q, k, v against the "xla" kernel on packed rows."""
  q, k, v, pos_BT, seg_BT = _qkv_rows(T, rows)
  cot = jnp.asarray(np.random.default_rng(7).standard_normal(v.shape).astype(np.float32))

  def run(kernel):
    def loss(q, k, v):
      out, max_H = kernel(q, k, v, 0.125, pos_BT, pos_BT, seg_BT, seg_BT)
      return jnp.sum(out * cot), (out, max_H)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (_, (out, max_H)), grads = run(lambda *a: attention_kernels.attention(impl, *a, **kw))
  (_, (want, want_max_H)), want_grads = run(attention_kernels.xla)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-3, atol=2e-3)
  np.testing.assert_allclose(np.asarray(max_H), np.asarray(want_max_H), rtol=2e-3, atol=2e-3)
  for got, expected in zip(grads, want_grads, strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-3, atol=2e-3)


def test_cudnn_kernel_matches_xla():
  if jax.devices()[0].platform != "gpu":
    pytest.skip("cuDNN flash attention runs on an NVIDIA GPU only")
  _kernel_matches_xla("cudnn")


def _interpret() -> bool:
  pytest.importorskip("tokamax", reason="splash attention comes from tokamax, which is not installed")
  return jax.devices()[0].platform != "tpu"


def test_splash_kernel_matches_xla_in_interpret_mode():
  _kernel_matches_xla("splash", interpret=_interpret())


def test_splash_kernel_with_context_parallelism_matches_xla(meshes):
  """Queries split over the context axis inside shard_map: each shard masks by its rows' global indices."""
  layout = sharding.attention_layout(meshes)
  assert layout.size(layout.seq) == 2
  _kernel_matches_xla("splash", T=256, rows=layout.size(layout.batch), layout=layout, interpret=_interpret())


def test_splash_refuses_shapes_it_cannot_block():
  """T = 64 (or 128 split over 2 context shards) is no whole number of 128-row blocks."""
  assert attention_kernels.splash_fits(256, 256) and not attention_kernels.splash_fits(64, 64)
  q, k, v, pos_BT, seg_BT = _qkv_rows(64)
  with pytest.raises(ValueError, match="128-row blocks"):
    attention_kernels.splash(q, k, v, 0.125, pos_BT, pos_BT, seg_BT, seg_BT, interpret=True)
