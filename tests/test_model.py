"""The decoder as a whole: causality, jit ≡ eager, KV-cache decode, packing, input checks, param trees.

Shape suffixes: B batch, T time, V vocab, D d_model.

Every forward here goes through one jitted function of (params, tokens, positions, segment_ids)
at one shape, so the whole module pays for a handful of compiles. Parameters are random NumPy
draws at a scale that makes every sub-layer matter (`model.init`'s std 0.02 leaves the MoE
contribution near 1e-4, too small for a tolerance to notice a wrong expert).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY

from composer_jax import model
from composer_jax.model import ModelConfig

CFG = TINY
B, T = 4, 16
# B·T = vocab: every position holds a different token id, so row `tokens[b, t]` of the embedding
# gradient is exactly the gradient w.r.t. the input at (b, t).
TOKENS_BT = np.random.default_rng(0).permutation(CFG.vocab_size).reshape(B, T).astype(np.int32)
POS_BT = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
SEG_BT = np.ones((B, T), np.int32)


def random_params(cfg: ModelConfig, seed: int) -> dict:
  """Parameters shaped like `model.init`'s, drawn in NumPy (no init compile): O(1) activations,
  norm scales near 1 and a non-zero router bias."""
  abstract = jax.eval_shape(functools.partial(model.init, cfg), jax.random.key(0))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = path[-1].key
    if name.endswith("norm"):
      value = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
    elif name == "router_bias":
      value = 0.05 * rng.standard_normal(leaf.shape)
    elif name == "embed":
      value = rng.standard_normal(leaf.shape)
    else:
      value = 0.2 * rng.standard_normal(leaf.shape)
    return jnp.asarray(value, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, abstract)


@pytest.fixture(scope="module")
def params():
  return random_params(CFG, seed=1)


@jax.jit
def _forward(params, tokens_BT, pos_BT, seg_BT):
  return model.apply(params, CFG, tokens_BT, pos_BT, segment_ids=seg_BT)


@jax.jit
def _grad_of_logits_at(params, tokens_BT, t):
  """d(Σ_b,v logits[b, t, v]) / d params."""
  return jax.grad(lambda p: model.apply(p, CFG, tokens_BT)[0][:, t].sum())(params)


@jax.jit
def _cached_step(params, tokens_BT, cache):
  return model.apply(params, CFG, tokens_BT, cache=cache)


def _logits(params, tokens_BT, pos_BT=POS_BT, seg_BT=SEG_BT) -> np.ndarray:
  return np.asarray(_forward(params, tokens_BT, pos_BT, seg_BT)[0])


# --- causality ---------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0, 6, 14])
def test_future_tokens_do_not_change_past_logits(params, t):
  logits = _logits(params, TOKENS_BT)
  changed = TOKENS_BT.copy()
  changed[:, t + 1 :] = (changed[:, t + 1 :] + 17) % CFG.vocab_size
  logits_changed = _logits(params, changed)
  np.testing.assert_array_equal(logits_changed[:, : t + 1], logits[:, : t + 1])
  assert np.abs(logits_changed[:, t + 1 :] - logits[:, t + 1 :]).min(axis=-1).max() > 0  # the change is seen


@pytest.mark.parametrize("t", [2, 11])
def test_gradient_at_t_is_exactly_zero_for_later_inputs(params, t):
  grad_embed_VD = np.asarray(_grad_of_logits_at(params, TOKENS_BT, t)["embed"])
  per_position_BT = np.abs(grad_embed_VD[TOKENS_BT]).max(-1)
  assert (per_position_BT[:, t + 1 :] == 0).all()
  assert (per_position_BT[:, : t + 1] > 0).all()


def test_router_bias_gets_exactly_zero_gradient(params):
  grads = _grad_of_logits_at(params, TOKENS_BT, T - 1)
  mlp = grads["moe_layers"]["mlp"]  # stacked: one row per MoE layer
  assert mlp["router_bias"].shape[0] == CFG.n_moe_layers
  np.testing.assert_array_equal(mlp["router_bias"], 0)
  assert (np.abs(mlp["router"]).max(axis=(1, 2)) > 0).all()  # every layer's router learns (combine weights)
  assert (np.abs(mlp["w_gate"]).max(axis=(1, 2, 3)) > 0).all()


# --- execution modes ---------------------------------------------------------------------------


def test_jit_matches_eager(params):
  # Eager dispatches op by op (~10 s on CPU): one call, on a slice of the usual batch.
  tokens_BT = TOKENS_BT[:1, :4]
  eager_BTV, eager_aux = model.apply(params, CFG, tokens_BT)
  jit_BTV = _logits(params, TOKENS_BT)[:1, :4]  # causal, so the prefix is the same computation
  np.testing.assert_allclose(np.asarray(eager_BTV), jit_BTV, rtol=1e-5, atol=1e-5)
  assert float(eager_aux["overflow"]) == 0


def test_kv_cache_decode_matches_full_forward(params):
  prefill = 6
  cache = model.init_cache(CFG, B, T)
  logits_BPV, aux = _cached_step(params, TOKENS_BT[:, :prefill], cache)
  steps = [np.asarray(logits_BPV)]
  cache = aux["cache"]
  for t in range(prefill, T):
    logits_B1V, aux = _cached_step(params, TOKENS_BT[:, t : t + 1], cache)
    steps.append(np.asarray(logits_B1V))
    cache = aux["cache"]
  assert int(cache["index"]) == T
  np.testing.assert_allclose(np.concatenate(steps, axis=1), _logits(params, TOKENS_BT), rtol=1e-5, atol=1e-5)


def test_unstacked_layers_match_the_stacks(params):
  """`unstack_layers` (what the decode loop runs) ≡ the scanned stacks, with a cache and without."""
  flat = model.unstack_layers(params, CFG)
  assert isinstance(flat["moe_layers"], list) and len(flat["moe_layers"]) == CFG.n_moe_layers
  np.testing.assert_allclose(_logits(flat, TOKENS_BT), _logits(params, TOKENS_BT), rtol=1e-6, atol=1e-6)
  cache = model.init_cache(CFG, B, T)
  got, got_aux = _cached_step(flat, TOKENS_BT[:, :5], cache)
  want, want_aux = _cached_step(params, TOKENS_BT[:, :5], cache)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_aux["cache"]["latent"], want_aux["cache"]["latent"], rtol=1e-6, atol=1e-6)


def test_greedy_sampling_matches_argmax_of_full_forwards(params):
  from composer_jax.rl import sampler

  prompt, new = 8, 8
  B = TOKENS_BT.shape[0]
  lengths = jnp.full((B,), prompt, jnp.int32)
  out = sampler.sample(
    params,
    CFG,
    jnp.asarray(TOKENS_BT[:, :prompt]),
    lengths,
    jax.random.key(0),
    max_new_tokens=new,
    temperature=0.0,
  )
  decoded_BN = np.asarray(out.tokens)
  # Reference: re-run the full (uncached) forward on a fixed-length buffer and append argmaxes.
  # Positions past the one read are placeholders; causality (tested above) makes them irrelevant.
  buffer_BT = TOKENS_BT.copy()
  for i in range(new):
    buffer_BT[:, prompt + i] = _logits(params, buffer_BT)[:, prompt + i - 1].argmax(-1)
  np.testing.assert_array_equal(decoded_BN, buffer_BT[:, prompt:])


def test_segment_ids_isolate_packed_documents(params):
  first = 6
  doc_a, doc_b = TOKENS_BT[:, :first], TOKENS_BT[:, first:]
  n_b = T - first
  packed_pos = np.concatenate([np.arange(first), np.arange(n_b)]).astype(np.int32)
  packed_seg = np.array([1] * first + [2] * n_b, np.int32)
  packed_BTV = _logits(
    params,
    np.concatenate([doc_a, doc_b], 1),
    np.broadcast_to(packed_pos, (B, T)),
    np.broadcast_to(packed_seg, (B, T)),
  )
  # doc_b alone at positions 0.., followed by filler in another segment (same shape: same compile).
  alone_tokens = np.concatenate([doc_b, doc_a], 1)
  alone_seg = np.array([1] * n_b + [3] * first, np.int32)
  alone_BTV = _logits(params, alone_tokens, POS_BT, np.broadcast_to(alone_seg, (B, T)))
  np.testing.assert_allclose(packed_BTV[:, first:], alone_BTV[:, :n_b], rtol=1e-5, atol=1e-5)
  first_doc_BTV = _logits(params, TOKENS_BT)[:, :first]
  np.testing.assert_allclose(packed_BTV[:, :first], first_doc_BTV, rtol=1e-5, atol=1e-5)
  # Without segment ids doc_b would see doc_a: the packed logits must then differ.
  leaky_BTV = _logits(params, np.concatenate([doc_a, doc_b], 1), np.broadcast_to(packed_pos, (B, T)))
  assert np.abs(leaky_BTV[:, first:] - alone_BTV[:, :n_b]).max() > 1e-2


def test_program_size_does_not_grow_with_depth():
  """The stacks run as scans: the lowered gradient program (forward + backward) has the same number of
  lines at 3 and 9 layers (a Python loop over layers would add a block's worth of lines per layer), so
  compile time does not grow with depth."""

  def lines(cfg) -> int:
    grad = jax.grad(lambda p: model.apply(p, cfg, TOKENS_BT)[0].sum())
    return jax.jit(grad).lower(model.abstract_params(cfg)).as_text().count("\n")

  scanned = [lines(dataclasses.replace(CFG, n_layers=n, remat="full")) for n in (3, 9)]
  assert scanned[0] == scanned[1], scanned


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [CFG.vocab_size, CFG.vocab_size + 5, -1])
def test_out_of_range_token_raises_eagerly(params, bad_id):
  tokens_BT = TOKENS_BT.copy()
  tokens_BT[1, 3] = bad_id
  with pytest.raises(ValueError, match="vocab_size=64"):
    model.apply(params, CFG, tokens_BT)


@pytest.mark.parametrize(
  "tokens",
  [np.zeros((T,), np.int32), np.zeros((1, 2, T), np.int32), np.zeros((B, T), np.float32)],
  ids=["rank1", "rank3", "float"],
)
def test_tokens_of_wrong_rank_or_dtype_raise(params, tokens):
  with pytest.raises(ValueError, match=r"integer array \[batch, time\]"):
    model.apply(params, CFG, tokens)


@pytest.mark.parametrize("bad_id", [CFG.vocab_size, -1])
def test_traced_out_of_range_token_gives_nan_logits(params, bad_id):
  """Under jit ids can't be checked; a bad id must poison its logits, not read a clamped row."""
  tokens_BT = TOKENS_BT.copy()
  tokens_BT[1, 5] = bad_id
  logits_BTV = _logits(params, tokens_BT)
  assert np.isnan(logits_BTV[1, 5]).all()
  # The NaN also reaches the rest of its own sequence (masked attention weights are 0, and
  # 0·NaN = NaN), but never another sequence of the batch.
  assert np.isfinite(logits_BTV[[0, 2, 3]]).all()


# --- config validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
  "overrides, field",
  [
    (dict(n_experts=8, n_group=3), "n_group"),
    (dict(n_experts=8, n_group=4, topk_group=2, top_k=5), "top_k"),  # 5 > 8·2/4 experts left
    (dict(n_experts=8, top_k=9), "top_k"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(qk_rope_head_dim=5), "qk_rope_head_dim"),
    (dict(first_k_dense=3), "first_k_dense"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(expert_impl="megablox"), "expert_impl"),
    (dict(attention_impl="flash"), "attention_impl"),
  ],
)
def test_invalid_config_names_the_field(overrides, field):
  kwargs = dict(vocab_size=64, d_model=32, n_layers=2, n_experts=8, top_k=2) | overrides
  with pytest.raises(ValueError, match=field):
    ModelConfig(**kwargs)


def test_valid_config_is_accepted():
  cfg = ModelConfig(n_experts=16, n_group=8, topk_group=3, top_k=6)  # the bound: 6 = 16·3/8
  assert (cfg.n_experts, cfg.n_group, cfg.topk_group, cfg.top_k) == (16, 8, 3, 6)
  with pytest.raises(ValueError, match="top_k"):
    ModelConfig(n_experts=16, n_group=8, topk_group=3, top_k=7)  # one past it


# --- parameter trees ---------------------------------------------------------------------------


def _is_axes(x) -> bool:
  return isinstance(x, tuple)


def test_logical_axes_match_params(params):
  axes = model.logical_axes(CFG)
  assert jax.tree.structure(axes, is_leaf=_is_axes) == jax.tree.structure(params)
  for (path, names), leaf in zip(
    jax.tree_util.tree_leaves_with_path(axes, is_leaf=_is_axes), jax.tree.leaves(params), strict=True
  ):
    assert len(names) == leaf.ndim, (jax.tree_util.keystr(path), names, leaf.shape)


def test_trainable_mask_excludes_exactly_the_router_bias(params):
  mask = model.trainable_mask(CFG)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  flags = {jax.tree_util.keystr(path): flag for path, flag in jax.tree_util.tree_leaves_with_path(mask)}
  frozen = sorted(path for path, flag in flags.items() if not flag)
  assert frozen == ["['moe_layers']['mlp']['router_bias']"]  # all MoE layers' biases: one stacked leaf
  assert all(isinstance(flag, bool) for flag in flags.values())
