"""Our train step and MaxText's, same shapes, compiled ahead of time for one TPU topology, judged side by
side by XLA:TPU's cost model (issue 33; RESULTS.md "Compiler cost model vs MaxText").

  python benchmarks/compile_vs_maxtext.py --maxtext_python=<maxtext venv>/bin/python --out=<dir>
  python benchmarks/compile_vs_maxtext.py --out=<dir> --skip_ours --skip_maxtext     # table from <dir>

Ours: `plan.compile.lower_train_step` for --variant (moonlight_16b: 27 layers scanned, d 2048, 64 routed
experts top-6 + 2 shared, MLA without q-LoRA, vocab 163,840, 256 x 4096 tokens, full remat, fp32
params, bf16 compute, Muon with bf16 Newton–Schulz) on --topology. MaxText: `model_name=deepseek2-16b`
(DeepSeek-V2-Lite: the same layer count, widths, experts, top-k, MLA ranks) with the differences to
Moonlight overridden (`MOONLIGHT_OVERRIDES`: dense MLP 11,264, vocab 163,840, sigmoid router with bias,
scaling 2.446, plain RoPE theta 50k, eps 1e-5) and the same batch, sequence, remat and optimizer
(`opt_type=muon`, Moonlight's 0.2 RMS scaling, weight decay 0.1), compiled by MaxText's own
`train_compile` in its own venv (`_maxtext_compile.py`: MaxText needs Python >= 3.12 and pins a newer
jax/libtpu — the versions of both sides are in the JSON; the XLA versions differ).

Both compiled programs go through the same `plan.estimate.estimate` (XLA's `cost_analysis()` with every
`while` body weighted by its trip count): compiled FLOPs per device (÷ the model's FLOPs from
`plan.compile.model_flops`, the same work on both sides), the estimated step time, MFU at v5p's bf16
peak, peak memory per chip (argument + temp + output − alias) and collective bytes per device by kind.
Writes <out>/ours.json, <out>/ours.hlo.txt, <out>/maxtext/{maxtext.json,maxtext.hlo.txt} and
<out>/compile_vs_maxtext.json (the table's figures); prints the markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from composer_jax import configs, sharding  # noqa: E402
from composer_jax.plan import compile as compile_stage  # noqa: E402
from composer_jax.plan import estimate  # noqa: E402

# deepseek2-16b (MaxText's DeepSeek-V2-Lite) -> Moonlight-16B-A3B (experiments/composer25.py:moonlight_16b).
MOONLIGHT_OVERRIDES = (
  "model_name=deepseek2-16b",
  "override_model_config=true",
  "base_mlp_dim=11264",
  "vocab_size=163840",
  "routed_scaling_factor=2.446",
  "routed_score_func=sigmoid",
  "routed_bias=true",
  "normalization_layer_epsilon=1e-5",
  "rope_type=default",
  "rope_max_timescale=50000",
  "remat_policy=full",
  "opt_type=muon",
  "muon_consistent_rms=0.2",
  "muon_weight_decay=0.1",
  "dataset_type=synthetic",
  "enable_checkpointing=false",
)
# kimi-k2-1t (MaxText's Kimi K2: the K2.5 text branch's layers, widths, 384 experts top-8, MLA, vocab) on
# 1024 chips: its default (FSDP over every chip) cannot split the 512-row MLA kv_b matrix 1024 ways and
# gathering every expert runs out of HBM at compile time (1.16 TB of temporaries), so it gets a mesh of
# its own axes with the same degrees of context (4) and expert parallelism (64) class as ours
# (RESULTS.md "Kimi K2.5 1T vs MaxText's kimi-k2-1t").
KIMI_OVERRIDES = (
  "model_name=kimi-k2-1t",
  "remat_policy=full",
  "opt_type=muon",
  "dataset_type=synthetic",
  "enable_checkpointing=false",
  "ici_data_parallelism=2",
  "ici_context_parallelism=4",
  "ici_expert_parallelism=64",
  "ici_fsdp_parallelism=2",
  "allow_split_physical_axes=true",
)
MAXTEXT_OVERRIDES = {"moonlight_16b": MOONLIGHT_OVERRIDES, "kimi_k25_1t": KIMI_OVERRIDES}
# `v5p-N` names count TensorCores (two per chip): v5p:4x4x4 (64 chips) is v5p-128.
MAXTEXT_TOPOLOGY = {"v5p:4x4x4": "v5p-128", "v5p:8x8x16": "v5p-2048", "v5p:2x2x1": "v5p-8"}


def _config(variant: str, topology: str) -> configs.Config:
  path = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "composer25.py"
  )
  spec = importlib.util.spec_from_file_location("composer25", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = configs.from_config(module.get_config(variant))
  return dataclasses.replace(
    config, compile=dataclasses.replace(config.compile, topology=topology, step="train")
  )


def compile_ours(config: configs.Config, out: pathlib.Path, tag: str = "") -> dict:
  """Our train step compiled on the topology: the compile stage's analysis, HLO saved."""
  devices = compile_stage.topology_devices(config.compile.topology)
  meshes = sharding.build_meshes(config.mesh.dense, config.mesh.expert, devices)
  t0, cpu0 = time.perf_counter(), time.process_time()
  compiled = compile_stage.lower_train_step(config, meshes).compile()
  record = {"compile_seconds": time.perf_counter() - t0, "compile_cpu_seconds": time.process_time() - cpu0}
  (out / f"ours{tag}.hlo.txt").write_text(compiled.as_text())
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  mem = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
  versions = {k: importlib.metadata.version(k) for k in ("jax", "jaxlib", "libtpu", "flax", "optax")}
  record |= {"versions": versions, "devices": len(devices), "device_kind": devices[0].device_kind}
  record["cost_analysis"] = {k: float(v) for k, v in cost.items() if isinstance(v, int | float)}
  record["memory"] = {k.removesuffix("_size_in_bytes"): int(getattr(mem, k)) for k in fields}
  (out / f"ours{tag}.json").write_text(json.dumps(record, indent=1))
  return record


def compile_maxtext(python: str, config: configs.Config, out: pathlib.Path) -> None:
  """MaxText's train_compile for the same shapes, in its venv (`_maxtext_compile.py`)."""
  t = config.train
  overrides = [
    *MAXTEXT_OVERRIDES[config.variant],
    f"compile_topology={MAXTEXT_TOPOLOGY[config.compile.topology]}",
    "compile_topology_num_slices=1",
    f"per_device_batch_size={t.batch_size / len(compile_stage.topology_devices(config.compile.topology)):g}",
    f"max_target_length={t.seq_len}",
    "run_name=compile_vs_maxtext",
    f"base_output_directory={out / 'maxtext' / 'run'}",
  ]
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_maxtext_compile.py")
  subprocess.run([python, script, str(out / "maxtext"), *overrides], check=True)


def side(record: dict, hlo: str, config: configs.Config) -> dict:
  """One side's figures per device: the loop-corrected estimate against the model's FLOPs."""
  est = estimate.estimate(hlo, record["cost_analysis"], record["device_kind"], compile_stage.MUON_SCOPES)
  model = compile_stage.model_flops(config.model, config.train.batch_size, config.train.seq_len)
  model /= record["devices"]
  mem = record["memory"]
  seconds = est["step_seconds"]
  return {
    "compiled_flops": est["flops"],
    "xla_raw_flops": est["xla_raw"]["flops"],
    "model_flops": model,
    "compiled_over_model_flops": est["flops"] / model,
    "xla_raw_optimal_seconds": est["xla_raw"]["optimal_seconds"],
    "loop_correction_seconds": est["correction"]["seconds"],
    "step_seconds": seconds,
    "seconds_source": est["seconds_source"],
    "mfu": model / (est["peak_flops"] * seconds),
    # The same per-op roofline walk on both sides: comparable even where XLA's optimal_seconds is invalid.
    "roofline_seconds": est["roofline_seconds"],
    "mfu_roofline": model / (est["peak_flops"] * est["roofline_seconds"]),
    "peak_bytes": mem["argument"] + mem["temp"] + mem["output"] - mem["alias"],
    "temp_bytes": mem["temp"],
    "collective_bytes": est["collective_bytes"],
    "muon_seconds": est["scope_seconds"].get("muon", 0.0),
    "loops": len(est["loops"]),
    "unknown_trip_counts": est["unknown_trip_counts"],
    "compile_seconds": record["compile_seconds"],
    "versions": record["versions"],
    "breakdown": estimate.breakdown(hlo, record["device_kind"]),
  }


_ROWS = (
  ("compiled TFLOP / device (loops x trips)", "compiled_flops", 1e-12, "{:.1f}"),
  ("XLA raw TFLOP / device (loop body once)", "xla_raw_flops", 1e-12, "{:.1f}"),
  ("model TFLOP / device (6 N_active T + attn)", "model_flops", 1e-12, "{:.1f}"),
  ("compiled / model FLOPs", "compiled_over_model_flops", 1, "{:.3f}"),
  ("XLA raw optimal_seconds (s)", "xla_raw_optimal_seconds", 1, "{:.3f}"),
  ("estimated step time (s), XLA x loop ratio or roofline", "step_seconds", 1, "{:.3f}"),
  ("estimated MFU, same source (v5p bf16 459 TFLOP/s)", "mfu", 100, "{:.1f} %"),
  ("roofline step time (s), same walk both sides", "roofline_seconds", 1, "{:.3f}"),
  ("roofline MFU", "mfu_roofline", 100, "{:.1f} %"),
  ("peak memory / chip (GiB)", "peak_bytes", 2**-30, "{:.2f}"),
  ("temp / chip (GiB)", "temp_bytes", 2**-30, "{:.2f}"),
  ("Muon update, named scopes (s)", "muon_seconds", 1, "{:.3f}"),
  ("compile wall time (s)", "compile_seconds", 1, "{:.0f}"),
)


def table(ours: dict, theirs: dict) -> str:
  """Markdown: one row per figure, ours / MaxText / ratio; collective bytes per kind after."""
  lines = ["| per device, one step | ours | MaxText | ours / MaxText |", "|---|---|---|---|"]
  for label, key, scale, fmt in _ROWS:
    a, b = ours[key] * scale, theirs[key] * scale
    ratio = f"{a / b:.2f}" if b else "n/a"
    lines.append(f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |")
  kinds = sorted(set(ours["collective_bytes"]) | set(theirs["collective_bytes"]))
  for kind in kinds:
    a, b = (s["collective_bytes"].get(kind, 0) / 1e9 for s in (ours, theirs))
    lines.append(f"| {kind} (GB, result bytes) | {a:.1f} | {b:.1f} | {f'{a / b:.2f}' if b else 'n/a'} |")
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variant", default="moonlight_16b")
  p.add_argument("--topology", default="v5p:4x4x4")
  p.add_argument("--out", required=True, help="directory for both sides' records, HLO and the table")
  p.add_argument("--maxtext_python", default=None, help="python of a venv with maxtext[tpu]")
  p.add_argument("--skip_ours", action="store_true", help="reuse <out>/ours.json and ours.hlo.txt")
  p.add_argument("--skip_maxtext", action="store_true", help="reuse <out>/maxtext/")
  p.add_argument("--tag", default="", help="suffix of our output files (e.g. another jax/libtpu)")
  p.add_argument(
    "--capacity_factor", type=float, default=None, help="our model.capacity_factor (EP buffers; default 2)"
  )
  p.add_argument(
    "--expert_chunks", type=int, default=None, help="our model.expert_chunks (default: the variant's)"
  )
  args = p.parse_args()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  config = _config(args.variant, args.topology)
  tag = args.tag
  if args.capacity_factor is not None:  # item 3: the EP buffers' share of our step (RESULTS.md)
    model = dataclasses.replace(config.model, capacity_factor=args.capacity_factor)
    config, tag = dataclasses.replace(config, model=model), f"{tag}_cf{args.capacity_factor:g}"
  if args.expert_chunks is not None:  # the MoE row-chunk loop on or off (RESULTS.md)
    model = dataclasses.replace(config.model, expert_chunks=args.expert_chunks)
    config, tag = dataclasses.replace(config, model=model), f"{tag}_chunks{args.expert_chunks}"
  if not args.skip_maxtext:
    if not args.maxtext_python:
      p.error("--maxtext_python is needed unless --skip_maxtext")
    compile_maxtext(args.maxtext_python, config, out)
  if not args.skip_ours:
    compile_ours(config, out, tag)
  sides = {}
  for name, record, hlo in (
    ("ours", f"ours{tag}.json", f"ours{tag}.hlo.txt"),
    ("maxtext", "maxtext/maxtext.json", "maxtext/maxtext.hlo.txt"),
  ):
    sides[name] = side(json.loads((out / record).read_text()), (out / hlo).read_text(), config)
  theirs = json.loads((out / "maxtext" / "maxtext.json").read_text())
  result = {"variant": args.variant, "topology": args.topology, "maxtext_overrides": theirs.get("overrides")}
  result |= sides | {"table": table(sides["ours"], sides["maxtext"])}
  result["capacity_factor"] = config.model.capacity_factor
  result["expert_chunks"] = config.model.expert_chunks
  (out / f"compile_vs_maxtext{tag}.json").write_text(json.dumps(result, indent=1))
  print(result["table"])
  print(
    json.dumps(
      {k: {kk: vv for kk, vv in v.items() if kk != "collective_bytes"} for k, v in sides.items()}, indent=1
    )
  )


if __name__ == "__main__":
  main()
