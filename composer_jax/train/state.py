"""The train state (step, params, optimizer state), its creation with explicit shardings, and the one
guarded update every step uses.

Params come from `model.init` (each leaf created in its shard on the dense or expert mesh); the
optimizer state from an eager `tx.init`, which the sharded Muon needs. Leaves that `tx.init` leaves
on a single device (scalar step counters) are moved to a replicated dense-mesh sharding so the
whole state has NamedShardings and can be both `out_shardings` of the jitted step and an orbax
restore target.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

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


def committed(tree: Any) -> Any:
  """Every array leaf committed to the device it is on. A fresh `jnp.zeros` or optax count is
  uncommitted and the jitted step's outputs are committed; jit treats the two as different signatures,
  so an uncommitted state compiles the step a second time at step 2 (~40 s on 2 CPU cores)."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, tree)


def _place(x: Any, meshes: sharding.Meshes | None) -> Any:
  if meshes is None:
    return committed(x)
  if isinstance(getattr(x, "sharding", None), NamedSharding):
    return x
  return jax.device_put(x, replicated(meshes))


def create_state(
  cfg: model.ModelConfig,
  tx: optax.GradientTransformation,
  rng: jax.Array,
  meshes: sharding.Meshes | None,
  params: Any = None,
) -> TrainState:
  """Step 0 with fresh (`model.init`) or given params (e.g. `model.load_hf_checkpoint`'s, placed on the
  same meshes) and a fresh optimizer state."""
  params = model.init(cfg, rng, meshes) if params is None else params
  opt_state = jax.tree.map(lambda x: _place(x, meshes), tx.init(params))
  step = _place(jnp.zeros((), jnp.int32), meshes)
  return TrainState(step=step, params=committed(params) if meshes is None else params, opt_state=opt_state)


def abstract_params(cfg: model.ModelConfig, meshes: sharding.Meshes) -> Any:
  """The parameters as ShapeDtypeStructs on the shardings `model.init` places them on."""
  shapes = model.abstract_params(cfg)
  where = sharding.param_shardings(model.logical_axes(cfg), shapes, meshes)
  return jax.tree.map(lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w), shapes, where)


def abstract_state(
  cfg: model.ModelConfig, tx: optax.GradientTransformation, meshes: sharding.Meshes
) -> TrainState:
  """The state `create_state` builds, as ShapeDtypeStructs on the same shardings, with nothing allocated:
  the template a checkpoint is restored into (so a resumed run never initialises or reads weights it is
  about to overwrite, nor holds them next to the restored copy) and what the compile stage lowers with.

  Optimizer leaves shaped like a parameter sit on that parameter's sharding (what `zeros_like` of a
  sharded array gives); scalar counters are replicated on the dense mesh (`_place`)."""
  params = abstract_params(cfg, meshes)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  by_path = {path: (p.sharding, p.shape) for path, p in flat}
  rep = replicated(meshes)

  def place(path, leaf):
    match = [w for p, (w, shape) in by_path.items() if path[-len(p) :] == p and shape == leaf.shape]
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=match[0] if match else rep)

  opt_state = jax.tree_util.tree_map_with_path(place, jax.eval_shape(tx.init, params))
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  return TrainState(step=step, params=params, opt_state=opt_state)


def state_shardings(state: TrainState) -> Any:
  """The state's tree of shardings (what the jitted step takes and returns)."""
  return jax.tree.map(lambda x: x.sharding, state)


class Update(NamedTuple):
  state: TrainState  # the next state (the old params and optimizer state where the step was not finite)
  updates: Any  # what the optimizer applied (lr, scaling and decay included)
  grad_norm: jax.Array
  ok: jax.Array  # bool scalar: loss and gradient norm were finite, so the update was kept


def guarded_update(
  state: TrainState,
  grads: Any,
  loss: jax.Array,
  tx: optax.GradientTransformation,
  *,
  after: Callable[[Any], Any] | None = None,
  trainable: Any = None,
) -> Update:
  """One optimizer step that a non-finite loss or gradient cannot poison.

  The update is computed and then kept only where `loss` and the global gradient norm are finite;
  otherwise the old params and optimizer state stay (the step counter still advances, so the batch
  is not retried). `after(params)` runs on the updated params (router-bias balancing, QK-clip) and is
  discarded with them. `trainable` (a bool tree) restricts the norm to trained leaves.
  """
  counted = (
    grads if trainable is None else jax.tree.map(lambda g, t: g if t else jnp.zeros(()), grads, trainable)
  )
  grad_norm = optax.tree.norm(counted)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if after is not None:
    params = after(params)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
  new = TrainState(
    step=state.step + 1, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state)
  )
  return Update(new, updates, grad_norm, ok)
