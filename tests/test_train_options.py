"""Training options of issue 3: QK-clip, remat, gradient accumulation, bf16 compute, step metrics.

Each is checked against an independent computation: the naive (non-absorbed) MLA logits, the
step without the option, or fp32.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny import TINY

from composer_jax import model, optim, train
from composer_jax.model import rope
from composer_jax.model.layers import rms_norm
from composer_jax.train import step as step_lib
from composer_jax.train.batch import TokenBatch, place
from composer_jax.train.step import forward_nll, make_step, next_token_loss

ONE_LAYER = dataclasses.replace(TINY, n_layers=1, first_k_dense=1)  # a clip can't move later layers


def _batch(cfg, B=8, T=16, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
  seg = np.ones((B, T), np.int32)
  seg[:, T // 2 :] = 2  # two packed documents per row
  pos = np.concatenate([np.arange(T // 2), np.arange(T - T // 2)]).astype(np.int32)
  return {"tokens": tokens, "segment_ids": seg, "positions": np.broadcast_to(pos, (B, T)).copy()}


def _naive_max_logits(params, cfg, batch):
  """Layer 0's per-head max logit with per-head keys expanded (not the absorbed form)."""
  layer0 = jax.tree.map(lambda x: x[0], params["dense_layers"])
  a = layer0["attn"]
  N, C = cfg.qk_nope_head_dim, cfg.kv_lora_rank
  pos = jnp.asarray(batch["positions"])
  x = rms_norm(params["embed"][batch["tokens"]], layer0["input_norm"], cfg.rms_norm_eps)
  cos, sin = rope.cos_sin(cfg, pos)
  q = rms_norm(x @ a["q_a_proj"], a["q_a_norm"], cfg.rms_norm_eps)
  q = jnp.einsum("btq,qhk->bthk", q, a["q_b_proj"])
  q_rope = rope.apply_rope(q[..., N:], cos, sin, cfg.rope_interleave)
  ckv = x @ a["kv_a_proj"]
  k_nope = jnp.einsum(
    "bsc,chn->bshn", rms_norm(ckv[..., :C], a["kv_a_norm"], cfg.rms_norm_eps), a["kv_b_proj"][..., :N]
  )
  k_rope = rope.apply_rope(ckv[:, :, None, C:], cos, sin, cfg.rope_interleave)[:, :, 0]
  s = jnp.einsum("bthn,bshn->bhts", q[..., :N], k_nope) + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope)
  seg = jnp.asarray(batch["segment_ids"])
  visible = (pos[:, None, :, None] >= pos[:, None, None, :]) & (
    seg[:, None, :, None] == seg[:, None, None, :]
  )
  return jnp.max(jnp.where(visible, s * cfg.softmax_scale, -jnp.inf), axis=(0, 2, 3))


def _boost_queries(params, factor_H):
  """Scale each head's query projection so the heads' logits differ a lot."""
  p = jax.tree.map(lambda x: x, params)
  q_LQHK = params["dense_layers"]["attn"]["q_b_proj"]
  p["dense_layers"]["attn"]["q_b_proj"] = q_LQHK.at[0].multiply(factor_H[None, :, None])
  return p


def test_max_logit_matches_naive_attention_and_qk_clip_caps_it():
  cfg = ONE_LAYER
  params = _boost_queries(model.init(cfg, jax.random.key(1)), jnp.asarray([40.0, 1.0]))
  batch = _batch(cfg)
  apply = jax.jit(
    lambda p: model.apply(p, cfg, batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"])[1]
  )
  s_H = np.asarray(apply(params)["max_logit"][0])
  np.testing.assert_allclose(s_H, np.asarray(_naive_max_logits(params, cfg, batch)), rtol=1e-4)
  tau = float(s_H[0]) / 3  # head 0 over the threshold, head 1 under it
  assert s_H[1] < tau < s_H[0]
  clipped = optim.qk_clip(params, jnp.asarray(s_H)[None], cfg, tau)
  s2_H = np.asarray(apply(clipped)["max_logit"][0])
  np.testing.assert_allclose(s2_H, [tau, s_H[1]], rtol=1e-4)  # capped at τ exactly; head 1 untouched
  a, a2 = (jax.tree.map(lambda x: x[0], p["dense_layers"]["attn"]) for p in (params, clipped))
  np.testing.assert_array_equal(a2["kv_a_proj"], a["kv_a_proj"])  # the shared rotary key is not scaled
  np.testing.assert_array_equal(
    a2["kv_b_proj"][:, 0, cfg.qk_nope_head_dim :], a["kv_b_proj"][:, 0, cfg.qk_nope_head_dim :]
  )
  np.testing.assert_array_equal(a2["q_b_proj"][:, 1], a["q_b_proj"][:, 1])
  np.testing.assert_allclose(optim.clip_factors(jnp.asarray([[250.0, 50.0, -3.0]]), 100.0), [[0.4, 1.0, 1.0]])


def _mean_loss(p, cfg, batch):
  nll, count, _ = forward_nll(p, cfg, TokenBatch.of(batch), None)
  return nll / count


def _grads(cfg, params, batch):
  return jax.jit(jax.grad(lambda p: _mean_loss(p, cfg, batch)))(params)


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_same_gradients_and_really_rematerialises(policy):
  cfg = dataclasses.replace(TINY, remat=policy)
  params, batch = model.init(TINY, jax.random.key(0)), _batch(TINY, B=2)
  ref, got = _grads(TINY, params, batch), _grads(cfg, params, batch)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7), ref, got)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: _mean_loss(p, cfg, batch)))(params))
  assert "remat" in jaxpr or "checkpoint" in jaxpr
  assert "remat" not in str(jax.make_jaxpr(jax.grad(lambda p: _mean_loss(p, TINY, batch)))(params))


def _step(cfg, meshes, tx, **kwargs):
  state = train.create_state(cfg, tx, jax.random.key(0), meshes)
  step = make_step(
    next_token_loss(cfg, meshes), tx, cfg, schedule=optax.constant_schedule(1e-2), meshes=meshes,
    state_sharding=train.state.state_shardings(state), router_bias_rate=1e-3, **kwargs,
  )  # fmt: skip
  return state, lambda st, batch: step(st, place(TokenBatch.of(batch), meshes))


def _muon_tx(cfg, meshes):
  ocfg = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10, min_lr_ratio=1.0)
  return optim.build_optimizer(cfg, ocfg, meshes)


def test_grad_accumulation_equals_one_big_batch_and_step_metrics(meshes):
  """2 micro-batches of 4 rows (uneven token counts) → the same step as one batch of 8; QK-clip
  with a tiny τ (every head clipped) and the step's metrics checked on the way."""
  tx = _muon_tx(TINY, meshes)
  batch = _batch(TINY, B=8)
  batch["segment_ids"][::3, -5:] = 0  # padding in some rows only: micro-batches count different tokens
  outs = []
  for n in (1, 2):
    state, step = _step(TINY, meshes, tx, grad_accum=n, qk_clip_tau=1e-3)
    before = jax.device_get(state.params)
    state, m = step(state, batch)
    outs.append((jax.device_get(state.params), jax.device_get(m)))
  (p1, m1), (p2, m2) = outs
  for k in ("loss", "grad_norm", "tokens", "max_attention_logit", "muon_update_rms", "adam_update_rms"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6), p1, p2)
  assert m1["qk_clipped_heads"] == TINY.n_layers * TINY.n_heads and m1["max_attention_logit"] > 1e-3
  # Moonlight scale: Muon's applied update RMS ≈ 0.2·lr (NS output singular values ≈ 0.7-1.1).
  assert 0.1 < m1["muon_update_rms"] / 1e-2 < 0.3 and m1["adam_update_rms"] > 0
  q, q0 = p1["dense_layers"]["attn"]["q_b_proj"][0], before["dense_layers"]["attn"]["q_b_proj"][0]
  assert np.max(np.abs(q)) < np.max(np.abs(q0))  # clipped by τ/S ≪ 1
  with pytest.raises(ValueError, match="grad_accum"):
    _step(TINY, meshes, tx, grad_accum=0)


def test_bf16_compute_keeps_fp32_master_weights(meshes):
  cfg16 = dataclasses.replace(TINY, dtype="bfloat16")
  batch = _batch(TINY)
  losses = []
  for cfg in (TINY, cfg16):
    state, step = _step(cfg, meshes, optax.adamw(1e-2))
    state, m = step(state, batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    losses.append(float(m["loss"]))
  assert losses[0] != losses[1]  # really computed differently
  np.testing.assert_allclose(losses[1], losses[0], rtol=2e-2)


def test_update_rms_traces_past_two_billion_elements():
  """`_rms` over leaves of more than 2^31 elements in all (kimi_k25_1t's Muon leaves) traces: its
  element count is a Python float, which an int32 division by the count would overflow."""
  big = {
    "a": jax.ShapeDtypeStruct((2**16, 2**15), jnp.bfloat16),
    "b": jax.ShapeDtypeStruct((2**16,), jnp.float32),
  }
  labels = {"a": "muon", "b": "muon"}
  out = jax.eval_shape(lambda t: step_lib._rms(t, labels, "muon"), big)
  assert out.shape == () and out.dtype == jnp.float32
  small = {"a": jnp.full((3, 4), 2.0), "b": jnp.zeros((4,))}
  np.testing.assert_allclose(step_lib._rms(small, labels, "muon"), np.sqrt(48 / 16), rtol=1e-6)
