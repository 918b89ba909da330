"""The RL step's loss for `train.step.make_step`, and the optimizer that holds a frozen or EMA teacher.

  tx = teacher_optimizer(optim.build_optimizer(cfg, ocfg, meshes), rcfg)
  step = train.step.make_step(loss_fn(cfg, LossSettings.of(rcfg), meshes), tx, cfg, schedule=..., ...)
  state, metrics = step(state, batch)             # state donated; non-finite steps keep the old state

The step is the one every stage uses; a batch without teacher inputs (λ = 0, or no turn
flagged) is another tree structure, so the same function compiles a program without the teacher for it.
`teacher="frozen"` keeps the weights RL started from (the SFT checkpoint) next to the
optimizer state (`TeacherState`), `teacher="ema"` an exponential moving average of the weights, so
checkpoints carry either. A frozen teacher anchors the target: a live teacher drifts with the student,
so more mistakes give more flagged turns pushing in whatever direction the drifted teacher points.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from composer_jax import model, sharding
from composer_jax.configs import RLConfig
from composer_jax.rl.batch import RLBatch
from composer_jax.rl.loss import LossSettings, policy_count, rl_loss, whole_batch_terms
from composer_jax.train.state import TrainState
from composer_jax.train.step import LossAux, LossFn

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


class RLLoss:
  """The RL loss as `train.step.make_step` takes it: the teacher of a batch with feedback inputs is the
  one held in the optimizer state (`teacher_optimizer`), or the current weights for a live teacher.

  For an update in micro-batches (`RLBatch.micro_batches`, `train.step.gradients`) it also gives what
  needs the whole batch: `whole_batch` (group advantages, kept rollouts) before the split, and `count`,
  the normaliser every micro-batch's sum is divided by."""

  def __init__(self, cfg: model.ModelConfig, ls: LossSettings, meshes: sharding.Meshes | None = None):
    self.cfg, self.ls, self.meshes = cfg, ls, meshes

  def __call__(self, params: Any, batch: RLBatch, state: TrainState) -> tuple[jax.Array, LossAux]:
    teacher = None
    if batch.feedback is not None and not self.ls.live_teacher:
      if not isinstance(state.opt_state, TeacherState):
        raise ValueError(
          "a frozen or EMA teacher needs the optimizer state of rl.step.teacher_optimizer(tx, rcfg)"
        )
      teacher = state.opt_state.teacher
    return rl_loss(params, batch, teacher, cfg=self.cfg, ls=self.ls, meshes=self.meshes)

  def whole_batch(self, batch: RLBatch) -> RLBatch:
    return whole_batch_terms(batch, self.ls)

  def count(self, batch: RLBatch) -> jax.Array:
    return policy_count(batch, self.ls)


def loss_fn(cfg: model.ModelConfig, ls: LossSettings, meshes: sharding.Meshes | None = None) -> LossFn:
  """The RL loss for `train.step.make_step` (`RLLoss`)."""
  return RLLoss(cfg, ls, meshes)
