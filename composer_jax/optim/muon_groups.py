"""How sharded Muon splits its Newton–Schulz work: each leaf's matrix view, groups of views, and per group
a mode and a set of copy axes chosen by a cost model. `optim.muon` runs what this decides; the planner
(`plan.comms`) reads the same groups, so it follows any change here.

Shape suffixes: B batch of matrices in one leaf (axes that are neither reduction nor output), M, K the
matrix sides *oriented so that M ≤ K* (NS works on the M×M Gram matrix either way: NS(Xᵀ) = NS(X)ᵀ),
N matrices stacked in a group (local), P padded N.

Per group (same mesh, same mesh axes on B, M and K, same (M, K) and dtype), every device holds `local`
matrices, whole or as shards of M and K (over the `exchange` devices that shard them). Two modes:
- **whole**: each device orthogonalises whole matrices. The local stack is padded to a multiple of
  exchange·copies (never to the device count: microsoft/dion pads a group to its shard axis only),
  each copy keeps its slice, an all_to_all over the exchange axes makes the matrices whole, NS, the
  reverse all_to_all, and an all_gather over the copies.
- **sharded**: for a few very large matrices (fewer than half the exchange devices would get a real
  one), NS runs on the shards themselves: M whole, K split over the exchange axes, the Gram matrix
  X·Xᵀ summed by a psum each step (`newton_schulz.orthogonalize_sharded`). Kimi's layer-0 MLP
  (three 7168 × 18432 matrices on 16 fsdp devices) would otherwise leave 13 of 16 devices
  orthogonalising zero padding and the other 3 a 22.6 TFLOP matrix each.
Copy axes are mesh axes that shard none of B, M, K: each holds an identical copy of the group (HSDP's
replica axis, the context axis). Splitting the group over them divides the NS FLOPs but costs the
combine; recomputing costs FLOPs but no bytes. The choice (mode and copy axes) minimises
FLOPs + `flops_per_byte`·bytes per device, with `flops_per_byte` a property of the platform
(`FLOPS_PER_BYTE`): on an accelerator small per-head matrices are recomputed on every copy (no
communication at all), large ones split; on CPU (fake devices sharing one memory) bytes are ~free.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec
from optax.contrib import MuonDimensionNumbers

from composer_jax.optim import newton_schulz

# Device FLOPs that cost as much time as sending one byte to a neighbour. TPU v5p: ~459 TFLOP/s bf16 and
# ~100 GB/s per ICI link and direction ⇒ ~4,600; H100: 989 TFLOP/s and 450 GB/s NVLink ⇒ ~2,200.
# CPU: the "devices" are threads of one process, a collective is a memory copy.
FLOPS_PER_BYTE = {"cpu": 0.0}
DEFAULT_FLOPS_PER_BYTE = 4096.0
# A matrix is orthogonalised sharded only from this many elements on (each NS step then costs a psum of
# an M×M Gram matrix, worth it only when M·K is much larger than M²/p).
SHARDED_MIN_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class MatrixView:
  """How one leaf becomes a [B, M, K] stack (M ≤ K) and which mesh axes shard each of B, M, K."""

  perm: tuple[int, ...]
  shape: tuple[int, int, int]  # (B, M, K)
  unflat: tuple[int, ...]  # the permuted shape, to undo the reshape
  axes: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # mesh axes of B, M, K
  mesh: Any  # jax Mesh (or AbstractMesh), or None without meshes
  where: NamedSharding | None  # the leaf's own sharding, pinned again after the inverse reshape

  def spec(self) -> PartitionSpec:
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in self.axes))


def normalize_dims(ndim: int, dn: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...]]:
  red = (dn.reduction_axis,) if isinstance(dn.reduction_axis, int) else tuple(dn.reduction_axis)
  out = (dn.output_axis,) if isinstance(dn.output_axis, int) else tuple(dn.output_axis)
  red, out = tuple(a % ndim for a in red), tuple(a % ndim for a in out)
  if set(red) & set(out):
    raise ValueError(f"Reduction axes {red} and output axes {out} must be disjoint.")
  return red, out


def fans(shape: tuple[int, ...], dn: MuonDimensionNumbers) -> tuple[int, int]:
  """(fan_in, fan_out): products of the reduction and of the output axis sizes."""
  red, out = normalize_dims(len(shape), dn)
  return math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)


def _merged_axes(dims: tuple[int, ...], spec: tuple, mesh) -> tuple[str, ...]:
  """Mesh axes of a reshape-merged group of dims; () when merging would break the blocked layout.

  Merging keeps each device's block contiguous only if the sharded dims lead the group (a sharded
  dim after an unsharded one interleaves). Otherwise we declare the view unsharded and let GSPMD
  gather: correct, just not communication-optimal.
  """
  names, seen_unsharded = [], False
  for d in dims:
    entry = spec[d] if d < len(spec) else None
    entry = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    entry = tuple(a for a in entry if mesh.shape[a] > 1)
    if entry and seen_unsharded:
      return ()
    seen_unsharded |= not entry
    names.extend(entry)
  return tuple(names)


def matrix_view(shape: tuple[int, ...], dn: MuonDimensionNumbers, where: NamedSharding | None) -> MatrixView:
  """The [B, M, K] view of a leaf of `shape` placed at `where` (None: no meshes), oriented M ≤ K.

  Batch axes are ordered sharded-first: a stacked expert leaf [L, E, D, F] with E over the expert
  axis becomes B = E·L, so each device's experts stay one contiguous block of B (L first would
  interleave them and force a gather). Orienting every view short side first lets a matrix and a
  transposed one (an MLP's up [D, F] and down [F, D] projections) share one group.
  """
  if len(shape) < 2:
    raise ValueError(f"Muon needs a leaf of rank >= 2; got shape {shape}. Give it dimension numbers None.")
  red, out = normalize_dims(len(shape), dn)
  if math.prod(shape[a] for a in red) > math.prod(shape[a] for a in out):
    red, out = out, red
  batch = tuple(a for a in range(len(shape)) if a not in red and a not in out)
  mesh, spec = (where.mesh, tuple(where.spec)) if where is not None else (None, ())
  if where is not None:
    batch = tuple(sorted(batch, key=lambda a: not _merged_axes((a,), spec, mesh)))
  perm = batch + red + out
  sizes = tuple(math.prod(shape[a] for a in g) for g in (batch, red, out))
  axes: tuple = ((), (), ())
  if where is not None:
    axes = tuple(_merged_axes(g, spec, mesh) for g in (batch, red, out))
  return MatrixView(perm, sizes, tuple(shape[a] for a in perm), axes, mesh, where)


def ring(n: int) -> float:
  """Fraction of a buffer each device sends in a ring all-gather / reduce-scatter over n devices."""
  return (n - 1) / n if n > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class Group:
  """Views orthogonalised together in one `shard_map`. Sizes are per device.

  local: matrices (whole or sharded) each device holds before padding (Σ B / |B's axes| over members).
  exchange: devices sharding M and K (m_size · k_size of them).
  mode: "whole" or "sharded" (module docstring).
  copy_axes, copies: the copy axes the group is split over and their size; copy axes not listed
    orthogonalise the same matrices redundantly, with no communication.
  padded: the local stack after zero padding (whole: a multiple of exchange·copies; sharded: of copies).
  slots: matrices each device orthogonalises: whole ones, or (sharded) its 1/exchange part of each.
  The copies share results by an all_gather of their slices.
  """

  members: tuple[int, ...]
  view: MatrixView
  dtype: Any
  local: int
  m_size: int
  k_size: int
  mode: str
  copy_axes: tuple[str, ...]
  copies: int
  padded: int
  slots: int

  @property
  def exchange(self) -> int:
    return self.m_size * self.k_size

  @property
  def per_device(self) -> int:
    return self.slots

  @property
  def shard_bytes(self) -> int:
    """One matrix's local shard (as the leaves hold it), in the group's dtype."""
    m, k = self.view.shape[1:]
    return m * k // self.exchange * np.dtype(self.dtype).itemsize

  @property
  def stack_bytes(self) -> int:
    """The local zero-padded stack each device builds (its largest buffer)."""
    return self.padded * self.shard_bytes

  def ns_flops(self, steps: int) -> int:
    """Newton–Schulz matmul FLOPs per device."""
    m, k = self.view.shape[1:]
    if self.mode == "sharded":
      return self.slots * newton_schulz.sharded_flops(m, k, steps, self.exchange)
    return self.slots * newton_schulz.flops(m, k, steps)

  def collective_bytes(self, steps: int) -> dict[str, int]:
    """Bytes each device sends per update: all-to-alls (there and back), all-gathers, all-reduces."""
    m, k = self.view.shape[1:]
    item = np.dtype(self.dtype).itemsize
    mine = self.padded // self.copies  # the slice of the local stack this copy orthogonalises
    if self.mode == "whole":
      a2a = 2 * (ring(self.m_size) + ring(self.k_size)) * mine * self.shard_bytes
      reduce = 0.0
    else:  # relayout (M whole, K split) there and back; a psum of the M×M Gram per step (+ the norm)
      a2a = 2 * ring(self.m_size) * mine * self.shard_bytes
      reduce = 2 * ring(self.exchange) * self.slots * (steps * m * m + 1) * item
    gather = ring(self.copies) * self.padded * self.shard_bytes
    return {"all_to_all": int(a2a), "all_gather": int(gather), "all_reduce": int(reduce)}

  def cost(self, steps: int, flops_per_byte: float) -> float:
    return self.ns_flops(steps) + flops_per_byte * sum(self.collective_bytes(steps).values())


def _flops_per_byte(mesh) -> float:
  if mesh is None or isinstance(mesh, AbstractMesh):
    return DEFAULT_FLOPS_PER_BYTE  # no devices (the planner): an accelerator
  return FLOPS_PER_BYTE.get(mesh.devices.flat[0].platform, DEFAULT_FLOPS_PER_BYTE)


def _candidates(members, view, dtype, local, sizes, free, sharded_min):
  """Every (mode, copy axes) a group may run with."""
  (_, m, k), (_, m_axes, k_axes) = view.shape, view.axes
  m_size, k_size = (math.prod(sizes[a] for a in ax) for ax in (m_axes, k_axes))
  exchange = m_size * k_size
  modes = ["whole"]
  if exchange > 1 and 2 * local <= exchange and m * k >= sharded_min and k % exchange == 0:
    modes.append("sharded")
  for mode in modes:
    for r in range(len(free) + 1):
      for copy_axes in itertools.combinations(free, r):
        copies = math.prod(sizes[a] for a in copy_axes)
        unit = exchange * copies if mode == "whole" else copies
        padded = -(-local // unit) * unit
        yield Group(
          members, view, dtype, local, m_size, k_size, mode, copy_axes, copies, padded, padded // unit
        )


def group_views(
  views: dict[int, MatrixView],
  dtypes: dict[int, Any],
  *,
  ns_steps: int = 5,
  flops_per_byte: float | None = None,
  sharded_min_elements: int = SHARDED_MIN_ELEMENTS,
) -> list[Group]:
  """Leaf index → view, NS dtype ⇒ the groups `sharded_muon` orthogonalises (the planner's input too).

  Each group takes the (mode, copy axes) of least FLOPs + flops_per_byte · bytes per device; ties go to
  fewer copies and the whole mode. flops_per_byte None: `FLOPS_PER_BYTE` of the meshes' platform.
  """
  by_key: dict[tuple, list[int]] = {}
  for i, v in views.items():
    by_key.setdefault((v.mesh, v.axes, v.shape[1:], np.dtype(dtypes[i]).name), []).append(i)
  groups = []
  for (mesh, axes, _, _), members in by_key.items():
    sizes = dict(mesh.shape) if mesh is not None else {}
    b_axes = axes[0]
    local = sum(views[i].shape[0] // math.prod(sizes[a] for a in b_axes) for i in members)
    used = set(itertools.chain(*axes))
    free = [a for a, size in sizes.items() if a not in used and size > 1]
    ratio = _flops_per_byte(mesh) if flops_per_byte is None else flops_per_byte
    view, dtype = views[members[0]], dtypes[members[0]]
    options = _candidates(tuple(members), view, dtype, local, sizes, free, sharded_min_elements)
    groups.append(min(options, key=lambda g: (g.cost(ns_steps, ratio), g.copies, g.mode != "whole")))
  return groups
