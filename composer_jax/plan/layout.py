"""The planner's view of a config: mesh shapes (kept or scaled to another device count) and every
parameter with its per-device shard and optimizer branch.

Nothing here names a mesh axis: split degrees come from `sharding.degrees`, shardings from
`sharding.param_sharding` on `AbstractMesh`es (the rule that places real parameters), so a 1T plan
needs no devices and no memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from optax.contrib import MuonDimensionNumbers

from composer_jax import model, optim, sharding
from composer_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Layout:
  """Mesh shapes the plan is for; `derived` says they were scaled from the config's to `devices`."""

  dense: tuple[int, ...]  # the dense mesh's shape, in `sharding.DENSE_AXES` order
  expert: tuple[int, ...]  # the expert mesh's shape, in `sharding.EXPERT_AXES` order
  derived: bool = False
  note: str = ""

  @property
  def devices(self) -> int:
    return math.prod(self.dense)

  def meshes(self) -> sharding.Meshes:
    return sharding.abstract_meshes(self.dense, self.expert)

  @property
  def degrees(self) -> sharding.Degrees:
    return sharding.degrees(self.meshes())


def derive_layout(dense: tuple, expert: tuple, devices: int | None, n_experts: int) -> Layout:
  """The config's meshes, or for another device count `sharding.scaled_shapes` of them (the axes that
  shard parameters or the sequence kept, replica and expert scaled)."""
  dense, expert = tuple(int(s) for s in dense), tuple(int(s) for s in expert)
  if len(dense) != len(sharding.DENSE_AXES) or len(expert) != len(sharding.EXPERT_AXES):
    raise ValueError(
      f"mesh.dense needs {len(sharding.DENSE_AXES)} sizes and mesh.expert {len(sharding.EXPERT_AXES)}; "
      f"got {dense} and {expert}."
    )
  if math.prod(dense) != math.prod(expert):
    raise ValueError(f"mesh.dense {dense} and mesh.expert {expert} cover different device counts.")
  if devices is None or devices == math.prod(dense):
    layout = Layout(dense, expert)
  else:
    new_dense, new_expert = sharding.scaled_shapes(dense, expert, devices)
    layout = Layout(
      new_dense,
      new_expert,
      derived=True,
      note=f"meshes derived for {devices} devices from dense {dense} / expert {expert}: fsdp, context and "
      "expert_fsdp kept, replica and expert scaled",
    )
  ep = layout.degrees.experts
  if n_experts % ep:
    raise ValueError(
      f"n_experts={n_experts} is not divisible by expert parallelism {ep} "
      f"(expert mesh {layout.expert}); pick a device count whose expert axis divides {n_experts}."
    )
  return layout


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One parameter: shape, dtype, logical axes, per-device placement, optimizer branch."""

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  axes: tuple
  where: NamedSharding
  label: str  # muon | adam | frozen
  dn: Any  # MuonDimensionNumbers or None

  @property
  def itemsize(self) -> int:
    return self.dtype.itemsize

  @property
  def mesh(self) -> str:
    return "expert" if sharding.is_expert_param(self.axes) else "dense"

  @property
  def stack(self) -> str | None:
    """`dense_layers` / `moe_layers` for a stacked leaf (its first axis is `layers`), else None."""
    return self.path.split("/")[0] if self.axes[:1] == ("layers",) else None

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def local_size(self) -> int:
    return math.prod(self.where.shard_shape(self.shape))

  def local_bytes(self, tpu: bool = False) -> int:
    """Bytes of this device's shard: dense, or in XLA:TPU's tiled layout (`tpu_bytes`)."""
    shard = tuple(self.where.shard_shape(self.shape))
    return tpu_bytes(shard, self.dtype) if tpu else math.prod(shard) * self.itemsize


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def tpu_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
  """Bytes of an array in XLA:TPU's memory layout: the two minor dims are tiled (8, 128) for 32-bit
  types ((16, 128) for 16-bit: two rows per sublane), a minor dim shorter than the tile padded to it.

  XLA picks each entry array's dim order to waste least (seen in `entry_computation_layout`, e.g.
  f32[1,256,80]{1,2,0:T(8,128)}: 256 minor, not 80), so this takes the best (minor, second-minor)
  pair; a second-minor dim below the tile gets the next power of two (f32[3,64]{1,0:T(4,128)}).
  """
  itemsize = np.dtype(dtype).itemsize
  if len(shape) < 2:
    return _round_up(math.prod(shape), 128) * itemsize if shape else itemsize
  sub = 32 // max(itemsize, 1) if itemsize < 4 else 8

  def rows(x: int) -> int:
    return _round_up(x, sub) if x >= sub else 1 << max(x - 1, 0).bit_length()

  best = None
  for i, minor in enumerate(shape):
    for j, second in enumerate(shape):
      if i != j:
        rest = math.prod(d for k, d in enumerate(shape) if k not in (i, j))
        size = rest * rows(second) * _round_up(minor, 128)
        best = size if best is None else min(best, size)
  return best * itemsize


def leaves(cfg: ModelConfig, layout: Layout) -> list[Leaf]:
  """Every parameter with its per-device sharding and optimizer branch."""
  meshes = layout.meshes()
  is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
  flat_axes = jax.tree_util.tree_flatten_with_path(model.logical_axes(cfg), is_leaf=is_axes)[0]
  shapes = jax.tree.leaves(model.abstract_params(cfg))
  labels = jax.tree.leaves(optim.labels(cfg))
  is_dn = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # noqa: E731
  dns = jax.tree.leaves(optim.dimension_numbers(cfg), is_leaf=is_dn)
  out = []
  for (path, axes), shape, label, dn in zip(flat_axes, shapes, labels, dns, strict=True):
    where = sharding.param_sharding(axes, meshes, shape.shape)
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    out.append(Leaf(name, tuple(shape.shape), np.dtype(shape.dtype), axes, where, label, dn))
  return out
