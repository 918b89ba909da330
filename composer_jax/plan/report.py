"""Text for the plan and compile stages: the plan's tables, a compile summary, and the one line a
config that does not fit gets (its biggest items and the knob to turn).

Works on plain values (a `Plan`, the compile stage's dict), so it imports no other plan module.
"""

from __future__ import annotations

from typing import Any

# The planner's term → the config knob that shrinks it most directly.
_KNOBS = {
  "activations": "raise train.grad_accum or set model.remat='full'",
  "params": "spread parameters wider: a larger fsdp (mesh.dense) or expert_fsdp (mesh.expert) axis",
  "opt_state": "spread the optimizer state wider: a larger fsdp / expert_fsdp axis, or more devices",
  "grads": "spread gradients wider: a larger fsdp / expert_fsdp axis",
  "grad_accum_f32": "set train.grad_accum=1 (its fp32 accumulator) or shard wider",
  "muon_stacks": "Muon's padded group stacks: fewer copies (replica) per fsdp group, or shard wider",
  "temp": "raise train.grad_accum or set model.remat='full' (XLA's temporaries dominate)",
}


def _gib(x: float) -> str:
  return f"{x / 2**30:10.3f} GiB"


def _gb(x: float) -> str:
  return f"{x / 1e9:10.3f} GB"


def biggest_terms(plan: Any, n: int = 3) -> list[tuple[str, int]]:
  """The largest per-device memory items of a plan, largest first."""
  terms: dict[str, int] = {"activations": plan.activations["total"]}
  for mesh in ("dense", "expert"):
    for k, v in plan.memory[mesh].items():
      if k != "step":
        terms[k] = terms.get(k, 0) + v
  terms["muon_stacks"] = plan.muon["largest_group_in_flight_bytes"]
  return sorted(terms.items(), key=lambda kv: -kv[1])[:n]


# What to turn for activations or temporaries when remat is already full, and for the rollout programs.
_FULL_REMAT = "raise train.grad_accum or split the batch over more devices (model.remat is already 'full')"
_ROLLOUT = "fewer rows (rl.problems_per_step × rl.group_size) or a shorter rl.cache_len, or more devices"


def does_not_fit(
  peak: int, hbm: int, items: list[tuple[str, int]], *, remat: str = "none", step: str = "train"
) -> str:
  """One line: by how much, the biggest items, and the knob for the biggest (one that is not already
  turned: no "set remat='full'" when it is; the RL and decode steps' batch is the rollouts')."""
  listed = ", ".join(f"{name} {v / 2**30:.1f} GiB" for name, v in items)
  knob = _KNOBS.get(items[0][0], "shard wider or use more devices") if items else "use more devices"
  if "remat" in knob and step != "train":
    knob = _ROLLOUT
  elif "remat" in knob and remat == "full":
    knob = _FULL_REMAT
  return (
    f"DOES NOT FIT: {peak / 2**30:.1f} GiB per device > {hbm / 2**30:.0f} GiB HBM; biggest: {listed}; "
    f"to turn: {knob}"
  )


def format_plan(plan: Any) -> str:
  """Readable tables: memory (GiB) per mesh, collectives (GB), Newton–Schulz (TFLOP, seconds)."""
  lay = plan.layout
  lines = [
    f"plan {plan.variant}: {lay.devices} devices, dense mesh {lay.dense}, expert mesh {lay.expert}",
    f"  {plan.params_total / 1e9:.2f}B params, {plan.tokens_per_step:,} tokens/step, "
    f"grad_accum {plan.grad_accum}",
  ]
  lines += [f"  note: {n}" for n in plan.notes]
  lines.append("")
  lines.append(f"  {'memory per device':<28}{'dense mesh':>14}{'expert mesh':>14}{'total':>14}")
  for term in ("params", "opt_state", "grads", "grad_accum_f32"):
    d, e = plan.memory["dense"].get(term, 0), plan.memory["expert"].get(term, 0)
    lines.append(f"  {term:<28}{_gib(d):>14}{_gib(e):>14}{_gib(d + e):>14}")
  lines.append(f"  {'batch':<28}{'':>28}{_gib(plan.memory['other']['batch']):>14}")
  lines.append("  activations (one micro-batch, saved for backward):")
  for term, v in plan.activations.items():
    lines.append(f"    {term:<26}{'':>28}{_gib(v):>14}")
  hbm = f" of {plan.hbm_bytes / 2**30:.0f} GiB usable HBM" if plan.hbm_bytes else ""
  over = " — DOES NOT FIT" if plan.fits is False else ""
  lines.append(f"  {'peak (estimate)':<28}{'':>28}{_gib(plan.peak_bytes):>14}{hbm}{over}")
  lines.append("")
  lines.append(f"  {'collectives per step (sent per device)':<42}{'':>14}")
  for name, v in plan.collectives.items():
    lines.append(f"  {name:<42}{_gb(v):>14}")
  lines.append(f"  {'total':<42}{_gb(sum(plan.collectives.values())):>14}")
  m = plan.muon
  lines += [
    "",
    f"  Newton–Schulz per device: {m['ns_flops_per_device'] / 1e12:.2f} TFLOP "
    f"(dense mesh {m['ns_flops_per_device_by_mesh']['dense'] / 1e12:.2f}, expert mesh "
    f"{m['ns_flops_per_device_by_mesh']['expert'] / 1e12:.2f}); "
    f"all devices {m['ns_flops_total'] / 1e15:.2f} PFLOP in {m['groups']} groups; "
    f"ideal split {m['ns_flops_total'] / lay.devices / 1e12:.2f} TFLOP/device",
    f"  Muon step (NS compute only, in {m['ns_dtype']}) at {m['peak_flops'] / 1e12:.4g} TFLOP/s: "
    f"{m['ns_seconds']:.3f} s vs 0.2 s reported by Composer 2.5 at 1T parameters "
    f"({m['ns_seconds'] / 0.2:.2f}x)",
    f"  Muon collectives {(m['all_to_all_bytes'] + m['all_gather_bytes']) / 1e9:.2f} GB/device; padded group "
    f"stacks {m['largest_group_stack_bytes'] / 2**30:.2f} GiB largest, "
    f"{m['all_groups_stack_bytes'] / 2**30:.2f} GiB all groups",
  ]
  return "\n".join(lines)


def format_compile(result: dict[str, Any]) -> str:
  """The compile stage's short table: XLA's per-device memory next to the plan's, fits, collectives."""
  mem, plan = result["memory"], result["plan"]
  lines = [
    f"compile {result['variant']} {result['step']} step on {result['topology']} ({result['devices']} "
    f"devices, {result['device_kind']}): {result['compile_seconds']:.0f} s",
    f"  {'per device':<12}{'XLA':>14}{'plan':>14}{'plan/XLA':>10}",
  ]
  for k in ("argument", "output", "alias", "temp", "peak"):
    ratio = plan[k] / mem[k] if mem[k] else float("nan")
    lines.append(f"  {k:<12}{_gib(mem[k]):>14}{_gib(plan[k]):>14}{ratio:>10.3f}")
  verdict = "fits" if result["fits"] else "DOES NOT FIT"
  lines.append(f"  HBM {_gib(result['hbm_bytes']).strip()} per chip: {verdict}")
  lines.append(f"  {result['flops_per_device'] / 1e12:.1f} TFLOP per device per step")
  if est := result.get("estimate"):
    lines.append("  " + format_estimate(est))
  lines.append("  collectives: " + ", ".join(f"{k} {v}" for k, v in sorted(result["collectives"].items())))
  if kernels := result.get("backend"):
    attention, experts = ("+".join(kernels[k]) for k in ("attention_impl", "expert_impl"))
    lines.append(f"  kernels: attention {attention}, experts {experts}")
  return "\n".join(lines)


def format_estimate(est: dict[str, Any]) -> str:
  """One line: the cost model's step time (loops weighted by trip count), MFU, the Muon update's time."""
  mfu = f"MFU {est['mfu']:.1%}" if est.get("mfu") is not None else "MFU n/a"
  ratio = est.get("compiled_over_model_flops")
  flops = f", compiled/model FLOPs {ratio:.2f}" if ratio else ""
  muon = est.get("muon_seconds", 0.0) * 1e3
  return (
    f"estimate (XLA cost model, loop bodies x trip counts {est['correction']['seconds']:.1f}): step "
    f"{est['step_seconds'] * 1e3:.1f} ms, {mfu}, Muon update {muon:.1f} ms{flops}"
  )
