"""What each device sends in one train step, and Newton–Schulz work, as the code paths do it.

Bytes are per device per optimizer step (ring algorithms: an all-gather or reduce-scatter over n
devices sends (n−1)/n of the buffer, an all-reduce twice that). The Muon figures are `optim.muon`'s own
groups (`optim.group_views`: same views, modes, copies and padding), which count their own work.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from composer_jax import optim
from composer_jax.model.config import ModelConfig
from composer_jax.optim import newton_schulz
from composer_jax.optim.muon_groups import ring
from composer_jax.plan.layout import Layout, Leaf

__all__ = ["MuonGroupWork", "collective_bytes", "muon_groups", "muon_work", "ring"]

# Copies of a group's whole matrices alive during Newton-Schulz, next to its exchanged local stack: the
# iterate and the next one. Fitted on kimi_k25_1t's Muon update alone (unpadded groups, bf16 NS),
# compiled for v5p:8x8x16: temp 6.4 GiB per chip, of which this gives 5.6 (stack 1.9 + 2 x 1.9). The
# zero-padded fp32 Muon before it held 6 (its transposes and the result's too).
NS_COPIES = 2


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
  """One Muon group as a device sees it (sizes, mode and copies from `optim.group_views`)."""

  shape: tuple[int, int]  # (M, K) of one matrix, M ≤ K
  mesh: str  # dense | expert
  mode: str  # whole | sharded
  matrices: int  # all devices together
  per_device: int  # matrices each device orthogonalises (padding included; sharded: its part of each)
  ns_flops: int  # NS FLOPs per device
  stack_bytes: int  # the zero-padded local stack
  exchanged: bool  # matrices are sharded: the stack is materialised for the all-to-all
  whole_bytes: int  # the matrices (whole, or this device's parts) it orthogonalises at once
  all_to_all_bytes: int
  all_gather_bytes: int
  all_reduce_bytes: int


def muon_groups(params: list[Leaf], ns_steps: int = 5, ns_dtype: Any = None) -> list[MuonGroupWork]:
  """The groups `sharded_muon` forms for these parameters, with per-device work and buffers.

  ns_dtype: the dtype NS and its collectives run in (`OptimizerConfig.muon_dtype`); None: each
  parameter's own (the momentum's), as `sharded_muon(ns_dtype=None)` does."""
  muon = {i: p for i, p in enumerate(params) if p.label == "muon"}
  views = {i: optim.matrix_view(p.shape, p.dn, p.where) for i, p in muon.items()}
  dtypes = {i: p.dtype if ns_dtype is None else np.dtype(ns_dtype) for i, p in muon.items()}
  out = []
  for g in optim.group_views(views, dtypes, ns_steps=ns_steps):
    sent = g.collective_bytes(ns_steps)
    out.append(
      MuonGroupWork(
        shape=g.view.shape[1:],
        mesh=muon[g.members[0]].mesh,
        mode=g.mode,
        matrices=sum(views[i].shape[0] for i in g.members),
        per_device=g.per_device,
        ns_flops=g.ns_flops(ns_steps),
        stack_bytes=g.stack_bytes,
        all_to_all_bytes=sent["all_to_all"],
        all_gather_bytes=sent["all_gather"],
        all_reduce_bytes=sent["all_reduce"],
        exchanged=g.exchange > 1,
        whole_bytes=g.slots * g.shard_bytes * (g.exchange if g.mode == "whole" else 1),
      )
    )
  return out


def muon_work(params: list[Leaf], ns_steps: int, ns_dtype: Any = None) -> dict[str, Any]:
  """Newton–Schulz FLOPs and collective bytes per device, as `optim.muon` splits the work.

  Per group and device (`optim.group_views`): its slots of NS (whole matrices, or its part of each
  matrix orthogonalised sharded), the all-to-alls that make them whole and back, and how the copies
  share results (all-gather or all-reduce), plus in the sharded mode a psum of the Gram matrix per step.
  Padding matrices are zeros but cost full NS FLOPs and buffer space.
  """
  groups = muon_groups(params, ns_steps, ns_dtype)
  per_mesh = {"dense": 0, "expert": 0}
  flops_total = 0
  for g in groups:
    per_mesh[g.mesh] += g.ns_flops
    flops_total += g.matrices * newton_schulz.flops(*g.shape, ns_steps)
  stacks = [g.stack_bytes for g in groups]
  in_flight = [g.stack_bytes * g.exchanged + NS_COPIES * g.whole_bytes for g in groups]
  out = {
    "ns_flops_per_device": int(sum(per_mesh.values())),
    "ns_flops_per_device_by_mesh": per_mesh,
    "ns_flops_total": int(flops_total),
    "groups": len(groups),
    "all_to_all_bytes": sum(g.all_to_all_bytes for g in groups),
    "all_gather_bytes": sum(g.all_gather_bytes for g in groups),
    "all_reduce_bytes": sum(g.all_reduce_bytes for g in groups),
    # the zero-padded local stack of a group
    "largest_group_stack_bytes": max(stacks, default=0),
    "all_groups_stack_bytes": sum(stacks),
    # the largest group while it is orthogonalised: its stack if exchanged, NS_COPIES x its whole matrices
    "largest_group_in_flight_bytes": max(in_flight, default=0),
  }
  out["collective_bytes"] = out["all_to_all_bytes"] + out["all_gather_bytes"] + out["all_reduce_bytes"]
  return out
