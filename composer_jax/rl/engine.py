"""The generation engine behind RL rollouts: a `Rollout` protocol and its first implementation, the
KV-cache sampler (`rl.sampler`) on the two meshes.

Shape suffixes: B batch (rows), T time (new context tokens of a turn), N sampled tokens, L MoE layers,
K top-k.

  engine = KVCacheSampler(cfg, rcfg, tok, meshes)
  engine.update_weights(params)                       # the policy to sample (after every RL update)
  engine.reset(rows)                                  # a new lockstep batch of episodes
  out = engine.generate(contexts, live, key)          # each live row's whole context so far → one turn
  logp_BT = engine.logprobs(tokens, segment_ids)      # the trainer's view of the same tokens

`generate` takes every row's *whole* context, as a serving engine would; an engine may reuse what it has
already encoded. The KV-cache sampler keeps one cache for the batch and encodes only what was appended
since its last call (it checks that each context extends what it holds), so a multi-turn episode costs one
prefill per turn for the new observation, never the whole history. A serving engine (vLLM, SGLang, a
Tunix sampler) can take its place behind the same four calls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax import model, sharding
from composer_jax.configs import RLConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat, sampler
from composer_jax.rl.batch import bucket


class Generated(NamedTuple):
  """One turn per row; rows that were not live have empty lists."""

  tokens: list[list[int]]  # the sampled ids, a stop token included
  logprobs: list[list[float]]  # log π of each under the raw model (temperature 1, unfiltered)
  # Routing replay: for each row, the experts [n, L_moe, K] of the context tokens this call encoded followed
  # by those of the sampled ones (None unless the engine was built with routing).
  routed: list[np.ndarray] | None = None


class ContextFull(Exception):
  """The engine has no room for the next turn (the rows still going are truncated)."""


class Rollout(Protocol):
  """What the RL loop needs of a generation engine."""

  def update_weights(self, params: Any) -> None: ...

  def reset(self, rows: int) -> None: ...

  def generate(
    self, contexts: Sequence[Sequence[int]], live: Sequence[bool], key: jax.Array
  ) -> Generated: ...

  def logprobs(self, tokens: Any, segment_ids: Any) -> jax.Array: ...


def empty_cache(cfg: model.ModelConfig, rows: int, slots: int, meshes: sharding.Meshes | None) -> dict:
  """`model.init_cache`, created where it lives: on the meshes, each device allocates only its rows."""
  make = functools.partial(model.init_cache, cfg, rows, slots)
  if meshes is None:
    return make()
  return jax.jit(make, out_shardings=sharding.cache_shardings(jax.eval_shape(make), meshes))()


class KVCacheSampler:
  """`Rollout` on `rl.sampler`: one latent KV cache for the batch, rows over the dense mesh's replica·fsdp
  devices. Sampling settings (temperature, top-k, turn length, cache length, routing replay) from `rcfg`."""

  def __init__(self, cfg: model.ModelConfig, rcfg: RLConfig, tok: Tokenizer, meshes: sharding.Meshes | None):
    self.cfg, self.rcfg, self.tok, self.meshes = cfg, rcfg, tok, meshes
    self.params: Any = None
    self._stops = sampler.settings(rcfg.temperature, rcfg.top_k, 1.0, chat.stop_ids(tok), tok.pad_id)
    self._calls = 0

  def update_weights(self, params: Any) -> None:
    self.params = params

  def reset(self, rows: int) -> None:
    self._cache = empty_cache(self.cfg, rows, self.rcfg.cache_len, self.meshes)
    self._held: list[list[int]] = [[] for _ in range(rows)]  # each row's tokens in the cache, in order
    self._index, self._calls = 0, 0

  def _deltas(self, contexts: Sequence[Sequence[int]], live: Sequence[bool]) -> list[list[int]]:
    out = []
    for b, (ctx, on) in enumerate(zip(contexts, live, strict=True)):
      held = self._held[b]
      if on and list(ctx[: len(held)]) != held:
        raise ValueError(f"row {b}: the context does not extend what the cache holds (reset the engine)")
      out.append(list(ctx[len(held) :]) if on else [])
    return out

  def generate(self, contexts: Sequence[Sequence[int]], live: Sequence[bool], key: jax.Array) -> Generated:
    """Appends each live row's new context tokens (one `extend`), then samples up to `max_turn_tokens`
    per live row until a stop token (`decode`, every sampled token fed back: the cache holds the turn)."""
    if self.params is None:
      raise ValueError("no weights: call update_weights(params) first")
    deltas = self._deltas(contexts, live)
    B, N, routing = len(deltas), self.rcfg.max_turn_tokens, self.rcfg.routing_replay
    T = bucket(max(len(d) for d in deltas), 16)
    if self._index + T + N > self.rcfg.cache_len:
      raise ContextFull(f"cache_len {self.rcfg.cache_len}")
    toks_BT, lens_B = np.zeros((B, T), np.int32), np.array([len(d) for d in deltas], np.int32)
    for b, d in enumerate(deltas):
      toks_BT[b, : len(d)] = d
    logits_BTV, cache, *ext_routed = sampler.extend(
      self.params, self.cfg, self._cache, toks_BT, lens_B, meshes=self.meshes, with_routing=routing
    )
    keys = jax.random.split(jax.random.fold_in(key, self._calls), B)
    out = sampler.decode(
      self.params, self.cfg, cache, sampler.last_logits(logits_BTV, jnp.asarray(lens_B)), keys,
      jnp.asarray(np.where(lens_B > 0, N, 0), jnp.int32), *self._stops, max_new_tokens=N, meshes=self.meshes,
      feed_last=jnp.asarray(True),
    )  # fmt: skip
    self._cache, self._calls = out.cache, self._calls + 1
    ids_BN, lp_BN, n_B, index = sharding.host((out.tokens, out.logprobs, out.lengths, out.cache["index"]))
    self._index = int(index)
    tokens = [ids_BN[b, : int(n_B[b])].tolist() if lens_B[b] else [] for b in range(B)]
    logprobs = [lp_BN[b, : int(n_B[b])].tolist() if lens_B[b] else [] for b in range(B)]
    for b in range(B):
      self._held[b] += deltas[b] + tokens[b]
    routed = None
    if routing:  # feed_last: every sampled token was fed, so its experts are known
      ext_BTLK, dec_BNLK = sharding.host((ext_routed[0], out.routed_experts))
      routed = [np.concatenate([ext_BTLK[b, : lens_B[b]], dec_BNLK[b, : len(tokens[b])]]) for b in range(B)]
    return Generated(tokens, logprobs, routed)

  def logprobs(self, tokens: Any, segment_ids: Any) -> jax.Array:
    """Per-token log-probabilities [B, T] under the current weights (`sampler.score`)."""
    return sampler.score(self.params, self.cfg, tokens, segment_ids=segment_ids, meshes=self.meshes)
