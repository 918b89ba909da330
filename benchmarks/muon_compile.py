"""The sharded Muon update alone, compiled for a TPU topology (XLA:TPU, ahead of time) or for CPU devices,
judged by the compiler: per-device FLOPs ÷ the ideal even split, collective ops and bytes, temp memory,
and whether the collectives are asynchronous and overlap other groups' Newton–Schulz matmuls.

  python benchmarks/muon_compile.py --variant=moonlight_16b --topology=v5p:4x4x4
  python benchmarks/muon_compile.py --variant=tiny                       # 8 CPU devices
  python benchmarks/muon_compile.py --variant=moonlight_16b --topology=v5p:4x4x4 --layers=3 --json=out.json
  python benchmarks/muon_compile.py --variant=moonlight_16b --topology=v5p:4x4x4 --layers=2 --step

What is compiled: `optim.muon_branch(model, optimizer config, meshes)` (the Muon half of the optimizer,
with the variant's meshes and dimension numbers) as `jit(tx.update)(grads, state, params)` on abstract
arrays with the shardings `train.create_state` gives; nothing is allocated. `--layers` cuts the model's
depth (first_k_dense kept) to shorten the compile; the ideal scales with it.

Ideal = Σ over Muon matrices of `newton_schulz.flops` ÷ devices (one device doing 1/n of all NS work).
The compiled FLOPs also hold the elementwise work (momentum, scaling, decay: ≈ 10 FLOP per parameter
per device holding it), so the ratio is a little above the NS-only ratio. Collective bytes are the sizes
of each collective's result per device, from the optimized HLO (a loop body counts once).
`estimated_seconds`: XLA's cost model for the update with every loop body weighted by its trip count
(`plan.estimate`), the figure issue 33 holds against Composer's 0.2 s at 1T.
Overlap: in the scheduled entry computation, for each asynchronous collective (`*-start` … `*-done`),
how many matmul-bearing instructions (`dot` / `convolution` or fusions calling them) run between the
two: > 0 means XLA placed other work under the collective.

`--step` compiles the whole pretraining step instead (`plan.compile.lower_train_step`, the compile
stage's step: forward, backward, AdamW and Muon in one program) and reads its schedule (`schedule`):
where the backward pass ends in the entry computation, how many Newton–Schulz matmuls and Muon
collectives are placed before that point, and for each asynchronous Muon all-to-all how many *other*
groups' NS matmuls run inside it. Muon's ops carry the named scopes `muon_group<i>` and
`newton_schulz` (optim/muon.py); the backward pass's carry JAX's `transpose(jvp(...))` names.
`--unrolled` sets model.scan_layers=False (layers as separate ops rather than one scanned loop).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Asynchronous all-to-alls on XLA:TPU (off by default in libtpu); set before the TPU compiler loads.
os.environ.setdefault("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_all_to_all=true")

import jax  # noqa: E402

from composer_jax import configs, model, optim, sharding  # noqa: E402
from composer_jax.optim import newton_schulz  # noqa: E402
from composer_jax.plan import compile as compile_stage  # noqa: E402
from composer_jax.plan import estimate  # noqa: E402
from composer_jax.train import state as train_state  # noqa: E402

_EXPERIMENT = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "composer25.py"
)
_COLL = re.compile(
  r"^\s*(?:ROOT )?%?[\w.\-]+ = (?P<shape>.+?) "
  r"(?P<op>(?:ragged-)?all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)(?P<start>-start)?\("
)
_SHAPE = re.compile(r"(bf16|f16|f32|f64|s32|u32|s8|u8|pred|s64|u64)\[([\d,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8}


def _config(variant: str) -> configs.Config:
  spec = importlib.util.spec_from_file_location("composer25", _EXPERIMENT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return configs.from_config(module.get_config(variant))


def ideal_flops(cfg: model.ModelConfig, steps: int) -> float:
  """Σ NS FLOPs over every Muon matrix (per head, per expert, per layer), all devices together."""
  total = 0
  dns = jax.tree.leaves(
    optim.dimension_numbers(cfg), is_leaf=lambda x: x is None or hasattr(x, "reduction_axis")
  )
  for dn, p in zip(dns, jax.tree.leaves(model.abstract_params(cfg)), strict=True):
    if dn is None:
      continue
    view = optim.matrix_view(p.shape, dn, None)
    total += view.shape[0] * newton_schulz.flops(*view.shape[1:], steps)
  return float(total)


def _result_bytes(shape_text: str, start: bool) -> int:
  """Bytes of a collective's result; an async start's tuple holds ((operands), results, scalar contexts):
  the scalars dropped, the second half."""
  found = _SHAPE.findall(shape_text)
  if start:
    found = [(t, dims) for t, dims in found if dims]
    found = found[len(found) // 2 :]
  arrays = [(_BYTES.get(t, 4), math.prod(int(d) for d in dims.split(",") if d)) for t, dims in found]
  return sum(b * n for b, n in arrays)


def collectives(hlo: str) -> dict[str, dict[str, int]]:
  """{op: {"count", "bytes", "async"}} over the optimized module (every computation)."""
  out: dict[str, dict[str, int]] = {}
  for line in hlo.splitlines():
    m = _COLL.match(line)
    if not m:
      continue
    entry = out.setdefault(m["op"], {"count": 0, "bytes": 0, "async": 0})
    entry["count"] += 1
    entry["async"] += bool(m["start"])
    entry["bytes"] += _result_bytes(m["shape"], bool(m["start"]))
  return out


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if head and not line.startswith(" "):
      name = head.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        comps["__entry__"] = comps[name]
    elif name is not None and line.startswith(" "):
      comps[name].append(line)
  return comps


def overlap(hlo: str) -> dict[str, int]:
  """Async collectives in the entry computation and how many have matmul work scheduled inside them."""
  comps = _computations(hlo)
  has_dot = {n: any(re.search(r"\b(dot|convolution)\(", ln) for ln in body) for n, body in comps.items()}

  def matmul(line: str) -> bool:
    if re.search(r"= [^=]*\b(dot|convolution)\(", line):
      return True
    called = re.findall(r"calls=%?([\w.\-]+)", line)
    return any(has_dot.get(c, False) for c in called)

  entry = comps.get("__entry__", [])
  open_at: dict[str, int] = {}
  pairs, overlapped, between = 0, 0, []
  for i, line in enumerate(entry):
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([\w\-]+-start)\(", line)
    if m and any(
      k in m.group(2) for k in ("all-to-all", "all-gather", "all-reduce", "collective-permute", "async")
    ):
      open_at[m.group(1)] = i
      continue
    d = re.search(r"\b[\w\-]+-done\(%?([\w.\-]+)\)", line)
    if d and d.group(1) in open_at:
      start = open_at.pop(d.group(1))
      n = sum(matmul(x) for x in entry[start + 1 : i])
      pairs += 1
      overlapped += n > 0
      between.append(n)
  return {
    "async_pairs": pairs,
    "with_matmuls_inside": overlapped,
    "max_matmuls_inside": max(between, default=0),
  }


_OP_NAME = re.compile(r'op_name="(?:jit\([\w.]+\)/)?([^"]*)"')
_GROUP = re.compile(r"muon_group(\d+)")


def _op_name(line: str) -> str:
  m = _OP_NAME.search(line)
  return m.group(1) if m else ""


def schedule(hlo: str) -> dict[str, int]:
  """Muon's place in the scheduled entry computation of a whole train step (module docstring)."""
  comps = _computations(hlo)
  entry = comps.get("__entry__", [])
  has_dot = {n: any(re.search(r"\b(dot|convolution)\(", ln) for ln in body) for n, body in comps.items()}

  def matmul(line: str) -> bool:
    called = re.findall(r"calls=%?([\w.\-]+)", line)
    return bool(re.search(r"= [^=]*\b(dot|convolution)\(", line)) or any(
      has_dot.get(c, False) for c in called
    )

  names = [_op_name(line) for line in entry]
  backward = [i for i, n in enumerate(names) if n.startswith("transpose(")]
  end = max(backward, default=-1)
  backward_matmuls = [i for i in backward if matmul(entry[i])]
  ns = [(i, int(g.group(1))) for i, (ln, n) in enumerate(zip(entry, names, strict=True))
        if "newton_schulz" in n and matmul(ln) and (g := _GROUP.search(n))]  # fmt: skip
  starts, pairs = {}, []
  for i, (line, name) in enumerate(zip(entry, names, strict=True)):
    group = _GROUP.search(name)
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?\ball-to-all-start\(", line)
    if m and group:
      starts[m.group(1)] = (i, int(group.group(1)))
    d = re.search(r"\ball-to-all-done\(%?([\w.\-]+)\)", line)
    if d and d.group(1) in starts:
      (s, g) = starts.pop(d.group(1))
      pairs.append(sum(1 for j, other in ns if s < j < i and other != g))
  muon_collectives = [i for i, n in enumerate(names) if _GROUP.search(n) and _COLL_OP.search(entry[i])]
  return {
    "entry_instructions": len(entry),
    "backward_instructions": len(backward),
    "backward_ends_at": end,
    "muon_groups": len({g for _, g in ns}),
    "ns_matmuls": len(ns),
    "first_ns_matmul_at": ns[0][0] if ns else -1,
    "ns_matmuls_before_backward_ends": sum(i < end for i, _ in ns),
    "backward_matmuls": len(backward_matmuls),
    "backward_matmuls_after_first_ns": sum(i > ns[0][0] for i in backward_matmuls) if ns else 0,
    "muon_collectives_before_backward_ends": sum(i < end for i in muon_collectives),
    "muon_async_all_to_alls": len(pairs),
    "with_other_groups_ns_inside": sum(n > 0 for n in pairs),
    "max_other_groups_ns_inside": max(pairs, default=0),
  }


_COLL_OP = re.compile(
  r"\b((?:ragged-)?all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)(-start)?\("
)


def compile_step(config: configs.Config, devices: list) -> dict:
  """The whole train step compiled; compiler figures and `schedule`."""
  meshes = sharding.build_meshes(config.mesh.dense, config.mesh.expert, devices)
  t0, cpu0 = time.perf_counter(), time.process_time()
  compiled = compile_stage.lower_train_step(config, meshes).compile()
  seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
  hlo = compiled.as_text()
  out = {"devices": len(devices), "platform": devices[0].platform, "layers": config.model.n_layers}
  out |= {"scan_layers": config.model.scan_layers, "compile_seconds": round(seconds, 1)}
  out |= {"compile_cpu_seconds": round(cpu, 1)} | compile_stage.analyse(compiled)
  return out | {"overlap": overlap(hlo), "schedule": schedule(hlo), "hlo": hlo}


def compile_update(config: configs.Config, devices: list) -> dict:
  cfg = config.model
  meshes = sharding.build_meshes(config.mesh.dense, config.mesh.expert, devices)
  ocfg = configs.pretrain_optimizer(config)
  tx = optim.muon_branch(cfg, ocfg, meshes)
  state = train_state.abstract_state(cfg, tx, meshes)
  shard = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
  fn = jax.jit(
    tx.update,
    in_shardings=(shard(state.params), shard(state.opt_state), shard(state.params)),
    out_shardings=(shard(state.params), shard(state.opt_state)),
  )
  t0 = time.perf_counter()
  compiled = fn.lower(state.params, state.opt_state, state.params).compile()
  seconds = time.perf_counter() - t0
  hlo = compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  mem = compiled.memory_analysis()
  ideal = ideal_flops(cfg, ocfg.ns_steps) / len(devices)
  coll = collectives(hlo)
  # XLA's cost model with loop bodies weighted by trip count: the update's own estimated seconds.
  est = estimate.estimate(hlo, cost, devices[0].device_kind)
  return {
    "devices": len(devices),
    "platform": devices[0].platform,
    "layers": cfg.n_layers,
    "compile_seconds": round(seconds, 1),
    "flops_per_device": float(cost.get("flops", 0.0)),
    "ideal_ns_flops_per_device": ideal,
    "flops_over_ideal": float(cost.get("flops", 0.0)) / ideal,
    "temp_bytes": int(mem.temp_size_in_bytes),
    "collectives": coll,
    "collective_bytes": sum(v["bytes"] for v in coll.values()),
    "overlap": overlap(hlo),
    "estimated_seconds": est["step_seconds"],
    "estimate": {k: est[k] for k in ("xla_raw", "correction", "flops", "seconds_source", "collective_bytes")},
    "hlo": hlo,
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variant", default="moonlight_16b")
  p.add_argument("--topology", default=None, help="TPU topology (e.g. v5p:4x4x4); default: the CPU devices")
  p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
  p.add_argument("--expert_mesh", default=None, help="override mesh.expert, e.g. 8,8 (expert, expert_fsdp)")
  p.add_argument("--step", action="store_true", help="compile the whole train step (module docstring)")
  p.add_argument("--unrolled", action="store_true", help="model.scan_layers=False")
  p.add_argument(
    "--clip_muon", action="store_true", help="optim.clip_muon=True: global-norm clip over all leaves"
  )
  p.add_argument("--attention_impl", default=None, help="override model.attention_impl (e.g. xla)")
  p.add_argument("--expert_impl", default=None, help="override model.expert_impl (e.g. ragged)")
  p.add_argument("--json", default=None, help="write the result here")
  p.add_argument("--hlo", default=None, help="write the optimized HLO here")
  args = p.parse_args()
  config = _config(args.variant)
  if args.layers:
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=args.layers))
  model_changes = {"scan_layers": False} if args.unrolled else {}
  model_changes |= {k: getattr(args, k) for k in ("attention_impl", "expert_impl") if getattr(args, k)}
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, **model_changes))
  if args.clip_muon:  # the step before issue 16: the global norm over every leaf gates Muon's input
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, clip_muon=True))
  if args.expert_mesh:
    expert = tuple(int(x) for x in args.expert_mesh.split(","))
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, expert=expert))
  devices = compile_stage.topology_devices(args.topology) if args.topology else jax.devices()
  result = {"variant": args.variant, "topology": args.topology, "expert_mesh": config.mesh.expert}
  result |= (compile_step if args.step else compile_update)(config, devices)
  hlo = result.pop("hlo")
  print(json.dumps(result, indent=1))
  if args.hlo:
    with open(args.hlo, "w") as f:
      f.write(hlo)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
