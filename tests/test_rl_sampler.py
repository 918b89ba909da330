"""The KV-cache sampler against independent references: full forwards recomputed from scratch,
single-prompt runs, softmax frequencies, and `score` (the trainer's logprobs).

Shape suffixes: B batch, P prompt length, N new tokens, T time, V vocab.

Prompts are right-padded with different lengths per row. The references never use a cache: each
step re-runs `model.apply` on every row's whole prefix, left-aligned with positions 0..T-1.
Settings (temperature, top-k/p, stop tokens, limits) are traced, so most tests share one compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import random_params
from tiny import TINY

from composer_jax import model, sharding
from composer_jax.rl import sampler

CFG = TINY
B, P, N = 4, 8, 8
S = 32  # cache slots and reference width: every call below shares these shapes (few compiles)
LENGTHS_B = np.array([8, 3, 5, 1], np.int32)
_rng = np.random.default_rng(7)
PROMPTS_BP = np.where(
  np.arange(P)[None, :] < LENGTHS_B[:, None], _rng.integers(1, CFG.vocab_size, (B, P)), 0
).astype(np.int32)


@pytest.fixture(scope="module")
def params():
  return random_params(CFG, seed=3)


@jax.jit
def _full_logits(params, tokens_BT):
  return model.apply(params, CFG, tokens_BT)[0]


def _rows(prompts_BP, lengths_B, new_BN, new_lengths_B):
  """Each row's real tokens: its prompt then its generated tokens."""
  return [
    list(prompts_BP[b, : lengths_B[b]]) + list(new_BN[b, : new_lengths_B[b]]) for b in range(len(lengths_B))
  ]


def _reference_greedy(params, rows, steps, width=S):
  """Greedy continuation of each token list by full uncached forwards (one per step)."""
  rows = [list(r) for r in rows]
  out = [[] for _ in rows]
  for _ in range(steps):
    buf_BT = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
      buf_BT[b, : len(r)] = r
    logits_BTV = np.asarray(_full_logits(params, jnp.asarray(buf_BT)))
    for b, r in enumerate(rows):
      tok = int(logits_BTV[b, len(r) - 1].argmax())
      r.append(tok)
      out[b].append(tok)
  return np.array(out, np.int32)


def _sample(params, key=0, **kw):
  kw.setdefault("max_new_tokens", N)
  kw.setdefault("cache_len", S)
  return sampler.sample(params, CFG, PROMPTS_BP, LENGTHS_B, jax.random.key(key), **kw)


def test_greedy_matches_argmax_of_full_forward_recomputed_each_step(params):
  out = _sample(params, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(out.lengths), [N] * B)
  expected_BN = _reference_greedy(params, _rows(PROMPTS_BP, LENGTHS_B, np.zeros((B, 0), int), [0] * B), N)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected_BN)
  assert np.all(np.asarray(out.sample_logprobs) == 0.0)


def test_each_row_samples_as_if_alone(params):
  keys = jax.random.split(jax.random.key(5), B)  # per-row keys: independent of the batch
  for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=20, top_p=0.9)):
    together = sampler.sample(params, CFG, PROMPTS_BP, LENGTHS_B, keys, max_new_tokens=N, cache_len=S, **kw)
    for b in range(B):
      row = slice(b, b + 1)
      alone = sampler.sample(
        params, CFG, PROMPTS_BP[row], LENGTHS_B[row], keys[row], max_new_tokens=N, cache_len=S, **kw
      )
      np.testing.assert_array_equal(
        np.asarray(together.tokens[b]), np.asarray(alone.tokens[0]), err_msg=str(kw)
      )
      np.testing.assert_allclose(together.logprobs[b], alone.logprobs[0], rtol=1e-5, atol=1e-5)


def test_stop_tokens_end_rows(params):
  free = _sample(params, temperature=0.0)
  free_BN = np.asarray(free.tokens)
  stop = int(free_BN[0, 2])
  out = _sample(params, temperature=0.0, stop_tokens=(stop, CFG.vocab_size + 5), pad_id=63)
  tokens_BN, lengths_B = np.asarray(out.tokens), np.asarray(out.lengths)
  for b in range(B):
    hits = np.flatnonzero(free_BN[b] == stop)
    n = int(hits[0]) + 1 if hits.size else N
    assert lengths_B[b] == n
    np.testing.assert_array_equal(tokens_BN[b, :n], free_BN[b, :n])
    assert np.all(tokens_BN[b, n:] == 63)
    assert np.all(np.asarray(out.logprobs)[b, n:] == 0.0)
  assert lengths_B[0] == 3


def test_per_row_max_new_tokens(params):
  free_BN = np.asarray(_sample(params, temperature=0.0).tokens)
  limits_B = np.array([8, 3, 0, 5], np.int32)
  out = _sample(params, temperature=0.0, max_new=limits_B, pad_id=1)
  np.testing.assert_array_equal(np.asarray(out.lengths), limits_B)
  for b in range(B):
    np.testing.assert_array_equal(np.asarray(out.tokens)[b, : limits_B[b]], free_BN[b, : limits_B[b]])
    assert np.all(np.asarray(out.tokens)[b, limits_B[b] :] == 1)


def test_top_k_one_is_greedy(params):
  greedy_BN = np.asarray(_sample(params, temperature=0.0).tokens)
  for key in (1, 2):
    out = _sample(params, key=key, temperature=1.3, top_k=1)
    np.testing.assert_array_equal(np.asarray(out.tokens), greedy_BN)
    np.testing.assert_allclose(np.asarray(out.sample_logprobs), 0.0, atol=1e-6)


def test_settings_do_not_recompile(params):
  _sample(params, temperature=0.0)
  sizes = sampler.decode._cache_size(), sampler.extend._cache_size()
  _sample(params, key=9, temperature=0.7, top_k=5, top_p=0.8, stop_tokens=(3, 4), max_new=[1, 2, 3, 4])
  assert (sampler.decode._cache_size(), sampler.extend._cache_size()) == sizes


@pytest.mark.parametrize(
  "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 6, 1.0), (1.0, 0, 0.5)], ids=["plain", "top_k", "top_p"]
)
def test_first_token_frequencies_match_softmax(params, temperature, top_k, top_p):
  calls = 512  # x B rows = 2048 samples of row 0's first token, through `decode` at the shared shape
  buf_1S = np.zeros((1, S), np.int32)
  buf_1S[0, :P] = PROMPTS_BP[0]
  logits_V = np.asarray(_full_logits(params, jnp.asarray(buf_1S)))[0, P - 1].astype(np.float64) / temperature
  order = np.argsort(-logits_V)
  keep = np.ones_like(logits_V, bool)
  if top_k:
    keep[order[top_k:]] = False
  probs = np.where(keep, np.exp(logits_V - logits_V.max()), 0.0)
  probs /= probs.sum()
  if top_p < 1.0:
    cum_before = np.cumsum(probs[order]) - probs[order]
    keep[order[cum_before >= top_p]] = False
    probs = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
  prompts_BP = np.broadcast_to(PROMPTS_BP[0], (B, P))
  logits_BPV, cache = sampler.extend(params, CFG, model.init_cache(CFG, B, S), prompts_BP, np.full((B,), P))
  last_BV = sampler.last_logits(logits_BPV, jnp.full((B,), P))
  settings = sampler.settings(temperature, top_k, top_p, (), 0)
  firsts, sample_logps = [], []
  for i in range(calls):
    keys_B = jax.random.split(jax.random.key(i), B)
    out = sampler.decode(
      params, CFG, cache, last_BV, keys_B, jnp.ones((B,), jnp.int32), *settings, max_new_tokens=N
    )
    firsts.append(out.tokens[:, 0])
    sample_logps.append(out.sample_logprobs[:, 0])
  first_n = np.concatenate([np.asarray(f) for f in firsts])
  n = len(first_n)
  assert np.all(keep[first_n]), "sampled a filtered-out token"
  sample_logp_n = np.concatenate([np.asarray(x) for x in sample_logps])
  np.testing.assert_allclose(sample_logp_n, np.log(probs[first_n]), rtol=1e-4, atol=1e-4)
  counts = np.bincount(first_n, minlength=CFG.vocab_size)
  # Pearson chi-square over bins expecting ≥ 5 samples (the rest pooled); the p = 0.001 critical
  # value of chi-square with k dof is below k + 3.1·sqrt(2k) + 10 for the k here.
  expected = n * probs
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  obs, exp = obs[exp > 0], exp[exp > 0]
  chi2, dof = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
  assert dof >= 3
  assert chi2 < dof + 3.1 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_logprobs_equal_score(params):
  out = _sample(params, key=4, temperature=0.9, top_k=30, top_p=0.95, stop_tokens=(5,))
  new_BN, lengths_B = np.asarray(out.tokens), np.asarray(out.lengths)
  T = S
  tokens_BT = np.zeros((B, T), np.int32)
  seg_BT = np.zeros((B, T), np.int32)
  for b, r in enumerate(_rows(PROMPTS_BP, LENGTHS_B, new_BN, lengths_B)):
    tokens_BT[b, : len(r)], seg_BT[b, : len(r)] = r, 1
  logp_BT = np.asarray(sampler.score(params, CFG, tokens_BT, segment_ids=seg_BT))
  for b in range(B):
    cols = LENGTHS_B[b] + np.arange(lengths_B[b])
    np.testing.assert_allclose(
      np.asarray(out.logprobs)[b, : lengths_B[b]], logp_BT[b, cols], rtol=0, atol=1e-5
    )
  assert np.all(logp_BT[:, 0] == 0) and np.all(logp_BT[seg_BT == 0] == 0)
  # score with temperature: the tempered distribution, independently in NumPy.
  logits_BTV = np.asarray(_full_logits(params, jnp.asarray(tokens_BT))).astype(np.float64) / 0.5
  logz_BT = np.log(np.exp(logits_BTV - logits_BTV.max(-1, keepdims=True)).sum(-1)) + logits_BTV.max(-1)
  ref = np.take_along_axis(logits_BTV[:, :-1], tokens_BT[:, 1:, None], -1)[..., 0] - logz_BT[:, :-1]
  hot_BT = np.asarray(sampler.score(params, CFG, tokens_BT, segment_ids=seg_BT, temperature=0.5))
  valid = (seg_BT[:, 1:] == 1) & (seg_BT[:, :-1] == 1)
  np.testing.assert_allclose(hot_BT[:, 1:][valid], ref[valid], rtol=0, atol=1e-5)


def test_extend_matches_fresh_forward_over_concatenation(params):
  extra_lengths_B = np.array([2, 8, 0, 4], np.int32)
  extra_BE = np.random.default_rng(1).integers(0, CFG.vocab_size, (B, P)).astype(np.int32)
  cache = model.init_cache(CFG, B, S)
  _, cache = sampler.extend(params, CFG, cache, PROMPTS_BP, LENGTHS_B)
  logits_BEV, cache = sampler.extend(params, CFG, cache, extra_BE, extra_lengths_B)
  rows = [list(PROMPTS_BP[b, : LENGTHS_B[b]]) + list(extra_BE[b, : extra_lengths_B[b]]) for b in range(B)]
  buf_BS = np.zeros((B, S), np.int32)
  for b, r in enumerate(rows):
    buf_BS[b, : len(r)] = r
  fresh_BSV = np.asarray(_full_logits(params, jnp.asarray(buf_BS)))
  for b in range(B):
    e, start = extra_lengths_B[b], LENGTHS_B[b]
    np.testing.assert_allclose(
      np.asarray(logits_BEV)[b, :e], fresh_BSV[b, start : start + e], rtol=1e-5, atol=1e-5
    )
  np.testing.assert_array_equal(np.asarray(sampler.next_positions(cache)), LENGTHS_B + extra_lengths_B)


def test_multi_turn_continuation_matches_full_forward(params):
  """sample (feed_last) → append an observation → sample again ≡ greedy over the concatenation."""
  n1, n2 = 5, 4
  stop = int(np.asarray(_sample(params, temperature=0.0).tokens)[1, 1])  # row 1 stops early
  first = _sample(params, temperature=0.0, max_new=np.full((B,), n1), stop_tokens=(stop,), feed_last=True)
  obs_lengths_B = np.array([3, 1, 2, 8], np.int32)
  obs_BO = np.random.default_rng(2).integers(0, CFG.vocab_size, (B, P)).astype(np.int32)
  logits_BOV, cache = sampler.extend(params, CFG, first.cache, obs_BO, obs_lengths_B)
  second = sampler.decode(
    params, CFG, cache, sampler.last_logits(logits_BOV, jnp.asarray(obs_lengths_B)),
    jax.random.split(jax.random.key(0), B), jnp.full((B,), n2),
    *sampler.settings(0.0, 0, 1.0, (), 0), max_new_tokens=N,
  )  # fmt: skip
  rows = _rows(PROMPTS_BP, LENGTHS_B, np.asarray(first.tokens), np.asarray(first.lengths))
  rows = [r + list(obs_BO[b, : obs_lengths_B[b]]) for b, r in enumerate(rows)]
  np.testing.assert_array_equal(np.asarray(second.tokens)[:, :n2], _reference_greedy(params, rows, n2))
  np.testing.assert_array_equal(np.asarray(second.lengths), [n2] * B)
  assert int(first.lengths[1]) == 2


def test_recorded_routing_equals_the_full_forwards(params):
  """extend's routing of the prompt and decode's routing of each generated token (recorded when it is
  fed, at the next step) equal the experts a cache-free forward over the whole row chooses."""
  logits_BPV, cache, prompt_BPLK = sampler.extend(
    params, CFG, model.init_cache(CFG, B, S), PROMPTS_BP, LENGTHS_B, with_routing=True
  )
  out = sampler.decode(
    params, CFG, cache, sampler.last_logits(logits_BPV, jnp.asarray(LENGTHS_B)),
    jax.random.split(jax.random.key(0), B), jnp.full((B,), N), *sampler.settings(0.0, 0, 1.0, (), 0),
    max_new_tokens=N, feed_last=jnp.asarray(True),
  )  # fmt: skip
  prompt_BPLK, new_BNLK = np.asarray(prompt_BPLK), np.asarray(out.routed_experts)
  assert new_BNLK.shape == (B, N, CFG.n_moe_layers, CFG.top_k)
  rows = _rows(PROMPTS_BP, LENGTHS_B, np.asarray(out.tokens), np.asarray(out.lengths))
  buf_BS = np.zeros((B, S), np.int32)
  for b, r in enumerate(rows):
    buf_BS[b, : len(r)] = r
  full_LBSK = np.asarray(jax.jit(lambda p, t: model.apply(p, CFG, t)[1]["routed_experts"])(params, buf_BS))
  for b in range(B):
    recorded_TLK = np.concatenate([prompt_BPLK[b, : LENGTHS_B[b]], new_BNLK[b]])
    np.testing.assert_array_equal(recorded_TLK, np.moveaxis(full_LBSK[:, b, : len(rows[b])], 0, 1))
  assert np.all(prompt_BPLK[np.arange(P)[None, :] >= LENGTHS_B[:, None]] == -1)  # padding columns
  # Without feed_last the last token is never fed: its routing is unknown.
  last = _sample(params, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(last.routed_experts)[:, :-1], new_BNLK[:, :-1])
  assert np.all(np.asarray(last.routed_experts)[:, -1] == -1)


def test_sharded_sampling_matches_single_device(params, meshes):
  single = _sample(params, key=3, temperature=0.8, top_k=10)
  placed = jax.device_put(params, sharding.param_shardings(model.logical_axes(CFG), params, meshes))
  sharded = _sample(placed, key=3, temperature=0.8, top_k=10, meshes=meshes)
  np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))
  np.testing.assert_allclose(np.asarray(sharded.logprobs), np.asarray(single.logprobs), rtol=1e-5, atol=1e-5)


def test_rejects_bad_prompt_lengths_and_small_cache(params):
  with pytest.raises(ValueError, match="prompt_lengths"):
    sampler.sample(params, CFG, PROMPTS_BP, np.array([8, 0, 5, 1]), jax.random.key(0), max_new_tokens=N)
  with pytest.raises(ValueError, match="cache_len"):
    _sample(params, cache_len=P + N - 1)


def test_filter_logits_fast_path_equals_the_full_sort():
  """The lax.top_k path (0 < top_k ≤ V − 1 candidates) keeps exactly what sorting the whole row keeps,
  ties included, for every top_k around the boundaries and with top-p on top."""
  rng = np.random.default_rng(0)
  V = 16
  logits_BV = np.round(rng.normal(size=(4, V)), 1).astype(np.float32)  # rounded: ties
  for top_k in (1, 2, V // 2, V - 2, V - 1, V, V + 3):
    for top_p in (1.0, 0.6):
      got = np.asarray(sampler.filter_logits(jnp.asarray(logits_BV), jnp.asarray(top_k), jnp.asarray(top_p)))
      ref = np.asarray(
        sampler._filter_sorted(
          jnp.asarray(logits_BV), -jnp.sort(-jnp.asarray(logits_BV), axis=-1), jnp.asarray(top_k),
          jnp.asarray(top_p),
        )
      )  # fmt: skip
      np.testing.assert_array_equal(got, ref, err_msg=f"top_k={top_k} top_p={top_p}")
      kept = np.isfinite(got).sum(axis=-1)
      assert np.all(kept >= min(top_k, V) if top_p == 1.0 else kept >= 1)
