"""The train state (step, params, optimizer state) and its creation with explicit shardings.

Params come from `model.init` (each leaf created in its shard on the dense or expert mesh); the
optimizer state from an eager `tx.init`, which the sharded Muon needs. Leaves that `tx.init` leaves
on a single device (scalar step counters) are moved to a replicated dense-mesh sharding so the
whole state has NamedShardings and can be both `out_shardings` of the jitted step and an orbax
restore target.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from composer_jax import model, sharding


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: train steps taken (skipped non-finite steps included)
  params: Any
  opt_state: Any


def replicated(meshes: sharding.Meshes | None) -> Any:
  """Sharding of scalars and metrics: replicated over the dense mesh (None without meshes)."""
  return None if meshes is None else NamedSharding(meshes.dense, PartitionSpec())


def _place(x: Any, meshes: sharding.Meshes | None) -> Any:
  if meshes is None or isinstance(getattr(x, "sharding", None), NamedSharding):
    return x
  return jax.device_put(x, replicated(meshes))


def create_state(
  cfg: model.ModelConfig, tx: optax.GradientTransformation, rng: jax.Array, meshes: sharding.Meshes | None
) -> TrainState:
  params = model.init(cfg, rng, meshes)
  opt_state = jax.tree.map(lambda x: _place(x, meshes), tx.init(params))
  step = _place(jnp.zeros((), jnp.int32), meshes)
  return TrainState(step=step, params=params, opt_state=opt_state)


def state_shardings(state: TrainState) -> Any:
  """The state's tree of shardings (what the jitted step takes and returns)."""
  return jax.tree.map(lambda x: x.sharding, state)
