"""Training, the same for every stage: train state, typed batches, the one step builder and the one loop,
orbax checkpoints, JSONL/TensorBoard metrics.

  from composer_jax import train
  step = train.step.make_step(train.step.next_token_loss(cfg, meshes), tx, cfg, schedule=..., meshes=meshes)
  state, result = train.loop.fit(state, step, config.train.schedule, hooks, name="pretrain")
"""

from composer_jax.train import batch, checkpoint, loop, metrics, pretrain, state, step
from composer_jax.train.state import TrainState, create_state

__all__ = [
  "TrainState",
  "batch",
  "checkpoint",
  "create_state",
  "loop",
  "metrics",
  "pretrain",
  "state",
  "step",
]
