"""Rollouts: lockstep multi-turn episodes through a generation engine, their statistics, evaluation.

Shape suffixes: L MoE layers, K top-k.

  engine = KVCacheSampler(cfg, rcfg, tok, meshes)                 # the `Rollout` engine (rl/engine.py)
  engine.update_weights(params)
  trajs = collect(engine, envs, seeds, key, rcfg, tok)           # lockstep over turns
  stats = rollout_stats(trajs)                                   # reward, pass and invalid-call rates
  stats |= env_metrics(envs)                                     # the envs' own measures (`metrics()`)

Each turn every live row's context (ending in the <|assistant|> header) goes to the engine, which samples
the turn until a stop token (`chat.stop_ids()`); `envs.advance` executes the call. A row whose env raises
is marked failed (reward 0) by `envs`; the batch goes on. The KV-cache engine encodes only what each turn
appended (`rl.engine`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from composer_jax import model, sharding
from composer_jax.configs import RLConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat, envs
from composer_jax.rl.engine import ContextFull, KVCacheSampler, Rollout


def collect(
  engine: Rollout,
  env_list: Sequence[envs.Env],
  seeds: Sequence[int],
  key: jax.Array,
  rcfg: RLConfig,
  tok: Tokenizer,
) -> list[chat.Trajectory]:
  """One episode per (env, seed), all rows in lockstep through `engine` (its weights set beforehand):
  each turn, every live row's context (+ the <|assistant|> header) goes to `engine.generate`, and the
  environments execute the sampled calls. Never raises for one row."""
  B = len(env_list)
  trajs = [envs.begin(env, s, tok) for env, s in zip(env_list, seeds, strict=True)]
  header = chat.role_token_id(chat.ASSISTANT, tok)
  live = [t.status != chat.FAILED for t in trajs]
  routed = [[] for _ in range(B)]  # routing replay: experts of the tokens the engine encoded, in order
  engine.reset(B)
  for _ in range(rcfg.max_turns):
    if not any(live):
      break
    contexts = [trajs[b].tokens + [header] if live[b] else [] for b in range(B)]
    try:
      out = engine.generate(contexts, live, key)
    except ContextFull as e:  # the rows still going are truncated
      for b in range(B):
        if live[b]:
          trajs[b].status, trajs[b].reason = chat.TRUNCATED, str(e)
      break
    for b in range(B):
      if not live[b]:
        continue
      if out.routed is not None:
        routed[b].append(out.routed[b])
      done = envs.advance(
        env_list[b], trajs[b], out.tokens[b], out.logprobs[b], max_turns=rcfg.max_turns, tok=tok
      )
      live[b] = live[b] and not done
  for b in range(B):
    if live[b] and trajs[b].status == chat.COMPLETED:
      trajs[b].status, trajs[b].reason = chat.TRUNCATED, f"max_turns {rcfg.max_turns}"
    envs.finish(env_list[b], trajs[b])
    if rcfg.routing_replay:
      trajs[b].routed_experts = _routed_rows(routed[b], len(trajs[b]), engine.cfg)
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


def env_metrics(env_list: Sequence[envs.Env]) -> dict[str, float]:
  """Each measure of the environments that keep some (`env.metrics()` -> {name: (sum, count)}), summed
  over the batch and divided once; a measure with count 0 is left out."""
  total: dict[str, list[float]] = {}
  for env in env_list:
    for name, (num, den) in (env.metrics() if hasattr(env, "metrics") else {}).items():
      acc = total.setdefault(name, [0.0, 0.0])
      acc[0], acc[1] = acc[0] + num, acc[1] + den
  return {name: num / den for name, (num, den) in total.items() if den > 0}


def sampled_nll(trajs: Sequence[chat.Trajectory]) -> float:
  """Mean −log π of the sampled tokens under the raw model: at temperature 1 an unbiased estimate of the
  policy's entropy per sampled token."""
  lp = [x for t in trajs for x, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
  return -float(np.mean(lp)) if lp else 0.0


def _num(x: float) -> float | int:
  """An integral count as an int (the per-problem JSON stays short)."""
  return int(x) if float(x).is_integer() else float(x)


def problem_outcomes(
  env_list: Sequence[envs.Env], seeds: Sequence[int], trajs: Sequence[chat.Trajectory]
) -> dict[str, list]:
  """Per problem of an evaluation, in order: its seed, its reward, and each environment measure as
  [sum, count] (`env.metrics()`; [0, 0] where an env lacks it). Summed over the problems, a measure's
  sums and counts give `env_metrics`'s ratio; kept apart, they are the units of a bootstrap over
  problems (`stats.two_level_ci`)."""
  per_env = [env.metrics() if hasattr(env, "metrics") else {} for env in env_list]
  names = sorted({name for m in per_env for name in m})
  out: dict[str, list] = {"seed": [int(s) for s in seeds], "reward": [_num(t.reward) for t in trajs]}
  for name in names:
    out[name] = [[_num(x) for x in m.get(name, (0.0, 0.0))] for m in per_env]
  return out


def evaluate_problems(
  params: Any,
  cfg: model.ModelConfig,
  rcfg: RLConfig,
  tok: Tokenizer,
  *,
  meshes: sharding.Meshes | None = None,
  n: int = 64,
  seed: int = 12345,
  temperature: float | None = None,
  engine: Rollout | None = None,
) -> tuple[dict[str, float], dict[str, list]]:
  """`evaluate`'s statistics and the per-problem outcomes behind them (`problem_outcomes`). `engine`:
  the generation engine (default: the KV-cache sampler on `meshes`)."""
  from composer_jax.rl.envs import factories

  rc = dataclasses.replace(rcfg, temperature=rcfg.temperature if temperature is None else temperature)
  if rc.env not in factories.MAKE_ONE:
    rc = dataclasses.replace(rc, env="toy")
  env_list, seeds = factories.fixed_set(rc, n, seed)
  engine = KVCacheSampler(cfg, rc, tok, meshes) if engine is None else engine
  engine.update_weights(params)
  trajs = collect(engine, env_list, seeds, jax.random.key(seed), rc, tok)
  scores = rollout_stats(trajs) | env_metrics(env_list) | {"sampled_nll": sampled_nll(trajs)}
  return scores, problem_outcomes(env_list, seeds, trajs)


def evaluate(
  params: Any,
  cfg: model.ModelConfig,
  rcfg: RLConfig,
  tok: Tokenizer,
  *,
  meshes: sharding.Meshes | None = None,
  n: int = 64,
  seed: int = 12345,
  temperature: float | None = None,
) -> dict[str, float]:
  """Rollout statistics of `n` fixed problems of `rcfg.env` (one rollout each; coding: the toy's) at
  the given temperature, the environments' own measures (`env_metrics`) and `sampled_nll`."""
  return evaluate_problems(params, cfg, rcfg, tok, meshes=meshes, n=n, seed=seed, temperature=temperature)[0]


class ProblemLog:
  """Keeps the per-problem outcomes of each evaluation a run makes, to join them to the run's evaluation
  records afterwards (the training loop's metrics are scalars: the lists cannot travel with them).

    log = ProblemLog(functools.partial(evaluate_problems, cfg=cfg, ...))
    log.resume(data_state)                        # after a resume: the outcomes its checkpoint kept
    fit(..., evaluate=log)                        # called like `evaluate`: params -> scalar metrics
    ckpt.save(state, log.saved())                 # each checkpoint keeps the outcomes so far
    evals = log.attach(all_evals)                 # each record gains its evaluation's "problems"

  A checkpoint of step c keeps exactly the outcomes of the evaluations at steps <= c (an evaluation comes
  before its step's save), the ones the metrics file keeps when a run resumes from c; so a resumed run's
  log, like its metrics file, covers the whole run.
  """

  KEY = "eval_problems"  # the checkpoint data state's field

  def __init__(self, evaluate_problems_fn: Any):
    self._fn = evaluate_problems_fn
    self.outcomes: list[dict[str, list]] = []

  def __call__(self, params: Any) -> dict[str, float]:
    scores, problems = self._fn(params)
    self.outcomes.append(problems)
    return scores

  def saved(self) -> dict[str, list]:
    """A checkpoint's data state: the outcomes so far (a new list: an async save writes it later, after
    more evaluations may have been appended here)."""
    return {self.KEY: list(self.outcomes)}

  def resume(self, data_state: dict | None) -> None:
    """Starts from the outcomes a checkpoint's data state (`saved()`) kept; none for a fresh run, or a
    checkpoint written before the outcomes were kept (`attach` then leaves the records as they are)."""
    self.outcomes = list((data_state or {}).get(self.KEY, []))

  def attach(self, evals: list[dict]) -> list[dict]:
    """`evals` (the records of the evaluations this log saw, in order, those before a resume included)
    with "problems" added to each; unchanged when the counts differ (e.g. a checkpoint that kept none)."""
    if len(evals) != len(self.outcomes):
      return evals
    return [e | {"problems": p} for e, p in zip(evals, self.outcomes, strict=True)]
