"""The jitted RL step: the loss's gradient and one guarded optimizer update, with an optional EMA teacher.

  step = make_rl_step(cfg, tx, schedule, rcfg, with_feedback=True)
  state, metrics = step(state, batch)             # state donated; non-finite steps keep the old state

`with_feedback=False` compiles a step without the teacher: it serves λ = 0 and batches in which no turn
was flagged. `teacher="frozen"` keeps the weights RL started from (the SFT checkpoint) next to the
optimizer state (`TeacherState`), `teacher="ema"` an exponential moving average of the weights, so
checkpoints carry either. A frozen teacher anchors the target: with the live student as teacher, more
mistakes meant more flagged turns and more push in whatever direction the drifting teacher pointed
(benchmarks/RESULTS.md, issue 13).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from composer_jax import model
from composer_jax.configs import RLConfig
from composer_jax.rl.loss import rl_loss
from composer_jax.train.state import TrainState, guarded_update

TEACHERS = ("frozen", "live", "ema")
FEEDBACK_MODES = ("loss", "advantage")
FEEDBACK_TOKENS = ("first_divergence", "turn")
HINTS = ("task", "null")


class TeacherState(NamedTuple):
  """Optimizer state with the EMA teacher's weights next to it, so checkpoints carry the teacher."""

  inner: Any
  teacher: Any


def teacher_optimizer(tx: optax.GradientTransformation, rcfg: RLConfig) -> optax.GradientTransformation:
  """`tx` itself for the live teacher; otherwise `tx` plus the teacher's weights in `TeacherState.teacher`:
  the params `init` saw ("frozen"), or their EMA at rate `teacher_ema_rate` ("ema"). Build the RL
  state's optimizer with this, and `init` it with the params RL starts from."""
  check_config(rcfg)
  if rcfg.teacher == "live":
    return tx
  rate = 0.0 if rcfg.teacher == "frozen" else rcfg.teacher_ema_rate
  if rcfg.teacher == "ema" and not 0.0 < rate <= 1.0:
    raise ValueError(f"teacher_ema_rate must lie in (0, 1], got {rate}")

  def init(params):
    # A copy, not an alias: the step donates its state, and one buffer may not be donated twice.
    return TeacherState(tx.init(params), jax.tree.map(lambda p: jnp.array(p, copy=True), params))

  def update(grads, state, params=None):
    updates, inner = tx.update(grads, state.inner, params)
    if rate == 0.0:
      return updates, TeacherState(inner, state.teacher)
    new = optax.apply_updates(params, updates)
    return updates, TeacherState(inner, optax.incremental_update(new, state.teacher, step_size=rate))

  return optax.GradientTransformation(init, update)


def check_config(rcfg: RLConfig) -> None:
  """Clear errors for settings the step would otherwise trip over at trace time."""
  if rcfg.feedback_mode not in FEEDBACK_MODES:
    raise ValueError(f"unknown feedback_mode {rcfg.feedback_mode!r}; known: {', '.join(FEEDBACK_MODES)}")
  if rcfg.teacher not in TEACHERS:
    raise ValueError(f"unknown teacher {rcfg.teacher!r}; known: {', '.join(TEACHERS)}")
  if rcfg.feedback_tokens not in FEEDBACK_TOKENS:
    raise ValueError(f"unknown feedback_tokens {rcfg.feedback_tokens!r}; known: {', '.join(FEEDBACK_TOKENS)}")
  if rcfg.hint not in HINTS:
    raise ValueError(f"unknown hint {rcfg.hint!r}; known: {', '.join(HINTS)}")
  if rcfg.lambda_feedback < 0:
    raise ValueError(f"lambda_feedback must be ≥ 0, got {rcfg.lambda_feedback}")


def make_rl_step(
  cfg: model.ModelConfig,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  rcfg: RLConfig,
  *,
  with_feedback: bool,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """Jitted, donated step; a non-finite loss or gradient keeps the old params and optimizer state.
  Unless `rcfg.teacher == "live"`, `tx` must be `teacher_optimizer(...)`'s (the teacher is in its state)."""
  check_config(rcfg)
  loss_fn = functools.partial(rl_loss, cfg=cfg, rcfg=rcfg, with_feedback=with_feedback)
  held = rcfg.teacher != "live" and with_feedback  # the step without feedback has no teacher

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    if held and not isinstance(state.opt_state, TeacherState):
      raise ValueError(
        f'teacher="{rcfg.teacher}" needs the optimizer state of rl.step.teacher_optimizer(tx, rcfg).'
      )
    teacher = state.opt_state.teacher if held else None
    (loss, (m, aux)), grads = jax.value_and_grad(
      lambda p: loss_fn(p, batch=batch, teacher_params=teacher), has_aux=True
    )(state.params)
    balance = lambda p: model.update_router_bias(p, aux["expert_load"], rcfg.router_bias_rate)  # noqa: E731
    new, _, grad_norm, ok = guarded_update(state, grads, loss, tx, after=balance)
    out = {k: s / jnp.maximum(c, 1.0) for k, (s, c) in m.items()}
    out |= {
      "loss": loss,
      "grad_norm": grad_norm,
      "lr": jnp.asarray(schedule(state.step), jnp.float32),
      "feedback_tokens": m["feedback_kl"][1],
      "skipped": 1 - ok.astype(jnp.int32),
    }
    return new, out

  return jax.jit(step, donate_argnums=0)
