"""The two meshes and the logical-axis rules: the only module that names mesh axes.

Dual-mesh HSDP: every device appears once in each of two meshes built from one device array.
Non-expert weights (attention, dense MLPs, norms, embeddings, router) live on the *dense* mesh
`(replica, fsdp, context)`: sharded over a narrow `fsdp` axis, replicated over `replica`, so
gradients reduce-scatter within fsdp and all-reduce across replicas; the sequence splits over
`context`. Routed-expert weights live on the *expert* mesh `(expert, expert_fsdp)`, which spreads
experts over all devices. On 8 devices, dense (4, 1, 2) and expert (8, 1) give CP=2 and EP=8 on
the same chips. Model code names logical axes only; the tables below map them per mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DENSE_AXES = ("replica", "fsdp", "context")
EXPERT_AXES = ("expert", "expert_fsdp")

# Logical names carried by parameters. `expert` in a param's axes puts it on the expert mesh.
PARAM_AXES = (
  "vocab",
  "embed",
  "heads",
  "head_dim",
  "q_lora",
  "kv_lora",
  "mlp",
  "expert",
  "expert_mlp",
  "layers",
)
# Logical names carried by activations (constraints at block and MoE boundaries).
ACTIVATION_AXES = ("batch", "seq", "act_embed", "act_heads", "act_vocab", "tokens")

DENSE_PARAM_RULES = {
  "vocab": None,
  "embed": "fsdp",
  "heads": None,
  "head_dim": None,
  "q_lora": None,
  "kv_lora": None,
  "mlp": None,
  "layers": None,
}
EXPERT_PARAM_RULES = {
  "expert": "expert",
  "embed": "expert_fsdp",
  "expert_mlp": None,
  "layers": None,
}
DENSE_ACTIVATION_RULES = {
  "batch": ("replica", "fsdp"),
  "seq": "context",
  "act_embed": None,
  "act_heads": None,
  "act_vocab": None,
}
# Tokens flattened to [batch·seq] split over every device of the expert mesh, in the same device
# order as (batch over replica·fsdp, seq over context): the hop between meshes moves no data.
EXPERT_ACTIVATION_RULES = {"tokens": ("expert", "expert_fsdp"), "act_embed": None}

Logical = Sequence[str | None]


@dataclasses.dataclass(frozen=True)
class Meshes:
  """The dense (non-expert) mesh and the expert mesh, over the same devices in the same order."""

  dense: Mesh
  expert: Mesh

  @property
  def devices(self) -> list[jax.Device]:
    return list(self.dense.devices.flat)

  @property
  def expert_parallelism(self) -> int:
    return self.expert.shape["expert"]


def build_meshes(
  dense_shape: Sequence[int], expert_shape: Sequence[int], devices: Sequence[jax.Device] | None = None
) -> Meshes:
  """Both meshes from one device list; a size that doesn't match the device count is an error."""
  devices = list(jax.devices() if devices is None else devices)
  dense_shape, expert_shape = tuple(int(s) for s in dense_shape), tuple(int(s) for s in expert_shape)
  for name, shape, axes in (("dense", dense_shape, DENSE_AXES), ("expert", expert_shape, EXPERT_AXES)):
    if len(shape) != len(axes):
      raise ValueError(f"The {name} mesh shape {shape} needs {len(axes)} sizes, one per axis {axes}.")
    if math.prod(shape) != len(devices):
      raise ValueError(
        f"The {name} mesh {dict(zip(axes, shape, strict=True))} has {math.prod(shape)} devices but "
        f"{len(devices)} are available; make the product of its sizes equal {len(devices)}."
      )
  flat = np.asarray(devices, dtype=object)
  dense = Mesh(flat.reshape(dense_shape), DENSE_AXES, axis_types=(AxisType.Auto,) * len(DENSE_AXES))
  expert = Mesh(flat.reshape(expert_shape), EXPERT_AXES, axis_types=(AxisType.Auto,) * len(EXPERT_AXES))
  return Meshes(dense=dense, expert=expert)


def make_meshes(config: Any, devices: Sequence[jax.Device] | None = None) -> Meshes:
  """The meshes of an experiment config (`config.mesh.dense`, `config.mesh.expert`)."""
  return build_meshes(config.mesh.dense, config.mesh.expert, devices)


def is_expert_param(logical_axes: Logical) -> bool:
  return "expert" in logical_axes


def _spec(logical_axes: Logical, rules: dict[str, Any], shape: Sequence[int] | None, mesh: Mesh):
  """Logical axes → PartitionSpec; a dim that the mesh axes don't divide stays replicated."""
  entries = []
  for i, name in enumerate(logical_axes):
    if name is not None and name not in rules:
      raise KeyError(f"Logical axis {name!r} has no rule; known: {sorted(rules)}.")
    axis = rules.get(name) if name is not None else None
    if axis is not None and shape is not None:
      size = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
      if shape[i] % size:
        axis = None
    entries.append(axis)
  return PartitionSpec(*entries)


def param_sharding(
  logical_axes: Logical, meshes: Meshes, shape: Sequence[int] | None = None
) -> NamedSharding:
  """Where a parameter lives: the expert mesh iff `expert` is among its logical axes."""
  if is_expert_param(logical_axes):
    return NamedSharding(meshes.expert, _spec(logical_axes, EXPERT_PARAM_RULES, shape, meshes.expert))
  return NamedSharding(meshes.dense, _spec(logical_axes, DENSE_PARAM_RULES, shape, meshes.dense))


def param_shardings(logical_tree: Any, abstract_params: Any, meshes: Meshes) -> Any:
  """A tree of NamedShardings for a tree of parameters (abstract or concrete) and their axes."""
  return jax.tree.map(
    lambda axes, p: param_sharding(axes, meshes, p.shape),
    logical_tree,
    abstract_params,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def activation_sharding(logical_axes: Logical, meshes: Meshes, *, expert: bool = False) -> NamedSharding:
  if expert:
    return NamedSharding(meshes.expert, _spec(logical_axes, EXPERT_ACTIVATION_RULES, None, meshes.expert))
  return NamedSharding(meshes.dense, _spec(logical_axes, DENSE_ACTIVATION_RULES, None, meshes.dense))


def constrain(
  x: jax.Array, logical_axes: Logical, meshes: Meshes | None, *, expert: bool = False
) -> jax.Array:
  """`with_sharding_constraint` by logical names; a no-op without meshes (single device)."""
  if meshes is None:
    return x
  spec = activation_sharding(logical_axes, meshes, expert=expert)
  if any(x.shape[i] % _axis_size(meshes, spec, i) for i in range(x.ndim)):
    return x  # e.g. a decode step with fewer tokens than devices: let XLA choose.
  return jax.lax.with_sharding_constraint(x, spec)


def _axis_size(meshes: Meshes, sharding: NamedSharding, dim: int) -> int:
  spec = sharding.spec
  axis = spec[dim] if dim < len(spec) else None
  if axis is None:
    return 1
  return math.prod(sharding.mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))


def describe(meshes: Meshes) -> str:
  """One line per mesh, e.g. `dense (replica=4, fsdp=1, context=2) | expert (expert=8, expert_fsdp=1)`."""

  def fmt(mesh: Mesh) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in mesh.shape.items()) + ")"

  return f"dense {fmt(meshes.dense)} | expert {fmt(meshes.expert)} over {len(meshes.devices)} devices"
