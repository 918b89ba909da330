"""The RL loop: rollouts → batch → step, in `train.loop`, with fixed-set evaluations.

  state, summary = fit(state, {False: step, True: step_fb}, make_envs, cfg, rcfg, evaluate=...)

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

from composer_jax import model
from composer_jax.configs import RLConfig
from composer_jax.rl import chat, envs, feedback
from composer_jax.rl.batch import feedback_rules, rl_batch, without_feedback
from composer_jax.rl.rollout import collect, rollout_stats
from composer_jax.train import loop
from composer_jax.train import metrics as metrics_lib
from composer_jax.train.state import TrainState

EnvFactory = Callable[[int], tuple[list[envs.Env], list[int], list[int]]]


def _describe(r: dict) -> str:
  return (
    f"reward {r['reward']:.3f} pass {r['pass_rate']:.2f} invalid {r['invalid_call_rate']:.3f} "
    f"fb/rollout {r['feedback_turns_per_rollout']:.2f} fbKL {r['feedback_kl']:.4f} ent {r['entropy']:.3f} "
    f"clip {r['clip_frac']:.3f} |Δlogp| {r['logp_abs_diff']:.2e} failed {int(r['failed_rollouts'])} "
    f"rollout {r['rollout_s']:.1f}s update {r['step_s']:.1f}s"
  )


def fit(
  state: TrainState,
  steps: dict[bool, Callable],
  make_envs: EnvFactory,
  cfg: model.ModelConfig,
  rcfg: RLConfig,
  *,
  writer: metrics_lib.MetricsWriter | None = None,
  save: Callable[[TrainState, bool], None] | None = None,
  check: Callable[[], None] | None = None,
  rules: feedback.FeedbackRules | None = None,
  evaluate: Callable[[Any], dict[str, float]] | None = None,
  name: str = "rl",
) -> tuple[TrainState, dict]:
  """RL from `state.step` to `rcfg.steps`. `steps[True]`/`steps[False]`: the step with/without the
  teacher. `make_envs(step)` gives (envs, seeds, group ids) for the step's P × G rollouts.

  `evaluate(params)` (with `rcfg.eval_every` > 0) scores the policy on a fixed problem set before the
  first step and every `eval_every` steps: the per-step training reward mixes policy and problem
  difficulty (each step draws new problems), the fixed set separates them."""
  rules = feedback_rules(rcfg) if rules is None else rules
  use_fb = rcfg.lambda_feedback > 0

  def next_batch(s: int, state: TrainState) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    env_list, seeds, groups = make_envs(s)
    key = jax.random.fold_in(jax.random.key(rcfg.seed), s)
    trajs = collect(state.params, cfg, env_list, seeds, key, rcfg)
    stats = rollout_stats(trajs) | {"rollout_s": time.perf_counter() - t0}
    infos = [e.info() for e in env_list]
    cap = rcfg.feedback_rows
    batch = rl_batch(
      trajs, groups, infos, with_feedback=use_fb, rules=rules, variant=rcfg.hint, rows_cap=cap,
      tok=chat.tokenizer(rcfg.tokenizer),
      min_len=rcfg.batch_min_len,
    )  # fmt: skip
    n_fb_rows = int(np.sum(batch["teacher_lengths"] > 0)) if use_fb else 0
    stats["feedback_turns_per_rollout"] = n_fb_rows / len(trajs)
    # With a fixed number of teacher rows, even a batch without a flagged turn takes the teacher's step
    # (its feedback term is exactly 0): one program instead of two.
    return (batch if n_fb_rows or (use_fb and cap) else without_feedback(batch)), stats

  def step_fn(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    return steps["teacher_tokens" in batch](state, batch)  # the teacher's step only for flagged turns

  hooks = loop.Hooks(
    next_batch=next_batch,
    describe=_describe,
    evaluate=None if evaluate is None or rcfg.eval_every <= 0 else _prefixed(evaluate),
    save=None if save is None else lambda st, step, final: save(st, final),
    check=check,
    writer=writer,
    tolerate_failures=True,
    sync=True,
  )
  schedule = loop.Schedule(rcfg.steps, rcfg.log_every, rcfg.eval_every, rcfg.checkpoint_every)
  state, r = loop.fit(state, step_fn, schedule, hooks, name=name)  # name: the arm in the log lines
  evals = [
    {"step": e["step"]} | {k.removeprefix("eval_"): v for k, v in e.items() if k != "step"} for e in r.evals
  ]
  return state, {
    "start_step": r.start_step,
    "steps": r.steps,
    "interrupted": r.interrupted,
    "failed_steps": r.failed_steps,
    "history": r.history,
    "evals": evals,
    "seconds": r.seconds,
  }


def _prefixed(evaluate: Callable[[Any], dict[str, float]]) -> Callable[[TrainState], dict[str, float]]:
  """Fixed-set metrics as `eval_<name>` (apart from the training stream's in the metrics file)."""
  return lambda state: {f"eval_{k}": v for k, v in evaluate(state.params).items()}
