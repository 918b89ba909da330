"""Pretraining: train state, the jitted step and loop, orbax checkpoints, JSONL/TensorBoard metrics.

from composer_jax import train
summary = train.pretrain.fit(...)   # or via pipeline stage "pretrain"
"""

from composer_jax.train import checkpoint, metrics, pretrain, state
from composer_jax.train.state import TrainState, create_state

__all__ = ["TrainState", "checkpoint", "create_state", "metrics", "pretrain", "state"]
