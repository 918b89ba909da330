"""Batched KV-cache sampling on the model: one prefill, then a compiled decode loop; and scoring.

  out = sampler.sample(params, cfg, prompts_BP, prompt_lengths_B, key, max_new_tokens=224,
                       temperature=0.9, top_k=50, stop_tokens=(eos,))
  out.tokens, out.logprobs, out.lengths                   # [B, N], [B, N], [B]
  out.routed_experts                                      # [B, N, MoE layers, top_k] for routing replay
  logp_BT = sampler.score(params, cfg, tokens_BT, segment_ids=seg_BT)   # the trainer's view

Shape suffixes: B batch, P prompt length, T new tokens in one call, N max new tokens, S cache
slots, V vocab.

Padding: prompts (and the tokens given to `extend`) are **right-padded**: row b holds
`lengths[b]` real tokens in columns 0..lengths[b]-1, anything after is padding. The cache has one
write index shared by the batch, so a call writes all rows at the same slots; padding slots get
segment id 0 (the project's padding id, see `train.losses.document_mask`) and real tokens
segment 1. `attention.attend` masks by segment and position, never by slot, so holes in the cache
are never attended, and each row's RoPE positions run 0, 1, 2, … over its real tokens only (the
next position of a row is 1 + the largest position among its segment-1 slots). A row's tokens are
therefore computed exactly as if it were alone (up to float summation order).

Log-probabilities: `Sample.logprobs[b, i]` is log softmax(model logits)[token] — the raw model
distribution at temperature 1, with no top-k/top-p filtering — the policy's log π(y_t | y_<t)
that `score` recomputes in the trainer (they agree to ~1e-6 in float32). `Sample.sample_logprobs`
is the log-probability under the distribution actually sampled from (logits / temperature,
top-k then top-p renormalised; 0 for greedy), for importance corrections against the behaviour
policy. Padding columns (i ≥ lengths[b]) hold `pad_id` and logprob 0.

Compilation: only `cfg`, `max_new_tokens` and `meshes` are static; temperature (0 = greedy),
top-k, top-p, stop tokens (padded to a multiple of 8), per-row limits, feed_last and keys are
traced, so `extend` and `decode` compile once per (batch, prompt length, cache length) and serve
every sampling setting. All loop state stays on device; the host sees only the results.

Decode steps run the MoE on every expert for each token on CPU (`decode_config`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax import backend, model, sharding
from composer_jax.model import ModelConfig

PAD_SEGMENT, REAL_SEGMENT = 0, 1


class Sample(NamedTuple):
  tokens: jax.Array  # [B, N] int32, pad_id after a row's end
  logprobs: jax.Array  # [B, N] float32, log π(token) under the raw model (T = 1, unfiltered)
  sample_logprobs: jax.Array  # [B, N] float32, under the filtered, tempered sampling distribution
  lengths: jax.Array  # [B] int32, tokens generated per row (a stop token counts and ends the row)
  cache: dict  # the KV cache after the call (see `decode`'s feed_last)
  # [B, N, MoE layers, top_k] int32: the experts each generated token was routed to when it was fed
  # to the model (the next step's input); -1 for a token never fed (the last one without feed_last).
  routed_experts: jax.Array


# --- token selection ---------------------------------------------------------------------------


# top_k up to this bound is served by `lax.top_k` over this many candidates instead of a full sort.
TOP_K_FAST = 128


def filter_logits(logits_BV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Logits with everything outside top-k, then outside the top-p nucleus, set to -inf.

  top_k = 0 and top_p >= 1 switch a filter off. Both act on values, so tokens tied with the last
  kept one are kept too. Top-p keeps the smallest set of most likely tokens whose probability
  (renormalised after top-k) reaches top_p, and always the most likely token. With
  0 < top_k ≤ min(`TOP_K_FAST`, V − 1) only that many largest logits are found (`lax.top_k`) and
  filtered, the same result as sorting the whole vocabulary.
  """
  # Fewer candidates than the vocabulary: XLA:CPU serves lax.top_k with k = V by a full sort (tiny shape,
  # [8, 128]: 95 µs) and with k = V - 1 by a partial one (24 µs).
  candidates = min(TOP_K_FAST, logits_BV.shape[-1] - 1)
  if candidates < 1:
    return _filter_sorted(logits_BV, -jnp.sort(-logits_BV, axis=-1), top_k, top_p)
  fast = (top_k > 0) & (top_k <= candidates)
  return jax.lax.cond(
    fast,
    lambda z: _filter_sorted(z, jax.lax.top_k(z, candidates)[0], top_k, top_p),
    lambda z: _filter_sorted(z, -jnp.sort(-z, axis=-1), top_k, top_p),
    logits_BV,
  )


def _filter_sorted(
  logits_BV: jax.Array, sorted_BV: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
  """`filter_logits` given the largest logits in descending order (all of them, or at least top_k)."""
  V = sorted_BV.shape[-1]
  rank_1V = jnp.arange(V)[None, :]
  keep_k_BV = jnp.broadcast_to((top_k <= 0) | (rank_1V < top_k), sorted_BV.shape)
  probs_BV = jax.nn.softmax(jnp.where(keep_k_BV, sorted_BV, -jnp.inf), axis=-1)
  mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  keep_BV = keep_k_BV & ((top_p >= 1.0) | (mass_before_BV < top_p) | (rank_1V == 0))
  threshold_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)


def select(
  logits_BV: jax.Array, keys_B: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(token_B, logprob_B under the raw model, logprob_B under the sampling distribution).

  temperature = 0 is greedy (argmax of the raw logits, first index on ties). The filters' sort is
  skipped at run time when both are off. One uniform per row from its key (`select_uniform`).
  """
  u_B = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)
  return select_uniform(logits_BV, u_B, temperature, top_k, top_p)


def select_uniform(
  logits_BV: jax.Array, u_B: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`select` given each row's uniform in [0, 1), at which the sample inverts the row's CDF. Not
  Gumbel-max: its V draws per row per token are threefry, a rolled loop on XLA:CPU (two inside every
  decode step, fold_in and noise: more ops than the tiny model); `decode` draws all uniforms once."""
  logits_BV = logits_BV.astype(jnp.float32)
  safe_t = jnp.where(temperature > 0, temperature, 1.0)
  needs_filter = (top_k > 0) | (top_p < 1.0)
  tempered_BV = jax.lax.cond(
    needs_filter, lambda z: filter_logits(z, top_k, top_p), lambda z: z, logits_BV / safe_t
  )
  sampled_B = inverse_cdf(tempered_BV, u_B)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  token_B = jnp.where(temperature > 0, sampled_B, greedy_B)
  logprob_B = _take(jax.nn.log_softmax(logits_BV, axis=-1), token_B)
  sample_logprob_B = jnp.where(temperature > 0, _take(jax.nn.log_softmax(tempered_BV, axis=-1), token_B), 0.0)
  return token_B, logprob_B, sample_logprob_B


def inverse_cdf(logits_BV: jax.Array, u_B: jax.Array) -> jax.Array:
  """A sample of softmax(logits) per row: the first index whose CDF exceeds u·total. Entries of
  probability 0 are never chosen (rounding at the top falls back to the last entry with mass)."""
  probs_BV = jnp.exp(logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True))
  cdf_BV = jnp.cumsum(probs_BV, axis=-1)
  idx_B = jnp.sum(cdf_BV <= u_B[:, None] * cdf_BV[:, -1:], axis=-1)
  V = logits_BV.shape[-1]
  last_B = V - 1 - jnp.argmax(probs_BV[:, ::-1] > 0, axis=-1)
  return jnp.minimum(idx_B, last_B).astype(jnp.int32)


def _take(x_BV: jax.Array, idx_B: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x_BV, idx_B[:, None], axis=-1)[:, 0]


# --- cache filling -----------------------------------------------------------------------------


def next_positions(cache: dict) -> jax.Array:
  """[B] RoPE position of each row's next real token: 1 + its largest cached real position."""
  real_BS = cache["segments"] > PAD_SEGMENT
  return jnp.max(jnp.where(real_BS, cache["positions"] + 1, 0), axis=1).astype(jnp.int32)


def last_logits(logits_BTV: jax.Array, lengths_B: jax.Array) -> jax.Array:
  """[B, V] logits at each row's last real column (the next-token distribution)."""
  idx_B = jnp.clip(lengths_B - 1, 0, logits_BTV.shape[1] - 1)
  return jnp.take_along_axis(logits_BTV, idx_B[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "meshes", "with_routing"))
def extend(
  params: dict,
  cfg: ModelConfig,
  cache: dict,
  tokens: jax.Array,
  lengths: jax.Array,
  *,
  meshes: sharding.Meshes | None = None,
  with_routing: bool = False,
) -> tuple[jax.Array, ...]:
  """Append right-padded tokens [B, T] (row b: `lengths[b]` real ones) to a cache in one forward.

  Returns logits [B, T, V] (float32; row b's columns ≥ lengths[b] are meaningless) and the cache;
  with_routing adds the experts each token was routed to, int32 [B, T, MoE layers, top_k] (-1 on
  padding columns), for routing replay in the trainer (`model.apply(routed_experts=...)`).
  This is `model.apply` with a cache and T > 1 tokens — it already writes T slots at the cache
  index and lets each query see the cache plus the earlier new tokens — given positions that
  continue each row's own count and segment ids that hide the padding. Used for the prompt
  prefill, for appending an observation between turns, and for a teacher that reuses the
  student's prefix KV (the input cache is not donated, so one prefix can be extended many times).
  The caller must leave room: index + T ≤ cache slots (a dynamic slice would silently clamp).
  """
  tokens_BT = jnp.asarray(tokens, jnp.int32)
  B, T = tokens_BT.shape
  real_BT = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
  pos_BT = next_positions(cache)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  seg_BT = jnp.where(real_BT, REAL_SEGMENT, PAD_SEGMENT).astype(jnp.int32)
  # Padding must be a valid id: an out-of-range one embeds as NaN, and NaN values times a zero
  # attention weight would still poison the real rows.
  tokens_BT = jnp.where(real_BT, tokens_BT, 0)
  logits_BTV, aux = model.apply(params, cfg, tokens_BT, pos_BT, cache, segment_ids=seg_BT, meshes=meshes)
  if not with_routing:
    return logits_BTV, aux["cache"]
  routed_BTLK = jnp.where(real_BT[:, :, None, None], jnp.moveaxis(aux["routed_experts"], 0, 2), -1)
  return logits_BTV, aux["cache"], routed_BTLK


# --- decoding ----------------------------------------------------------------------------------


def decode_config(cfg: ModelConfig) -> ModelConfig:
  """The config of the one-token decode steps on CPU: layers one by one (`decode` splits the stacks
  once, `model.unstack_layers`) and the MoE computing every expert for each of the B tokens ("dense":
  B·E rows, exact, dropless, no sort). Why (benchmark shape, B = 8, CPU): slicing each layer out of
  the stacks inside the loop copied all expert weights every step (15.6 → 5.6 ms CPU per step); the
  training default "blocked" pads every expert's rows to `expert_block` (128), and a capacity path
  with room for every assignment multiplies E·B·top_k rows. Other platforms keep their config.
  """
  if backend.expert_impl(cfg.expert_impl) != "blocked":
    return cfg
  return dataclasses.replace(cfg, expert_impl="dense", scan_layers=False)


class _Settings(NamedTuple):
  """The traced sampling settings of one `decode` call."""

  uniforms: jax.Array  # [B, N]: row b's uniform for its t-th token, all drawn before the loop
  max_new: jax.Array  # [B]
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  stop_tokens: jax.Array  # [S]


def _sample_step(s: dict, o: _Settings) -> dict:
  """Samples one token for every live row from `s["logits"]` and writes it at column t."""
  u_B = jax.lax.dynamic_index_in_dim(o.uniforms, jnp.minimum(s["t"], o.uniforms.shape[1] - 1), 1, False)
  token_B, logprob_B, sample_logprob_B = select_uniform(s["logits"], u_B, o.temperature, o.top_k, o.top_p)
  live_B = s["live"]
  stopped_B = jnp.any(token_B[:, None] == o.stop_tokens[None, :], axis=-1)

  def write(x_BN, v_B):  # rows that are not live keep column t as it is (pad / 0)
    old_B = jax.lax.dynamic_index_in_dim(x_BN, s["t"], 1, keepdims=False)
    return jax.lax.dynamic_update_slice_in_dim(x_BN, jnp.where(live_B, v_B, old_B)[:, None], s["t"], 1)

  return {
    **s,
    "t": s["t"] + 1,
    "tokens": write(s["tokens"], token_B),
    "logprobs": write(s["logprobs"], logprob_B),
    "sample_logprobs": write(s["sample_logprobs"], sample_logprob_B),
    "lengths": s["lengths"] + live_B,
    "live": live_B & ~stopped_B & (s["lengths"] + 1 < o.max_new),
    "pending": live_B,  # sampled this iteration, not yet in the cache
    "last": token_B,
  }


def _feed(s: dict, params: dict, cfg: ModelConfig, meshes) -> dict:
  """Runs the model on the last sampled tokens (rows that are done feed padding): the cache gets their
  entries in place, `logits` the next distribution, `routed` their experts at column t − 1."""
  step_logits_B1V, cache, routed_B1LK = extend(
    params,
    decode_config(cfg),
    s["cache"],
    s["last"][:, None],
    s["pending"].astype(jnp.int32),
    meshes=meshes,
    with_routing=True,
  )
  return {
    **s,
    "cache": cache,
    "logits": step_logits_B1V[:, 0],
    "pending": jnp.zeros_like(s["pending"]),
    "routed": jax.lax.dynamic_update_slice_in_dim(s["routed"], routed_B1LK, s["t"] - 1, axis=1),
  }


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "meshes"))
def decode(
  params: dict,
  cfg: ModelConfig,
  cache: dict,
  logits: jax.Array,
  keys: jax.Array,
  max_new: jax.Array,
  temperature: jax.Array,
  top_k: jax.Array,
  top_p: jax.Array,
  stop_tokens: jax.Array,
  pad_id: jax.Array,
  *,
  max_new_tokens: int,
  meshes: sharding.Meshes | None = None,
  feed_last: bool | jax.Array = False,
) -> Sample:
  """Sample up to `max_new_tokens` tokens per row from a filled cache, in one compiled loop.

  logits: [B, V] next-token logits for each row (from `extend` via `last_logits`).
  keys: [B] PRNG keys, one per row (a row's samples don't depend on the rest of the batch).
  max_new: [B] per-row limit (≤ max_new_tokens; 0 samples nothing). stop_tokens: [S] ids (pad
  with -1); a row ends after emitting one. temperature, top_k, top_p, pad_id, feed_last: traced
  scalars (`settings` builds the middle five).

  The loop samples one token for every live row, then, while any row is live, runs the model on those
  tokens (finished rows feed padding) and samples again: max(lengths) − 1 forwards. The cache is loop
  state updated in place (`model.apply` writes each layer's entries into the carried buffer). With
  feed_last the final tokens are fed too (one more forward, outside the loop), so the returned cache
  holds every generated token, ready for `extend` with the next observation; the cache needs index +
  max_new_tokens free slots then (index + max_new_tokens - 1 without). `Sample.routed_experts` records,
  for each generated token, the experts it was routed to when fed (the step that computes its cache
  entry), so the final token has them only with feed_last.
  """
  B, _ = logits.shape
  N = max_new_tokens
  u_BN = jax.vmap(lambda k: jax.random.uniform(k, (N,)))(keys)
  if not decode_config(cfg).scan_layers:  # per-layer weights sliced once, not in every step
    params = model.unstack_layers(params, cfg)
  o = _Settings(u_BN, jnp.minimum(jnp.asarray(max_new, jnp.int32), N), temperature, top_k, top_p, stop_tokens)
  state = {
    "t": jnp.zeros((), jnp.int32),
    "cache": cache,
    "logits": logits.astype(jnp.float32),
    "tokens": jnp.full((B, N), pad_id, jnp.int32),
    "logprobs": jnp.zeros((B, N), jnp.float32),
    "sample_logprobs": jnp.zeros((B, N), jnp.float32),
    "lengths": jnp.zeros((B,), jnp.int32),
    "live": o.max_new > 0,
    "pending": jnp.zeros((B,), bool),
    "last": jnp.zeros((B,), jnp.int32),
    "routed": jnp.full((B, N, cfg.n_moe_layers, cfg.top_k), -1, jnp.int32),
  }
  s = _sample_step(state, o)  # a no-op for rows with max_new 0
  s = jax.lax.while_loop(
    lambda s: jnp.any(s["live"]), lambda s: _sample_step(_feed(s, params, cfg, meshes), o), s
  )
  s = jax.lax.cond(
    jnp.asarray(feed_last, bool) & jnp.any(s["pending"]),
    lambda s: _feed(s, params, cfg, meshes),
    lambda s: s,
    s,
  )
  return Sample(s["tokens"], s["logprobs"], s["sample_logprobs"], s["lengths"], s["cache"], s["routed"])


def sample(
  params: dict,
  cfg: ModelConfig,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  *,
  max_new_tokens: int,
  max_new: jax.Array | None = None,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  stop_tokens: Sequence[int] | jax.Array = (),
  pad_id: int = 0,
  cache_len: int | None = None,
  feed_last: bool = False,
  meshes: sharding.Meshes | None = None,
) -> Sample:
  """Prefill right-padded prompts [B, P] and sample up to `max_new_tokens` new tokens per row.

  key: one PRNG key (split into one per row) or [B] keys (per-row reproducibility: a row gets
  the same tokens whatever else is in the batch). max_new: [B] per-row limits (default all
  `max_new_tokens`). cache_len: slots to allocate (default P + max_new_tokens; more leaves room
  for later turns). See the module docstring for padding and the two logprobs.
  """
  prompts = jnp.asarray(prompts, jnp.int32)
  B, P = prompts.shape
  cache_len = P + max_new_tokens if cache_len is None else cache_len
  if cache_len < P + max_new_tokens:
    raise ValueError(f"cache_len={cache_len} < prompt {P} + max_new_tokens {max_new_tokens}.")
  if not isinstance(prompt_lengths, jax.core.Tracer):
    lengths = np.asarray(prompt_lengths)
    if lengths.shape != (B,) or lengths.min() < 1 or lengths.max() > P:
      raise ValueError(f"prompt_lengths must be [{B}] values in [1, {P}]; got {lengths.tolist()}.")
  keys = _row_keys(key, B)
  logits_BPV, cache = extend(
    params, cfg, model.init_cache(cfg, B, cache_len), prompts, prompt_lengths, meshes=meshes
  )
  return decode(
    params,
    cfg,
    cache,
    last_logits(logits_BPV, jnp.asarray(prompt_lengths, jnp.int32)),
    keys,
    jnp.full((B,), max_new_tokens, jnp.int32) if max_new is None else jnp.asarray(max_new, jnp.int32),
    *settings(temperature, top_k, top_p, stop_tokens, pad_id),
    max_new_tokens=max_new_tokens,
    meshes=meshes,
    feed_last=jnp.asarray(feed_last, bool),
  )


def settings(temperature, top_k, top_p, stop_tokens, pad_id) -> tuple[jax.Array, ...]:
  """The traced sampling settings of `decode`, as arrays. Stop tokens are padded with -1 to a
  multiple of 8, so changing the stop set rarely changes a shape (and never recompiles below 8)."""
  stops = np.asarray(stop_tokens, np.int32).reshape(-1)
  width = max(8, -(-len(stops) // 8) * 8)
  stops = np.pad(stops, (0, width - len(stops)), constant_values=-1)
  return (
    jnp.asarray(temperature, jnp.float32),
    jnp.asarray(top_k, jnp.int32),
    jnp.asarray(top_p, jnp.float32),
    stops,
    jnp.asarray(pad_id, jnp.int32),
  )


def _row_keys(key: jax.Array, batch: int) -> jax.Array:
  key = jnp.asarray(key)
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)  # raw uint32 keys from jax.random.PRNGKey
  return jax.random.split(key, batch) if key.ndim == 0 else key


# --- scoring -----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg", "meshes"))
def score(
  params: dict,
  cfg: ModelConfig,
  tokens: jax.Array,
  positions: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  *,
  temperature: float | jax.Array = 1.0,
  meshes: sharding.Meshes | None = None,
) -> jax.Array:
  """Per-token log-probabilities [B, T] (float32) of `tokens` under the model, in one forward.

  Aligned with tokens: out[b, t] = log softmax(logits[b, t-1] / temperature)[tokens[b, t]] where
  token t has a predecessor in its own document (segment_ids[t] == segment_ids[t-1] != 0), else 0
  — the same targets as `train.losses.next_token_loss`. positions default to 0..T-1 and
  segment_ids to all ones. For a sampled row [prompt | generated], out[b, len_b + i] equals
  `Sample.logprobs[b, i]` at temperature 1.
  """
  tokens_BT = jnp.asarray(tokens, jnp.int32)
  B, T = tokens_BT.shape
  seg_BT = jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  logits_BTV, _ = model.apply(params, cfg, tokens_BT, positions, segment_ids=seg_BT, meshes=meshes)
  logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  valid_BT = (seg_BT[:, 1:] == seg_BT[:, :-1]) & (seg_BT[:, 1:] != PAD_SEGMENT)
  return jnp.pad(jnp.where(valid_BT, logp_BT, 0.0), ((0, 0), (1, 0)))
