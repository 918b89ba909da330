"""The plan of a config: per-device memory, collective bytes and Newton–Schulz time of one train step.

`make_plan(config)` combines layout.py (meshes, parameters), memory.py (state, activations) and
comms.py (collectives, Muon); `run(config, workdir)` is the `plan` stage body. The `xla` entry holds
the planner's prediction of XLA's `memory_analysis()` fields, which the `compile` stage
(plan/compile.py) puts next to the compiler's own numbers.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from absl import logging

from composer_jax import configs
from composer_jax.plan import comms, memory, report
from composer_jax.plan.layout import Layout, derive_layout, leaves

_BATCH_FIELDS = 3  # tokens, segment_ids, positions: int32 [B, S] each


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device bytes (memory, collectives per step), Newton–Schulz FLOPs and time."""

  variant: str
  layout: Layout
  tokens_per_step: int
  grad_accum: int
  params_total: int  # parameter count, all devices together
  memory: dict[str, dict[str, int]]  # {"dense"|"expert"|"other": {term: bytes}}
  activations: dict[str, int]  # term → bytes, one micro-batch, remat honoured
  peak_bytes: int
  xla: dict[str, int]  # predicted memory_analysis(): argument, output, alias, temp, peak
  collectives: dict[str, int]  # name → bytes sent per device per step
  muon: dict[str, Any]
  phases: dict[str, dict[str, int]]  # with remat: the live temporaries at the loss and in the backward pass
  hbm_bytes: int | None
  notes: tuple[str, ...]

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @property
  def fits(self) -> bool | None:
    return None if self.hbm_bytes is None else self.peak_bytes <= self.hbm_bytes


def _temporaries(cfg, layout, params, mem, acts, muon, micro, seq, accum, tpu) -> tuple[dict, int]:
  """(phases, temp): the live temporaries of each phase and the step's predicted temp bytes.

  The peak is the largest live set of the passes or of the update (all gradients, Muon's largest
  group in flight). Without remat
  (validated on XLA:CPU): all residuals at the start of the backward pass, plus, with scanned stacks,
  the stacks' gradients (the backward loop writes them into [L, ...] buffers allocated whole while the
  stacked residuals are still live; +11% on tiny), or every gradient and the fp32 sum when
  accumulating. With remat (validated on XLA:TPU): the larger live peak of `memory.remat_phases`. On
  TPU, XLA's heap overhead and the vocab-sized buffers outside its heap on top (`heap_bytes`).
  """
  grads = sum(mem[m]["grads"] for m in ("dense", "expert"))
  accum_f32 = sum(mem[m]["grad_accum_f32"] for m in ("dense", "expert"))
  update = {"grads": grads, "muon_group": muon["largest_group_in_flight_bytes"]}
  if cfg.remat == "none":
    stacked_grads = sum(p.local_bytes(tpu) for p in params if p.stack) if cfg.scan_layers else 0
    passes = {"residuals": acts["total"], "grads": grads + accum_f32 if accum > 1 else stacked_grads}
    phases = {"passes": passes, "update": update}
  else:
    phases = memory.remat_phases(cfg, layout, params, micro, seq, tpu) | {"update": update}
    if accum > 1:
      phases["backward"] |= {"stacked_grads": grads, "grad_accum_f32": accum_f32}
  return phases, heap_bytes(phases, cfg, tpu)


def heap_bytes(phases: dict[str, dict[str, int]], cfg, tpu: bool) -> int:
  """The predicted temp of a step from its phases' live sets: the largest, and on TPU XLA's heap overhead
  (measured with remat; tiny without it matches its live set: 1.05) and what memory_analysis counts
  outside that heap (`memory.TPU_VOCAB_TABLES_OUTSIDE_HEAP`)."""
  temp = max(sum(terms.values()) for terms in phases.values())
  if not tpu:
    return temp
  heap = memory.TPU_HEAP_OVER_LIVE if cfg.remat != "none" else 1.0
  return int(temp * heap + memory.TPU_VOCAB_TABLES_OUTSIDE_HEAP * cfg.vocab_size * cfg.d_model * 4)


def make_plan(config: configs.Config, *, tpu: bool = False) -> Plan:
  """The plan of an experiment config (its `plan` section included); `tpu`: byte counts in XLA:TPU's
  tiled layout (the compile stage's target), else dense (GPU)."""
  config = configs.from_config(config)
  cfg, pcfg, tcfg, ocfg = config.model, config.plan, config.train, config.optim
  layout = derive_layout(config.mesh.dense, config.mesh.expert, pcfg.devices, cfg.n_experts)
  batch, seq, accum = tcfg.batch_size, tcfg.seq_len, tcfg.grad_accum
  if accum < 1 or batch % accum:
    raise ValueError(f"train.batch_size {batch} is not divisible by train.grad_accum {accum}.")
  micro = batch // accum
  memory.tokens(layout, micro, seq)  # checks the batch split before any tracing
  params = leaves(cfg, layout)
  mem = memory.state_memory(params, accum, tpu)
  acts, rows = memory.activation_memory(cfg, layout, params, micro, seq)
  mem["other"] = {"batch": _BATCH_FIELDS * batch * seq * 4 // layout.devices}
  # The state the step takes and returns (donated): params, optimizer state, step counter.
  state = sum(
    v for mesh in ("dense", "expert") for k, v in mem[mesh].items() if k not in ("grads", "grad_accum_f32")
  )
  coll = comms.collective_bytes(cfg, layout, params, accum, rows)
  muon = comms.muon_work(params, ocfg.ns_steps, ocfg.muon_dtype)
  phases, temp = _temporaries(cfg, layout, params, mem, acts, muon, micro, seq, accum, tpu)
  peak = state + mem["other"]["batch"] + temp
  xla = {
    "argument": state + mem["other"]["batch"],
    "output": state,
    "alias": state,
    "temp": temp,
    "peak": peak,
  }
  coll["muon_all_to_all"] = muon["all_to_all_bytes"]
  coll["muon_all_gather"] = muon["all_gather_bytes"]
  peak_flops = pcfg.peak_flops or tcfg.peak_flops
  muon["peak_flops"] = peak_flops
  muon["ns_seconds"] = muon["ns_flops_per_device"] / peak_flops
  muon["ns_dtype"] = cfg.param_dtype  # NS runs in the momentum's dtype = the param dtype
  notes = [layout.note] if layout.note else []
  if cfg.param_dtype == "float32":
    notes.append("Newton–Schulz runs in the momentum's dtype (float32): compare with an fp32/tf32 peak")
  if ocfg.matrix_optimizer != "muon":
    notes.append("optim.matrix_optimizer is not 'muon': the Muon figures describe the Muon configuration")
  return Plan(
    variant=config.variant,
    layout=layout,
    tokens_per_step=batch * seq,
    grad_accum=accum,
    params_total=sum(p.size for p in params),
    memory=mem,
    activations=acts,
    peak_bytes=int(peak),
    xla=xla,
    collectives=coll,
    muon=muon,
    phases=phases,
    # on TPU the compile stage checks the chip's HBM itself; a GPU gets jax's preallocated share of it
    hbm_bytes=int(pcfg.hbm_gib * 2**30 * (1.0 if tpu else pcfg.mem_fraction)) if pcfg.hbm_gib else None,
    notes=tuple(notes),
  )


def run(config: configs.Config, workdir: str) -> dict[str, Any]:
  """The `plan` stage: logs the plan's tables, writes `<workdir>/plan.json`, returns it as a dict (the
  tables as text under "report", for the runner to print).

  A plan that does not fit `plan.hbm_gib` is still a result (`fits: false`, one line saying so)."""
  plan = make_plan(config)
  text = report.format_plan(plan)
  if plan.fits is False:
    text += "\n" + report.does_not_fit(
      plan.peak_bytes, plan.hbm_bytes, report.biggest_terms(plan), remat=config.model.remat
    )
  logging.info("%s", text)
  if plan.fits is False:
    logging.warning("%s", text.splitlines()[-1])
  out = plan.to_dict() | {"fits": plan.fits, "report": text}
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / "plan.json").write_text(json.dumps(out, indent=1))
  return out
