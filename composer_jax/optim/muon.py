"""Sharded Muon: Muon whose Newton–Schulz work is split across devices by whole matrices.

Shape suffixes: B batch of matrices in one leaf (axes that are neither reduction nor output),
M, K the matrix sides (oriented M ≤ K), N matrices stacked in a group (local), P padded N.

Data flow (the algorithm of microsoft/dion's
`megabatch_orthogonalize_async`): momentum → cast to the NS dtype → per-leaf [B, M, K] views → groups
of views with equal (mesh, sharding, M, K, dtype) (`muon_groups`: mode and copy axes per group by a
cost model) → in one `shard_map` per group: stack the local blocks, pad to the group's exchange
devices (× copies), keep this copy's slice, `all_to_all` so each device holds whole matrices,
normalise *after* the gather (§6), Newton–Schulz, `all_to_all` back, combine the copies; or, for a few
very large matrices, NS on the shards with a psum of the Gram matrix per step → RMS scale →
decoupled weight decay → × −lr. Groups with many matrices per device run in chunks, each its own
all-to-all → NS → all-to-all, so one chunk's collectives can overlap another's NS (and groups overlap
each other: they are independent). Momentum, bias correction and Nesterov follow
`optax.contrib.scale_by_muon` exactly, so in float32 the result equals `optax.contrib.muon` (same
dimension numbers, `consistent_rms=0.2`) to float error; `ns_dtype=bfloat16` runs NS and its
collectives in bf16 (momentum and the update stay in the parameter dtype).

Why a `shardings` argument: inside `jit` an Auto-axes tracer reports its mesh but not its
PartitionSpec, so the layout each group's `shard_map` must assume is given up front (build_optimizer
derives it from the logical axes, exactly as `model.init` places the parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from optax.contrib import MuonDimensionNumbers

from composer_jax import sharding
from composer_jax.optim import newton_schulz
from composer_jax.optim.muon_groups import (
  SHARDED_MIN_ELEMENTS,
  Group,
  MatrixView,
  fans,
  group_views,
  matrix_view,
)

__all__ = ["Group", "MatrixView", "ShardedMuonState", "fans", "group_views", "matrix_view", "sharded_muon"]

_RMS_SCALES = ("moonlight", "jordan")
# Whole-mode groups with more matrices per device than this run in chunks of at most this many.
CHUNK = 8


class ShardedMuonState(NamedTuple):
  count: jax.Array  # [] int32, steps taken
  mu: Any  # params-shaped EMA of gradients; optax.MaskedNode where dimension numbers are None


class _NS(NamedTuple):
  """How to orthogonalise: NS coefficients, the norm factor, eps, and how to group (`group_views`)."""

  coeffs_S3: Any
  norm_scale: float
  eps: float
  steps: int
  flops_per_byte: float | None
  sharded_min_elements: int


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


def _exchange(x_NMK: jax.Array, group: Group, coeffs_S3, norm_scale: float, eps: float) -> jax.Array:
  """This copy's slice [E·n, M/m, K/k] → all_to_all to n whole matrices → NS → back, in chunks.

  Slice position e·n + j goes to exchange device e as its j-th matrix. Each chunk of the j axis is its
  own all-to-all → NS → all-to-all, independent of the others, so XLA can run one chunk's collectives
  under another's matmuls.
  """
  _, m_axes, k_axes = group.view.axes
  ex, n = group.exchange, x_NMK.shape[0] // group.exchange
  x_ENMK = x_NMK.reshape(ex, n, *x_NMK.shape[1:])
  outs = []
  for lo in range(0, n, CHUNK):
    c_NMK = x_ENMK[:, lo : lo + CHUNK].reshape(-1, *x_NMK.shape[1:])
    # Rows then columns: [E·c, M/m, K/k] → [E·c/m, M, K/k] → [c, M, K], whole matrices per device.
    if m_axes:
      c_NMK = jax.lax.all_to_all(c_NMK, _axis_name(m_axes), 0, 1, tiled=True)
    if k_axes:
      c_NMK = jax.lax.all_to_all(c_NMK, _axis_name(k_axes), 0, 2, tiled=True)
    with jax.named_scope("newton_schulz"):
      c_NMK = newton_schulz.orthogonalize(c_NMK, coeffs_S3, norm_scale, eps)
    if k_axes:
      c_NMK = jax.lax.all_to_all(c_NMK, _axis_name(k_axes), 2, 0, tiled=True)
    if m_axes:
      c_NMK = jax.lax.all_to_all(c_NMK, _axis_name(m_axes), 1, 0, tiled=True)
    outs.append(c_NMK.reshape(ex, -1, *x_NMK.shape[1:]))
  return jnp.concatenate(outs, axis=1).reshape(x_NMK.shape) if len(outs) > 1 else outs[0].reshape(x_NMK.shape)


def _sharded(x_NMK: jax.Array, group: Group, coeffs_S3, norm_scale: float, eps: float) -> jax.Array:
  """NS of [n, M/m, K/k] shards without making them whole: move the M split onto K (all_to_all), then
  `orthogonalize_sharded` over the exchange axes, and back."""
  _, m_axes, k_axes = group.view.axes
  if m_axes:
    x_NMK = jax.lax.all_to_all(x_NMK, _axis_name(m_axes), 2, 1, tiled=True)
  with jax.named_scope("newton_schulz"):
    y_NMK = newton_schulz.orthogonalize_sharded(
      x_NMK, coeffs_S3, _axis_name(m_axes + k_axes), norm_scale, eps
    )
  if m_axes:
    y_NMK = jax.lax.all_to_all(y_NMK, _axis_name(m_axes), 1, 2, tiled=True)
  return y_NMK


def _orthogonalize_group(xs_BMK: list[jax.Array], group: Group, coeffs_S3, norm_scale: float, eps: float):
  """One group's local blocks → orthogonalised blocks, same layout (runs inside shard_map).

  Padded to `group.padded`; copy c of the copy axes orthogonalises slice [c·s, (c+1)·s) of the stack
  (s = padded / copies), then an all_gather over the copies restores the rest. NS work per device is
  the group's total ÷ (exchange devices · copies), up to padding (`muon_groups`).
  """
  counts = [x.shape[0] for x in xs_BMK]
  x_NMK = jnp.concatenate(xs_BMK, axis=0) if len(xs_BMK) > 1 else xs_BMK[0]
  n, copies = x_NMK.shape[0], group.copies
  if group.padded > n:
    x_NMK = jnp.concatenate([x_NMK, jnp.zeros((group.padded - n,) + x_NMK.shape[1:], x_NMK.dtype)], axis=0)
  if copies > 1:
    share = group.padded // copies
    start = jax.lax.axis_index(_axis_name(group.copy_axes)) * share
    x_NMK = jax.lax.dynamic_slice_in_dim(x_NMK, start, share, axis=0)
  run = _sharded if group.mode == "sharded" else _exchange
  y_NMK = run(x_NMK, group, coeffs_S3, norm_scale, eps)
  if copies > 1:
    y_NMK = jax.lax.all_gather(y_NMK, _axis_name(group.copy_axes), axis=0, tiled=True)
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


def _orthogonalize_all(mu_hats: dict, views: dict, ns: _NS) -> dict:
  """Leaf index → orthogonalised leaf; one shard_map per group of same-layout [B, M, K] views."""
  out = {}
  groups = group_views(
    views,
    {i: x.dtype for i, x in mu_hats.items()},
    ns_steps=ns.steps,
    flops_per_byte=ns.flops_per_byte,
    sharded_min_elements=ns.sharded_min_elements,
  )
  for number, group in enumerate(groups):
    members, v0 = group.members, group.view

    # Named per group, so a profile or the compiled HLO tells groups apart (benchmarks/muon_compile.py).
    @jax.named_scope(f"muon_group{number}")
    def body(*xs_BMK, group=group):
      return tuple(_orthogonalize_group(list(xs_BMK), group, ns.coeffs_S3, ns.norm_scale, ns.eps))

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
  ns_dtype: Any = None,
  flops_per_byte: float | None = None,
  sharded_min_elements: int = SHARDED_MIN_ELEMENTS,
) -> optax.GradientTransformation:
  """Muon (Jordan 2024; Moonlight scaling, Liu et al. arXiv 2502.16982) with NS spread over devices.

  dimension_numbers: a tree (or prefix) of `optax.contrib.MuonDimensionNumbers | None` over the
    params; None leaves pass through unchanged (route them elsewhere, e.g. `build_optimizer`).
  meshes: None ⇒ plain batched NS (no shard_map). Otherwise `shardings` is required.
  shardings: a tree (or prefix) of the params' `NamedSharding`s (dense or expert mesh).
  rms_scale: "moonlight" ⇒ × 0.2·sqrt(max(fan_in, fan_out)) (optax `consistent_rms=0.2`);
    "jordan" ⇒ × sqrt(max(1, fan_out/fan_in)) (optax `consistent_rms=None`).
  ns_dtype: the dtype of Newton–Schulz and of its collectives (e.g. "bfloat16", as modded-nanogpt and
    dion do); None: the momentum's dtype. The momentum and the update keep the parameters' dtype.
  flops_per_byte, sharded_min_elements: how groups are split (`muon_groups.group_views`); None: by
    the meshes' platform.
  Call `init` eagerly (or jit it with `out_shardings`): under jit, zeros of an Auto-mesh array lose
  their sharding.
  """
  if rms_scale not in _RMS_SCALES:
    raise ValueError(f"rms_scale must be one of {_RMS_SCALES}; got {rms_scale!r}.")
  coeffs_S3, norm_scale = newton_schulz.coefficients(ns_coeffs, ns_steps)
  ns = _NS(coeffs_S3, norm_scale, eps, ns_steps, flops_per_byte, sharded_min_elements)
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
    if ns_dtype is not None:
      mu_hat = {i: x.astype(ns_dtype) for i, x in mu_hat.items()}
    ortho = _orthogonalize_all(mu_hat, views, ns)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    out = list(grads)
    for i in handled:
      u = _rms_scale(grads[i].shape, dns[i], rms_scale) * ortho[i].astype(grads[i].dtype)
      if weight_decay:
        u = u + weight_decay * param_leaves[i]
      out[i] = -lr * u
    mu_tree = treedef.unflatten([mu_new[i] if i in mu_new else optax.MaskedNode() for i in range(len(grads))])
    return treedef.unflatten(out), ShardedMuonState(count=count, mu=mu_tree)

  return optax.GradientTransformation(init_fn, update_fn)
