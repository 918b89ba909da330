"""Rollouts: lockstep multi-turn episodes through one KV cache, their statistics, fixed-set evaluation.

Shape suffixes: B batch (rollouts), T time (new tokens of a turn), N sampled tokens, V vocab,
L MoE layers, K top-k.

  trajs = collect(params, cfg, envs, seeds, key, rcfg)          # KV-cache sampler, lockstep over turns
  stats = rollout_stats(trajs)                                   # reward, pass and invalid-call rates

One cache serves the whole batch; each turn appends every live row's new tokens (observation, then the
<|assistant|> header) with `sampler.extend` and samples the turn with `sampler.decode(feed_last=True)`
until a stop token (`chat.stop_ids()`); `envs.advance` executes the call. A row whose env raises is
marked failed (reward 0) by `envs`; the batch goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax import model
from composer_jax.configs import RLConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat, envs, sampler
from composer_jax.rl.batch import bucket


def collect(
  params: Any,
  cfg: model.ModelConfig,
  env_list: Sequence[envs.Env],
  seeds: Sequence[int],
  key: jax.Array,
  rcfg: RLConfig,
  tok: Tokenizer | None = None,
) -> list[chat.Trajectory]:
  """One episode per (env, seed), all rows in lockstep through one KV cache. Never raises for one row."""
  B = len(env_list)
  tok = chat.tokenizer(rcfg.tokenizer) if tok is None else tok
  trajs = [envs.begin(env, s, tok) for env, s in zip(env_list, seeds, strict=True)]
  header = chat.role_token_id(chat.ASSISTANT, tok)
  live = [t.status != chat.FAILED for t in trajs]
  cached = [0] * B  # tokens of trajs[b] already in the cache (the same ids, in order)
  routed = [[] for _ in range(B)]  # routing replay: experts of those cached tokens, chunks [n, L_moe, K]
  N = rcfg.max_turn_tokens
  cache = model.init_cache(cfg, B, rcfg.cache_len)
  index = 0
  stops = sampler.settings(rcfg.temperature, rcfg.top_k, 1.0, chat.stop_ids(tok), tok.pad_id)
  for turn in range(rcfg.max_turns):
    if not any(live):
      break
    deltas = [trajs[b].tokens[cached[b] :] + [header] if live[b] else [] for b in range(B)]
    T = bucket(max(len(d) for d in deltas), 16)
    if index + T + N > rcfg.cache_len:  # the context is full: the rows still going are truncated
      for b in range(B):
        if live[b]:
          trajs[b].status, trajs[b].reason = chat.TRUNCATED, f"cache_len {rcfg.cache_len}"
      break
    toks_BT = np.zeros((B, T), np.int32)
    lens_B = np.zeros((B,), np.int32)
    for b, d in enumerate(deltas):
      toks_BT[b, : len(d)], lens_B[b] = d, len(d)
    logits_BTV, cache, *ext_routed = sampler.extend(
      params, cfg, cache, toks_BT, lens_B, with_routing=rcfg.routing_replay
    )
    keys = jax.random.split(jax.random.fold_in(key, turn), B)
    out = sampler.decode(
      params,
      cfg,
      cache,
      sampler.last_logits(logits_BTV, jnp.asarray(lens_B)),
      keys,
      jnp.asarray(np.where(lens_B > 0, N, 0), jnp.int32),
      *stops,
      max_new_tokens=N,
      feed_last=jnp.asarray(True),
    )
    cache = out.cache
    ids_BN, lp_BN, n_B, index = jax.device_get((out.tokens, out.logprobs, out.lengths, out.cache["index"]))
    index = int(index)
    if rcfg.routing_replay:  # feed_last: every sampled token was fed, so its experts are known
      ext_BTLK, dec_BNLK = jax.device_get((ext_routed[0], out.routed_experts))
    for b in range(B):
      if not live[b]:
        continue
      n = int(n_B[b])
      cached[b] += len(deltas[b]) + n
      if rcfg.routing_replay:
        routed[b] += [ext_BTLK[b, : len(deltas[b])], dec_BNLK[b, :n]]
      if envs.advance(
        env_list[b],
        trajs[b],
        ids_BN[b, :n].tolist(),
        lp_BN[b, :n].tolist(),
        max_turns=rcfg.max_turns,
        tok=tok,
      ):
        live[b] = False
  for b in range(B):
    if live[b] and trajs[b].status == chat.COMPLETED:
      trajs[b].status, trajs[b].reason = chat.TRUNCATED, f"max_turns {rcfg.max_turns}"
    envs.finish(env_list[b], trajs[b])
    if rcfg.routing_replay:
      trajs[b].routed_experts = _routed_rows(routed[b], len(trajs[b]), cfg)
  return trajs


def _routed_rows(chunks: list[np.ndarray], n_tokens: int, cfg: model.ModelConfig) -> np.ndarray:
  """The experts of a trajectory's tokens [n_tokens, L_moe, K] (int16), aligned with its tokens: row t is
  the routing computed when token t was the model's input. Tokens never fed (those appended after
  the last decode) get -1, which the replaying forward reads as "route yourself"."""
  out = np.full((n_tokens, cfg.n_moe_layers, cfg.top_k), -1, np.int16)
  fed = np.concatenate(chunks)[:n_tokens] if chunks else out[:0]
  out[: len(fed)] = fed
  return out


def rollout_stats(trajs: Sequence[chat.Trajectory]) -> dict[str, float]:
  """Mean reward, pass rate (reward ≥ 1), invalid-call rate (invalid calls ÷ calls), failed rollouts."""
  calls = sum(t.info.get("turns", 0) for t in trajs)
  invalid = sum(t.info.get("invalid_calls", 0) for t in trajs)
  return {
    "reward": float(np.mean([t.reward for t in trajs])),
    "pass_rate": float(np.mean([t.reward >= 1.0 for t in trajs])),
    "invalid_call_rate": invalid / max(calls, 1),
    "turns_per_rollout": calls / max(len(trajs), 1),
    "failed_rollouts": float(sum(t.status == chat.FAILED for t in trajs)),
    "truncated_rollouts": float(sum(t.status == chat.TRUNCATED for t in trajs)),
    "tokens_per_rollout": float(np.mean([len(t) for t in trajs])),
  }


def evaluate(
  params: Any,
  cfg: model.ModelConfig,
  rcfg: RLConfig,
  n: int = 64,
  *,
  seed: int = 12345,
  temperature: float | None = None,
) -> dict[str, float]:
  """Rollout statistics of `n` fixed problems of `rcfg.env` (one rollout each; coding: the toy's) at
  the given temperature."""
  from composer_jax.rl.envs import factories

  rc = dataclasses.replace(rcfg, temperature=rcfg.temperature if temperature is None else temperature)
  if rc.env not in factories.MAKE_ONE:
    rc = dataclasses.replace(rc, env="toy")
  env_list, seeds = factories.fixed_set(rc, n, seed)
  trajs = collect(params, cfg, env_list, seeds, jax.random.key(seed), rc)
  return rollout_stats(trajs)
