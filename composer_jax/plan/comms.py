"""What each device sends in one train step, and Newton–Schulz work, as the code paths do it.

Bytes are per device per optimizer step (ring algorithms: an all-gather or reduce-scatter over n
devices sends (n−1)/n of the buffer, an all-reduce twice that). The Muon figures reproduce
`optim.muon`'s own grouping (`optim.group_views`): same views, same groups, same padding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from composer_jax import optim
from composer_jax.model.config import ModelConfig
from composer_jax.optim import newton_schulz
from composer_jax.plan.layout import Layout, Leaf

# Buffers of a group's whole matrices alive during Newton-Schulz: the gathered stack, its transpose,
# the iterate and the next one, the result and its transpose back (6 at the kimi_k25_1t peak on
# XLA:TPU, next to the group's exchanged local stack: 7 buffers of [45, 2048, 7168] f32).
NS_COPIES = 6


def ring(n: int) -> float:
  """Fraction of a buffer each device sends in a ring all-gather / reduce-scatter over n devices."""
  return (n - 1) / n if n > 1 else 0.0


def collective_bytes(
  cfg: ModelConfig, layout: Layout, params: list[Leaf], grad_accum: int, rows: dict
) -> dict[str, int]:
  """Bytes sent per device per optimizer step.

  - FSDP: dense params sharded over fsdp are all-gathered (param dtype) in the forward pass and
    again in the backward pass when remat recomputes the block; gradients reduce-scatter; per
    micro-batch. Expert weights over expert-fsdp likewise (`expert_parallel._gather_fsdp`).
    Assumed for every sharded dense matrix, embedding and LM head included (GSPMD may choose to
    move activations instead for those two).
  - HSDP: dense gradient shards are all-reduced over the devices holding the same shard
    (replica·context), per micro-batch (the accumulation is constrained to the param sharding).
  - EP: per MoE layer, dispatch + combine all-to-alls of routed tokens (compute dtype; the padded
    buffers on "all_to_all", the expected A·(P−1)/P rows on "ragged_all_to_all"), forward, backward,
    and again in the backward pass under remat.
  """
  deg = layout.degrees
  recompute = 2 if cfg.remat != "none" else 1
  act_b = np.dtype(cfg.dtype).itemsize
  full = {"dense": 0, "expert": 0}
  all_reduce = 0.0
  for p in params:
    if p.mesh == "dense":
      full["dense"] += p.size * p.itemsize if deg.fsdp > 1 and p.local_size < p.size else 0
      # a gradient is summed over every device that holds the same shard: replica·context, or all
      # devices for a dense param the fsdp axis does not shard (e.g. q_b/kv_b: no `embed` axis)
      copies = layout.devices * p.local_size // p.size
      all_reduce += 2 * ring(copies) * p.local_size * p.itemsize
    elif deg.expert_fsdp > 1:
      full["expert"] += p.size * p.itemsize // deg.experts
  out = {
    "fsdp_all_gather": int(grad_accum * recompute * ring(deg.fsdp) * full["dense"]),
    "fsdp_reduce_scatter": int(grad_accum * ring(deg.fsdp) * full["dense"]),
    "hsdp_all_reduce": int(grad_accum * all_reduce),
    "expert_fsdp_all_gather": int(grad_accum * recompute * ring(deg.expert_fsdp) * full["expert"]),
    "expert_fsdp_reduce_scatter": int(grad_accum * ring(deg.expert_fsdp) * full["expert"]),
  }
  if cfg.dispatch == "all_to_all":
    one_way = ring(deg.experts) * rows["received_rows"] * (cfg.d_model * act_b + 4)  # + int32 expert ids
  else:
    one_way = ring(deg.experts) * rows["assignments"] * cfg.d_model * act_b
  # forward: dispatch + combine; backward: their transposes; remat: the forward once more.
  out["ep_all_to_all"] = int(grad_accum * cfg.n_moe_layers * one_way * 2 * (1 + recompute))
  return out


@dataclasses.dataclass(frozen=True)
class MuonGroupWork:
  """One Muon group as a device sees it (sizes from `optim.group_views`)."""

  shape: tuple[int, int]  # (M, K) of one matrix
  mesh: str  # dense | expert
  matrices: int  # all devices together
  per_device: int  # whole matrices each device orthogonalises (padding included)
  stack_bytes: int  # the zero-padded local stack (and as large again after its all-to-all)
  exchanged: bool  # matrices are sharded: the stack is materialised for the all-to-all
  whole_bytes: int  # the whole matrices this device orthogonalises
  all_to_all_bytes: int
  all_gather_bytes: int


def muon_groups(params: list[Leaf]) -> list[MuonGroupWork]:
  """The groups `sharded_muon` forms for these parameters, with per-device work and buffers."""
  muon = {i: p for i, p in enumerate(params) if p.label == "muon"}
  views = {i: optim.matrix_view(p.shape, p.dn, p.where) for i, p in muon.items()}
  out = []
  for g in optim.group_views(views, {i: p.dtype for i, p in muon.items()}):
    _, m_axes, k_axes = g.view.axes
    m, k = g.view.shape[1:]
    shape = dict(g.view.mesh.shape) if g.view.mesh is not None else {}
    m_split, k_split = (math.prod(shape[a] for a in ax) for ax in (m_axes, k_axes))
    itemsize = np.dtype(g.dtype).itemsize
    stack = g.padded * (m // m_split) * (k // k_split) * itemsize
    out.append(
      MuonGroupWork(
        shape=(m, k),
        mesh=muon[g.members[0]].mesh,
        matrices=sum(views[i].shape[0] for i in g.members),
        per_device=g.per_device,
        stack_bytes=stack,
        exchanged=g.exchange > 1,
        whole_bytes=g.per_device * m * k * itemsize,
        all_to_all_bytes=int(2 * (ring(m_split) + ring(k_split)) * stack),
        all_gather_bytes=int(ring(g.copies) * g.padded // g.exchange * m * k * itemsize),
      )
    )
  return out


def muon_work(params: list[Leaf], ns_steps: int) -> dict[str, Any]:
  """Newton–Schulz FLOPs and all-to-all bytes per device, as `optim.muon` splits the work.

  Per group and device: local matrices padded (`optim.group_views`), NS on its share of whole
  matrices, all-to-alls over the M and K axes there and back, and an all-gather of the NS results
  over the copy axes when the group is split among them. Padding matrices are zeros but cost full NS
  FLOPs and buffer space.
  """
  groups = muon_groups(params)
  per_mesh = {"dense": 0, "expert": 0}
  flops_total = 0
  for g in groups:
    one = newton_schulz.flops(*g.shape, ns_steps)
    per_mesh[g.mesh] += g.per_device * one
    flops_total += g.matrices * one
  stacks = [g.stack_bytes for g in groups]
  in_flight = [g.stack_bytes * g.exchanged + NS_COPIES * g.whole_bytes for g in groups]
  return {
    "ns_flops_per_device": int(sum(per_mesh.values())),
    "ns_flops_per_device_by_mesh": per_mesh,
    "ns_flops_total": int(flops_total),
    "groups": len(groups),
    "all_to_all_bytes": sum(g.all_to_all_bytes for g in groups),
    "all_gather_bytes": sum(g.all_gather_bytes for g in groups),
    # the zero-padded local stack of a group (and as large again after its all-to-all)
    "largest_group_stack_bytes": max(stacks, default=0),
    "all_groups_stack_bytes": sum(stacks),
    # the largest group while it is orthogonalised: its stack if exchanged, NS_COPIES x its whole matrices
    "largest_group_in_flight_bytes": max(in_flight, default=0),
  }
