"""Sharded Muon: Muon whose Newton–Schulz work is split across devices by whole matrices.

Shape suffixes: B batch of matrices in one leaf (axes that are neither reduction nor output),
M reduction (fan-in), K output (fan-out), N matrices stacked in a group (local), P padded N.

Data flow (DESIGN.md "Sharded Muon"; notes/muon.md §4, the algorithm of microsoft/dion's
`megabatch_orthogonalize_async`): momentum → per-leaf [B, M, K] views → group views with equal
(mesh, sharding, M, K, dtype) → in one `shard_map` per group: stack the local blocks, pad to a
multiple of the devices that shard M/K, `all_to_all` so each device holds whole matrices, normalise
*after* the gather (§6), Newton–Schulz, `all_to_all` back → RMS scale → decoupled weight decay →
× −lr. Views sharded only on B (experts on the expert axis, heads) or replicated run locally with
no communication. Groups are independent, so XLA may overlap one group's all-to-all with another's
NS. Momentum, bias correction and Nesterov follow `optax.contrib.scale_by_muon` exactly, so the
result equals `optax.contrib.muon` (same dimension numbers, `consistent_rms=0.2`) to float error.

Why a `shardings` argument: inside `jit` an Auto-axes tracer reports its mesh but not its
PartitionSpec, so the layout each group's `shard_map` must assume is given up front (build_optimizer
derives it from the logical axes, exactly as `model.init` places the parameters).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from optax.contrib import MuonDimensionNumbers

from composer_jax import sharding
from composer_jax.optim import newton_schulz

_RMS_SCALES = ("moonlight", "jordan")


class ShardedMuonState(NamedTuple):
  count: jax.Array  # [] int32, steps taken
  mu: Any  # params-shaped EMA of gradients; optax.MaskedNode where dimension numbers are None


@dataclasses.dataclass(frozen=True)
class MatrixView:
  """How one leaf becomes a [B, M, K] stack and which mesh axes shard each of B, M, K."""

  perm: tuple[int, ...]
  shape: tuple[int, int, int]  # (B, M, K)
  unflat: tuple[int, ...]  # the permuted shape, to undo the reshape
  axes: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # mesh axes of B, M, K
  mesh: Any  # jax Mesh, or None without meshes
  where: NamedSharding | None  # the leaf's own sharding, pinned again after the inverse reshape

  def spec(self) -> PartitionSpec:
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in self.axes))


def _normalize_dims(ndim: int, dn: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...]]:
  red = (dn.reduction_axis,) if isinstance(dn.reduction_axis, int) else tuple(dn.reduction_axis)
  out = (dn.output_axis,) if isinstance(dn.output_axis, int) else tuple(dn.output_axis)
  red, out = tuple(a % ndim for a in red), tuple(a % ndim for a in out)
  if set(red) & set(out):
    raise ValueError(f"Reduction axes {red} and output axes {out} must be disjoint.")
  return red, out


def fans(shape: tuple[int, ...], dn: MuonDimensionNumbers) -> tuple[int, int]:
  """(fan_in, fan_out): products of the reduction and of the output axis sizes."""
  red, out = _normalize_dims(len(shape), dn)
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
  """The [B, M, K] view of a leaf of `shape` placed at `where` (None: no meshes).

  Batch axes are ordered sharded-first: a stacked expert leaf [L, E, D, F] with E over the expert
  axis becomes B = E·L, so each device's experts stay one contiguous block of B (L first would
  interleave them and force a gather).
  """
  if len(shape) < 2:
    raise ValueError(f"Muon needs a leaf of rank >= 2; got shape {shape}. Give it dimension numbers None.")
  red, out = _normalize_dims(len(shape), dn)
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


@dataclasses.dataclass(frozen=True)
class Group:
  """Views orthogonalised together in one `shard_map`: same mesh, same mesh axes on B, M and K, same
  (M, K) and dtype. Sizes are per device.

  local: whole-or-sharded matrices each device holds before padding (Σ B / |B's axes| over members).
  exchange: devices sharding M and K: the all-to-all that makes matrices whole runs over them.
  copy_axes, copies: mesh axes that shard none of B, M, K (each holds an identical copy of the group)
    and that split the NS work among them, and their size; copy axes not listed (a group too small for
    them) orthogonalise their share redundantly, with no all-gather.
  padded: the local stack after zero padding, a multiple of exchange·copies; each device
    orthogonalises padded / (exchange·copies) whole matrices.
  """

  members: tuple[int, ...]
  view: MatrixView
  dtype: Any
  local: int
  exchange: int
  copy_axes: tuple[str, ...]
  copies: int
  padded: int

  @property
  def per_device(self) -> int:
    return self.padded // (self.exchange * self.copies)


def group_views(views: dict[int, MatrixView], dtypes: dict[int, Any]) -> list[Group]:
  """Leaf index → view, dtype ⇒ the groups `sharded_muon` orthogonalises (the planner's input too).

  The copies that split a group's NS work are the largest set of copy axes with at most one whole
  matrix per device each: a group of 2 matrices on 1024 devices is padded to its 16 fsdp devices,
  not to 1024 (dion pads to the exchange axis only; notes/accelerators.md), while a large group
  is spread over all copies.
  """
  by_key: dict[tuple, list[int]] = {}
  for i, v in views.items():
    by_key.setdefault((v.mesh, v.axes, v.shape[1:], dtypes[i]), []).append(i)
  groups = []
  for (mesh, axes, _, dtype), members in by_key.items():
    shape = dict(mesh.shape) if mesh is not None else {}
    b_axes, m_axes, k_axes = axes
    exchange = math.prod(shape[a] for a in m_axes + k_axes)
    local = sum(views[i].shape[0] // math.prod(shape[a] for a in b_axes) for i in members)
    used = set(b_axes + m_axes + k_axes)
    free = [a for a, size in shape.items() if a not in used and size > 1]
    subsets = (c for r in range(len(free) + 1) for c in itertools.combinations(free, r))
    fitting = [c for c in subsets if math.prod(shape[a] for a in c) <= -(-local // exchange)]
    copy_axes = max(fitting, key=lambda c: math.prod(shape[a] for a in c))
    copies = math.prod(shape[a] for a in copy_axes)
    padded = local + (-local % (exchange * copies))
    groups.append(Group(tuple(members), views[members[0]], dtype, local, exchange, copy_axes, copies, padded))
  return groups


def _lookup(tree: Any, is_leaf: Callable[[Any], bool]) -> Callable[[tuple], Any]:
  """Path → value for a tree that may be a prefix of the params (as optax masks are)."""
  table = dict(jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0])

  def find(path: tuple) -> Any:
    for k in range(len(path), -1, -1):
      if path[:k] in table:
        return table[path[:k]]
    raise KeyError(f"No entry for {jax.tree_util.keystr(path)} in {tree!r:.200}.")

  return find


def _is_dn_leaf(x: Any) -> bool:
  return x is None or isinstance(x, MuonDimensionNumbers)


def _is_sharding_leaf(x: Any) -> bool:
  return x is None or isinstance(x, NamedSharding)


def _axis_name(axes: tuple[str, ...]) -> str | tuple[str, ...]:
  return axes[0] if len(axes) == 1 else axes


def _orthogonalize_group(xs_BMK: list[jax.Array], group: Group, coeffs_S3, norm_scale: float, eps: float):
  """One group's local blocks → whole matrices by all_to_all → NS → back (runs inside shard_map).

  Mesh axes that shard none of B, M, K hold identical copies of the group (the replica axis of
  HSDP, an fsdp axis of size 1 aside). Rather than orthogonalise every matrix on every copy, each
  copy takes 1/r of the whole matrices and an all_gather over those axes restores the rest: NS
  work per device is the group's total ÷ (all devices), the ideal (when the group is large enough;
  `group_views`).
  """
  counts = [x.shape[0] for x in xs_BMK]
  x_NMK = jnp.concatenate(xs_BMK, axis=0) if len(xs_BMK) > 1 else xs_BMK[0]
  _, m_axes, k_axes = group.view.axes
  free, copies = group.copy_axes, group.copies
  n = x_NMK.shape[0]
  pad = group.padded - n
  if pad:
    x_NMK = jnp.concatenate([x_NMK, jnp.zeros((pad,) + x_NMK.shape[1:], x_NMK.dtype)], axis=0)
  # Rows then columns: [P, M/m, K/k] → [P/m, M, K/k] → [P/(m·k), M, K], whole matrices per device.
  if m_axes:
    x_NMK = jax.lax.all_to_all(x_NMK, _axis_name(m_axes), 0, 1, tiled=True)
  if k_axes:
    x_NMK = jax.lax.all_to_all(x_NMK, _axis_name(k_axes), 0, 2, tiled=True)
  if copies > 1:  # this copy's share of the whole matrices
    share = x_NMK.shape[0] // copies
    x_NMK = jax.lax.dynamic_slice_in_dim(x_NMK, jax.lax.axis_index(free) * share, share, axis=0)
  y_NMK = newton_schulz.orthogonalize(x_NMK, coeffs_S3, norm_scale, eps)
  if copies > 1:
    y_NMK = jax.lax.all_gather(y_NMK, free, axis=0, tiled=True)
  if k_axes:
    y_NMK = jax.lax.all_to_all(y_NMK, _axis_name(k_axes), 2, 0, tiled=True)
  if m_axes:
    y_NMK = jax.lax.all_to_all(y_NMK, _axis_name(m_axes), 1, 0, tiled=True)
  y_NMK = y_NMK[:n]
  splits = [sum(counts[:i]) for i in range(1, len(counts))]
  return jnp.split(y_NMK, splits, axis=0) if splits else [y_NMK]


def _momentum(g, m, count, beta: float, nesterov: bool):
  """(new EMA, the vector to orthogonalise), exactly `optax.contrib.scale_by_muon`'s formula.

  EMA mu = β·mu + (1 − β)·g with bias correction; Nesterov β·mu/(1 − β^(t+1)) + (1 − β)·g/(1 − β^t).
  """
  mu = (1 - beta) * g + beta * m
  if not nesterov:
    return mu, mu / (1 - beta**count).astype(g.dtype)
  bc_next = (1 - beta ** optax.safe_increment(count)).astype(g.dtype)
  bc_now = (1 - beta**count).astype(g.dtype)
  return mu, beta * (mu / bc_next) + (1 - beta) * (g / bc_now)


def _orthogonalize_all(mu_hats: dict, views: dict, coeffs_S3, norm_scale: float, eps: float) -> dict:
  """Leaf index → orthogonalised leaf; one shard_map per group of same-layout [B, M, K] views."""
  out = {}
  for group in group_views(views, {i: x.dtype for i, x in mu_hats.items()}):
    members, v0 = group.members, group.view

    def body(*xs_BMK, group=group):
      return tuple(_orthogonalize_group(list(xs_BMK), group, coeffs_S3, norm_scale, eps))

    xs_BMK = [mu_hats[i].transpose(views[i].perm).reshape(views[i].shape) for i in members]
    if v0.mesh is None:
      ys_BMK = body(*xs_BMK)
    else:
      specs = tuple(views[i].spec() for i in members)
      # all_gather over the replica axes makes the output equal on every copy, but shard_map's
      # replication check can't infer that through it (jax has no public invariant all_gather).
      check = group.copies == 1
      ys_BMK = jax.shard_map(body, mesh=v0.mesh, in_specs=specs, out_specs=specs, check_vma=check)(*xs_BMK)
    for i, y_BMK in zip(members, ys_BMK, strict=True):
      perm = views[i].perm
      y = y_BMK.reshape(views[i].unflat).transpose(tuple(sorted(range(len(perm)), key=perm.__getitem__)))
      # GSPMD may not propagate a sharding back through a merged reshape; keep the leaf's layout.
      out[i] = y if views[i].where is None else jax.lax.with_sharding_constraint(y, views[i].where)
  return out


def _rms_scale(shape: tuple[int, ...], dn: MuonDimensionNumbers, kind: str) -> float:
  """Moonlight: 0.2·sqrt(max(fan_in, fan_out)) (arXiv 2502.16982 eq. 4); Jordan: sqrt(max(1, out/in))."""
  fan_in, fan_out = fans(shape, dn)
  if kind == "moonlight":
    return 0.2 * math.sqrt(max(fan_in, fan_out))
  return math.sqrt(max(1.0, fan_out / fan_in))


def sharded_muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  dimension_numbers: Any,
  meshes: sharding.Meshes | None = None,
  shardings: Any = None,
  ns_coeffs: str = "quintic",
  ns_steps: int = 5,
  beta: float = 0.95,
  nesterov: bool = True,
  weight_decay: float = 0.0,
  rms_scale: str = "moonlight",
  eps: float = 1e-8,
) -> optax.GradientTransformation:
  """Muon (Jordan 2024; Moonlight scaling, Liu et al. arXiv 2502.16982) with NS spread over devices.

  dimension_numbers: a tree (or prefix) of `optax.contrib.MuonDimensionNumbers | None` over the
    params; None leaves pass through unchanged (route them elsewhere, e.g. `build_optimizer`).
  meshes: None ⇒ plain batched NS (no shard_map). Otherwise `shardings` is required.
  shardings: a tree (or prefix) of the params' `NamedSharding`s (dense or expert mesh).
  rms_scale: "moonlight" ⇒ × 0.2·sqrt(max(fan_in, fan_out)) (optax `consistent_rms=0.2`);
    "jordan" ⇒ × sqrt(max(1, fan_out/fan_in)) (optax `consistent_rms=None`).
  Call `init` eagerly (or jit it with `out_shardings`): under jit, zeros of an Auto-mesh array lose
  their sharding (notes/muon.md §8).
  """
  if rms_scale not in _RMS_SCALES:
    raise ValueError(f"rms_scale must be one of {_RMS_SCALES}; got {rms_scale!r}.")
  coeffs_S3, norm_scale = newton_schulz.coefficients(ns_coeffs, ns_steps)
  if meshes is not None and shardings is None:
    raise ValueError("sharded_muon(meshes=...) needs `shardings`: a tree of the params' NamedShardings.")
  find_dn = _lookup(dimension_numbers, _is_dn_leaf)
  find_where = _lookup(shardings, _is_sharding_leaf) if meshes is not None else (lambda path: None)

  def init_fn(params):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    mu = [optax.MaskedNode() if find_dn(p) is None else jnp.zeros_like(x) for p, x in leaves]
    return ShardedMuonState(count=jnp.zeros([], jnp.int32), mu=treedef.unflatten(mu))

  def update_fn(updates, state, params=None):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    paths = [p for p, _ in leaves]
    grads = [g for _, g in leaves]
    dns = [find_dn(p) for p in paths]
    handled = [i for i, dn in enumerate(dns) if dn is not None]
    if weight_decay and params is None:
      raise ValueError("sharded_muon with weight_decay needs `params` in update().")
    param_leaves = jax.tree.leaves(params) if params is not None else [None] * len(grads)
    count = optax.safe_increment(state.count)
    mu_new, mu_hat = {}, {}
    for i, m in zip(handled, jax.tree.leaves(state.mu), strict=True):
      mu_new[i], mu_hat[i] = _momentum(grads[i], m, count, beta, nesterov)
    views = {i: matrix_view(grads[i].shape, dns[i], find_where(paths[i])) for i in handled}
    ortho = _orthogonalize_all(mu_hat, views, coeffs_S3, norm_scale, eps)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    out = list(grads)
    for i in handled:
      u = _rms_scale(grads[i].shape, dns[i], rms_scale) * ortho[i]
      if weight_decay:
        u = u + weight_decay * param_leaves[i]
      out[i] = -lr * u
    mu_tree = treedef.unflatten([mu_new[i] if i in mu_new else optax.MaskedNode() for i in range(len(grads))])
    return treedef.unflatten(out), ShardedMuonState(count=count, mu=mu_tree)

  return optax.GradientTransformation(init_fn, update_fn)
