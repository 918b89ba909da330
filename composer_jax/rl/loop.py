"""The hooks that make `train.loop.fit` RL: rollouts → batch at every step, fixed-set evaluations.

  hooks = rl.loop.hooks(make_envs, cfg, rcfg, tok, meshes=meshes, evaluate=...)
  state, result = train.loop.fit(state, step, rcfg.schedule, hooks, name="rl")

Each step s draws its problems and sampling key as pure functions of (seed, s) (`make_envs(s)`), so a
resumed run continues the same run. A step whose rollouts or update raise is logged, counted in
`failed_steps` and skipped; an interrupt saves and returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from composer_jax import model, sharding
from composer_jax.configs import RLConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import envs, feedback
from composer_jax.rl.batch import (
  RLBatch,
  feedback_rules,
  micro_batched,
  micro_rows,
  rl_batch,
  without_feedback,
)
from composer_jax.rl.engine import KVCacheSampler, Rollout
from composer_jax.rl.rollout import collect, env_metrics, rollout_stats
from composer_jax.train import batch as batch_lib
from composer_jax.train import loop
from composer_jax.train.state import TrainState

EnvFactory = Callable[[int], tuple[list[envs.Env], list[int], list[int]]]


def _describe(r: dict) -> str:
  return (
    f"reward {r['reward']:.3f} pass {r['pass_rate']:.2f} invalid {r['invalid_call_rate']:.3f} "
    f"fb/rollout {r['feedback_turns_per_rollout']:.2f} fbKL {r['feedback_kl']:.4f} ent {r['entropy']:.3f} "
    f"clip {r['clip_frac']:.3f} |Δlogp| {r['logp_abs_diff']:.2e} failed {int(r['failed_rollouts'])} "
    f"rollout {r['rollout_s']:.1f}s update {r['step_s']:.1f}s"
  )


def hooks(
  make_envs: EnvFactory,
  cfg: model.ModelConfig,
  rcfg: RLConfig,
  tok: Tokenizer,
  *,
  meshes: sharding.Meshes | None = None,
  rules: feedback.FeedbackRules | None = None,
  engine: Rollout | None = None,
  evaluate: Callable[[Any], dict[str, float]] | None = None,
  save: Callable[[TrainState, bool], None] | None = None,
  **common: Any,
) -> loop.Hooks:
  """RL's hooks: the step's P × G rollouts (`make_envs(step)` gives envs, seeds, group ids) sampled by
  the current params through `engine` (default: the KV-cache sampler on `meshes`), their batch (with the
  teacher's inputs when λ > 0), and the progress line. `evaluate(params)` scores the policy on a fixed
  problem set before the first step and every `schedule.eval_every` steps: the per-step training reward mixes
  policy and problem difficulty (each step draws new problems), the fixed set separates them. `common`:
  the stage-independent hooks (check, writer)."""
  rules = feedback_rules(rcfg) if rules is None else rules
  use_fb = rcfg.lambda_feedback > 0
  engine = KVCacheSampler(cfg, rcfg, tok, meshes) if engine is None else engine
  batch_split = 1 if meshes is None else sharding.degrees(meshes).batch  # devices the rollouts split over

  def next_batch(s: int, state: TrainState) -> tuple[RLBatch, dict]:
    t0 = time.perf_counter()
    env_list, seeds, groups = make_envs(s)
    key = jax.random.fold_in(jax.random.key(rcfg.seed), s)
    engine.update_weights(state.params)  # the policy after the last update
    trajs = collect(engine, env_list, seeds, key, rcfg, tok)
    stats = rollout_stats(trajs) | env_metrics(env_list) | {"rollout_s": time.perf_counter() - t0}
    infos = [e.info() for e in env_list]
    cap = rcfg.feedback_rows
    batch = rl_batch(
      trajs, groups, infos, with_feedback=use_fb, with_penalty=rcfg.flag_penalty > 0, rules=rules,
      variant=rcfg.hint, rows_cap=cap, tok=tok, min_len=rcfg.batch_min_len, multiple=rcfg.batch_multiple,
    )  # fmt: skip
    n_fb_rows = int(np.sum(batch.feedback.teacher_lengths > 0)) if use_fb else 0
    stats["feedback_turns_per_rollout"] = n_fb_rows / len(trajs)
    # With a fixed number of teacher rows, even a batch without a flagged turn keeps the teacher's inputs
    # (its feedback term is exactly 0): one program instead of two.
    if use_fb and not (n_fb_rows or cap):
      batch = without_feedback(batch)
    B, T = batch.tokens.shape
    rows = micro_rows(B, T, rcfg.update_tokens, multiple=batch_split)
    batch = micro_batched(batch, B // rows)
    stats["update_micro_batches"] = B // rows
    return batch_lib.place(batch, meshes), stats

  return loop.Hooks(
    next_batch=next_batch,
    describe=_describe,
    evaluate=None if evaluate is None or rcfg.schedule.eval_every <= 0 else _prefixed(evaluate),
    save=None if save is None else lambda st, step, final: save(st, final),
    tolerate_failures=True,
    sync=True,
    **common,
  )


def _prefixed(evaluate: Callable[[Any], dict[str, float]]) -> Callable[[TrainState], dict[str, float]]:
  """Fixed-set metrics as `eval_<name>` (apart from the training stream's in the metrics file)."""
  return lambda state: {f"eval_{k}": v for k, v in evaluate(state.params).items()}
