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
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

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

# `heads` and `embed` both map to fsdp; a parameter with both axes (o_proj [H, v, D], Moonlight's q_proj
# [D, H, K]) is split by heads (`_CLAIMS_FIRST`), so each device holds whole per-head matrices: Muon
# orthogonalises heads where they are, with no all-to-all (dion's per-head rule). A mesh axis shards at
# most one dim of an array.
DENSE_PARAM_RULES = {
  "vocab": None,
  "embed": "fsdp",
  "heads": "fsdp",
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
# Tokens flattened to [batch·seq] split over every device of the expert mesh, in the same device order as
# (batch over replica·fsdp, seq over context). The hop between meshes moves no data only if the tokens are
# flattened device-major (`expert_parallel.device_major`; moe.py does): with several rows per device,
# plain row-major flattening interleaves devices and costs an all-to-all per layer.
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
    return _size(self.expert, EXPERT_PARAM_RULES["expert"])


class MeshMismatch(ValueError):
  """The meshes' sizes do not multiply to the devices there are (run.py prints it as one line)."""


def build_meshes(
  dense_shape: Sequence[int], expert_shape: Sequence[int], devices: Sequence[jax.Device] | None = None
) -> Meshes:
  """Both meshes from one device array; a size that doesn't match the device count is an error.

  The dense mesh's device array comes from `device_grid` (topology-aware on TPU); the expert mesh is
  the same devices in the same flat order, reshaped. So the inner axes of both meshes (fsdp·context,
  expert_fsdp) are runs of consecutive devices of that order: neighbouring chips on a TPU torus.
  """
  devices = list(jax.devices() if devices is None else devices)
  dense_shape, expert_shape = tuple(int(s) for s in dense_shape), tuple(int(s) for s in expert_shape)
  for name, shape, axes in (("dense", dense_shape, DENSE_AXES), ("expert", expert_shape, EXPERT_AXES)):
    if len(shape) != len(axes):
      raise ValueError(f"The {name} mesh shape {shape} needs {len(axes)} sizes, one per axis {axes}.")
    if math.prod(shape) != len(devices):
      raise MeshMismatch(
        f"The {name} mesh {dict(zip(axes, shape, strict=True))} has {math.prod(shape)} devices but "
        f"{len(devices)} are available; make the product of its sizes equal {len(devices)}, e.g. "
        f"{_fitting(dense_shape, expert_shape, len(devices))}."
      )
  grid = device_grid(dense_shape, devices)
  dense = Mesh(grid, DENSE_AXES, axis_types=(AxisType.Auto,) * len(DENSE_AXES))
  expert = Mesh(grid.reshape(expert_shape), EXPERT_AXES, axis_types=(AxisType.Auto,) * len(EXPERT_AXES))
  return Meshes(dense=dense, expert=expert)


def _fitting(dense_shape: tuple[int, ...], expert_shape: tuple[int, ...], devices: int) -> str:
  """Mesh flags for `devices` that keep the config's inner axes where they divide (`scaled_shapes`),
  else everything on fsdp and expert."""
  try:
    dense, expert = scaled_shapes(dense_shape, expert_shape, devices)
  except ValueError:
    dense, expert = (1, devices, 1), (devices, 1)
  flag = lambda t: "(" + ",".join(map(str, t)) + ")"  # noqa: E731
  return f"--config.mesh.dense={flag(dense)} --config.mesh.expert={flag(expert)}"


def device_grid(dense_shape: tuple[int, ...], devices: list[jax.Device]) -> np.ndarray:
  """The devices as an array of the dense mesh's shape.

  Devices with torus coordinates (TPU) go through `mesh_utils.create_device_mesh`, which lays the
  innermost mesh axes along physical links so an fsdp or context group is a compact block of chips;
  several slices (devices with distinct `slice_index`) through `create_hybrid_device_mesh`, with
  the slices along `replica` (only gradient all-reduces cross the data-centre network). Other
  devices (CPU, GPU) keep their order: a plain reshape.
  """
  flat = np.asarray(devices, dtype=object)
  if not all(hasattr(d, "coords") for d in devices):
    return flat.reshape(dense_shape)
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  replica = DENSE_AXES.index("replica")
  if slices > 1:
    if dense_shape[replica] % slices:
      raise ValueError(
        f"{slices} slices need the dense mesh's replica axis ({dense_shape[replica]}) to be a multiple "
        f"of {slices}."
      )
    dcn = tuple(slices if i == replica else 1 for i in range(len(dense_shape)))
    ici = tuple(s // d for s, d in zip(dense_shape, dcn, strict=True))
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
  return mesh_utils.create_device_mesh(dense_shape, devices, allow_split_physical_axes=True)


def make_meshes(config: Any, devices: Sequence[jax.Device] | None = None) -> Meshes:
  """The meshes of an experiment config (`config.mesh.dense`, `config.mesh.expert`)."""
  return build_meshes(config.mesh.dense, config.mesh.expert, devices)


def is_expert_param(logical_axes: Logical) -> bool:
  return "expert" in logical_axes


_CLAIMS_FIRST = ("heads",)  # logical axes that take their mesh axes before the others do


def _spec(logical_axes: Logical, rules: dict[str, Any], shape: Sequence[int] | None, mesh: Mesh):
  """Logical axes → PartitionSpec; a dim that the mesh axes don't divide stays replicated, and a mesh
  axis already taken by another dim (`_CLAIMS_FIRST` dims choose first) is not used again."""
  entries: list[Any] = [None] * len(logical_axes)
  taken: set[str] = set()
  order = sorted(range(len(logical_axes)), key=lambda i: logical_axes[i] not in _CLAIMS_FIRST)
  for i in order:
    name = logical_axes[i]
    if name is not None and name not in rules:
      raise KeyError(f"Logical axis {name!r} has no rule; known: {sorted(rules)}.")
    axis = rules.get(name) if name is not None else None
    if axis is None or taken & set(_names(axis)):
      continue
    if shape is not None and shape[i] % math.prod(mesh.shape[a] for a in _names(axis)):
      continue
    entries[i] = axis
    taken |= set(_names(axis))
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


def batch_sharding(shape: Sequence[int], meshes: Meshes) -> NamedSharding:
  """Where a host batch array of `shape` goes: rows over replica·fsdp, the second dim (time) over context,
  the rest replicated; a dim the mesh axes do not divide stays replicated (a scalar: replicated)."""
  axes = ("batch", "seq", *(None,) * max(len(shape) - 2, 0))[: len(shape)]
  return NamedSharding(meshes.dense, _spec(axes, DENSE_ACTIVATION_RULES, shape, meshes.dense))


def host(tree: Any) -> Any:
  """Every array of `tree` whole, as numpy, on this host: one process reads its arrays directly; with
  several processes an array split over all of them is gathered (`np.asarray` cannot read the shards
  other processes hold), so every process gets the same values and can take the same host-side steps
  (rollouts, parsing, grading) in lockstep."""
  from jax.experimental import multihost_utils  # noqa: PLC0415

  def one(x: Any) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(one, tree)


# Where `model.init_cache`'s arrays keep their rows: latent and rope keys [L, B, S, ·], positions and
# segment ids [B, S]; the write index is a replicated scalar.
_CACHE_ROW_DIM = {"latent": 1, "k_rope": 1, "positions": 0, "segments": 0}


def cache_shardings(cache: Any, meshes: Meshes, *, decode: bool = False) -> dict[str, NamedSharding]:
  """Shardings of a KV cache (concrete or abstract): rows over replica·fsdp like the batch, so no device
  holds the whole cache (Kimi's 256 rows × 4096 slots are 73 GB); rows that do not divide: replicated.
  `decode` (one new token per row): over replica·fsdp·context where the rows divide, as XLA lays out a
  decode step (one token leaves the context axis no sequence to split)."""
  rows = next(iter(v.shape[_CACHE_ROW_DIM[k]] for k, v in cache.items() if k in _CACHE_ROW_DIM))
  choices = (("replica", "fsdp", "context"),) * decode + (("replica", "fsdp"),)
  axes = next((a for a in choices if rows % _size(meshes.dense, a) == 0), None)

  def spec(key: str, ndim: int) -> PartitionSpec:
    entries: list[Any] = [None] * ndim
    if key in _CACHE_ROW_DIM:
      entries[_CACHE_ROW_DIM[key]] = axes
    return PartitionSpec(*entries)

  return {k: NamedSharding(meshes.dense, spec(k, len(v.shape))) for k, v in cache.items()}


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


@dataclasses.dataclass(frozen=True)
class LookupLayout:
  """How an embedding lookup runs on the dense mesh without gathering the table (`model.layers.embed`).

  The table [V, D] keeps its parameter layout (d_model over `split`); each device looks up the ids of its
  `split` group (gathered: ints are cheap) in its own column block, and an all-to-all swaps column blocks
  for whole rows. Where the token rows are not split over `split` (fewer rows than devices) the lookup
  returns its column block (`out`), and the caller's batch-layout constraint gathers rows, not the table.
  """

  table: PartitionSpec
  tokens: PartitionSpec
  out: PartitionSpec
  split: tuple[str, ...]  # mesh axes over the table's d_model; () when it is replicated
  rows_split: bool  # the token rows are split over `split` too


def lookup_layout(table_shape: Sequence[int], tokens_shape: Sequence[int], meshes: Meshes) -> LookupLayout:
  table = _spec(("vocab", "embed"), DENSE_PARAM_RULES, table_shape, meshes.dense)
  tokens = batch_sharding(tokens_shape, meshes).spec
  tokens = PartitionSpec(*tokens, *(None,) * (len(tokens_shape) - len(tokens)))
  split = _names(table[1] if len(table) > 1 else None)
  rows_split = set(split) <= set(_names(tokens[0]))
  out = PartitionSpec(*tokens, None if rows_split else table[1])
  return LookupLayout(table=table, tokens=tokens, out=out, split=split, rows_split=rows_split)


def _axis_size(meshes: Meshes, sharding: NamedSharding, dim: int) -> int:
  spec = sharding.spec
  axis = spec[dim] if dim < len(spec) else None
  if axis is None:
    return 1
  return math.prod(sharding.mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))


def _names(rule: str | tuple[str, ...] | None) -> tuple[str, ...]:
  return () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)


def _size(mesh: Any, rule: str | tuple[str, ...] | None) -> int:
  """Devices a rule's mesh axes span together (1 for a replicated logical axis)."""
  return math.prod(mesh.shape[a] for a in _names(rule))


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """The expert mesh as the expert-parallel dispatch sees it, read from this module's rules.

  experts: the mesh axes whole experts are spread over (rule of logical `expert`); tokens travel along
  them. fsdp: the axes that shard d_model inside each expert (rule of `embed` on the expert mesh),
  gathered before the expert matmuls. tokens: the axes the flattened tokens split over.
  """

  mesh: Mesh
  experts: str | tuple[str, ...]
  fsdp: str | tuple[str, ...] | None
  tokens: str | tuple[str, ...]

  def size(self, rule: str | tuple[str, ...] | None) -> int:
    return _size(self.mesh, rule)

  def param_spec(self, logical_axes: Logical) -> PartitionSpec:
    return _spec(logical_axes, EXPERT_PARAM_RULES, None, self.mesh)

  def token_spec(self) -> PartitionSpec:
    return _spec(("tokens",), EXPERT_ACTIVATION_RULES, None, self.mesh)


def expert_layout(meshes: Meshes) -> ExpertLayout:
  return ExpertLayout(
    mesh=meshes.expert,
    experts=EXPERT_PARAM_RULES["expert"],
    fsdp=EXPERT_PARAM_RULES["embed"],
    tokens=EXPERT_ACTIVATION_RULES["tokens"],
  )


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
  """The dense mesh as a fused attention kernel inside `shard_map` sees it: batch rows split over
  `batch`, queries over `seq` (context parallelism), keys and values whole along the sequence.
  balanced: the queries are in `balance_sequence` order over the `seq` shards (keys in natural order)."""

  mesh: Mesh
  batch: str | tuple[str, ...]
  seq: str | tuple[str, ...] | None
  balanced: bool = False

  def size(self, rule: str | tuple[str, ...] | None) -> int:
    return _size(self.mesh, rule)

  def spec(self, *dims: str | None) -> PartitionSpec:
    """PartitionSpec of an activation whose dims are "batch", "seq" (queries), or None (whole)."""
    return PartitionSpec(*(self.batch if d == "batch" else self.seq if d == "seq" else None for d in dims))


def attention_layout(meshes: Meshes, balanced: bool = False) -> AttentionLayout:
  return AttentionLayout(
    meshes.dense, DENSE_ACTIVATION_RULES["batch"], DENSE_ACTIVATION_RULES["seq"], balanced
  )


@dataclasses.dataclass(frozen=True)
class Degrees:
  """How many ways each logical role is split by a pair of mesh shapes (the planner's view).

  batch: rows of a batch (dense `batch`); seq: context parallelism (dense `seq`); fsdp: dense
  parameters' `embed`; experts: expert parallelism (`expert`); expert_fsdp: experts' `embed`.
  """

  devices: int
  batch: int
  seq: int
  fsdp: int
  experts: int
  expert_fsdp: int


def degrees(meshes: Meshes) -> Degrees:
  """The split degrees of (possibly abstract) meshes."""
  dense, expert = meshes.dense, meshes.expert
  return Degrees(
    devices=math.prod(dense.shape.values()),
    batch=_size(dense, DENSE_ACTIVATION_RULES["batch"]),
    seq=_size(dense, DENSE_ACTIVATION_RULES["seq"]),
    fsdp=_size(dense, DENSE_PARAM_RULES["embed"]),
    experts=_size(expert, EXPERT_PARAM_RULES["expert"]),
    expert_fsdp=_size(expert, EXPERT_PARAM_RULES["embed"]),
  )


def abstract_meshes(dense_shape: Sequence[int], expert_shape: Sequence[int]) -> Meshes:
  """Both meshes as `AbstractMesh`es: shardings and shard shapes without any devices."""
  auto = AxisType.Auto
  dense = AbstractMesh(tuple(dense_shape), DENSE_AXES, axis_types=(auto,) * len(DENSE_AXES))
  expert = AbstractMesh(tuple(expert_shape), EXPERT_AXES, axis_types=(auto,) * len(EXPERT_AXES))
  return Meshes(dense=dense, expert=expert)


def scaled_shapes(
  dense_shape: Sequence[int], expert_shape: Sequence[int], devices: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Mesh shapes for another device count: the axes that shard parameters or the sequence (fsdp,
  context, expert_fsdp: kept inside a node) stay; `replica` and `expert` absorb the rest."""
  dense, expert = list(dense_shape), list(expert_shape)
  r, e = DENSE_AXES.index("replica"), EXPERT_AXES.index("expert")
  kept_dense = math.prod(dense) // dense[r]
  kept_expert = math.prod(expert) // expert[e]
  if devices < 1 or devices % kept_dense or devices % kept_expert:
    raise ValueError(
      f"devices={devices} is not a multiple of fsdp·context = {kept_dense} and of expert_fsdp = "
      f"{kept_expert}; the planner keeps those axes and scales replica and expert."
    )
  dense[r], expert[e] = devices // kept_dense, devices // kept_expert
  return tuple(dense), tuple(expert)


def describe(meshes: Meshes) -> str:
  """One line per mesh, e.g. `dense (replica=4, fsdp=1, context=2) | expert (expert=8, expert_fsdp=1)`."""

  def fmt(mesh: Mesh) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in mesh.shape.items()) + ")"

  return f"dense {fmt(meshes.dense)} | expert {fmt(meshes.expert)} over {len(meshes.devices)} devices"
