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

from composer_jax import model
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


def _kernel_matches_xla(impl: str, **kw):
  rng = np.random.default_rng(6)
  q, k = (rng.standard_normal((B, 128, 2, 64)).astype(np.float32) for _ in range(2))
  v = rng.standard_normal((B, 128, 2, 32)).astype(np.float32)
  pos_BT = np.broadcast_to(np.arange(128, dtype=np.int32), (B, 128))
  seg_BT = np.ones((B, 128), np.int32)
  args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0.125, pos_BT, pos_BT, seg_BT, seg_BT)
  out, max_H = attention_kernels.attention(impl, *args, **kw)
  want, want_max_H = attention_kernels.xla(*args)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-3, atol=2e-3)
  np.testing.assert_allclose(np.asarray(max_H), np.asarray(want_max_H), rtol=2e-3, atol=2e-3)


def test_cudnn_kernel_matches_xla():
  if jax.devices()[0].platform != "gpu":
    pytest.skip("cuDNN flash attention runs on an NVIDIA GPU only")
  _kernel_matches_xla("cudnn")


def test_splash_kernel_matches_xla_in_interpret_mode():
  pytest.importorskip("tokamax", reason="splash attention comes from tokamax, which is not installed")
  _kernel_matches_xla("splash", interpret=jax.devices()[0].platform != "tpu")
