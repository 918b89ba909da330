"""Full training step (forward + backward + optimizer update) tokens/s: ours vs MaxText, Muon vs AdamW.

  python benchmarks/train_step.py --maxtext_python=<maxtext venv>/bin/python   # all four sides
  python benchmarks/train_step.py --no_maxtext --rounds 1 --steps 2            # ours only, quick

Sides (same benchmark shape as `model_step.py`: DeepSeek block, d_model 256, 4 MoE layers, 8 heads,
MLA without q-LoRA, 8 routed experts top-2 + 1 shared of width 512, vocab 1024, batch 8 × seq 256,
fp32, ONE CPU device):
  ours Muon   `optim.build_optimizer` with the default `OptimizerConfig` (sharded Muon on matrices,
              AdamW on the rest), stepped by `train.step.make_step` on a 1-device mesh;
  ours AdamW  the same step with AdamW on every trainable leaf (same schedule, betas, weight-decay
              mask, clipping; `OptimizerConfig` has no AdamW-only switch, so it is built here);
  MaxText AdamW / MaxText Muon (`opt_type=muon`), run as subprocesses of `--maxtext_python`
              (`shared_experts=1`, `megablox=False`, i.e. `jax.lax.ragged_dot` experts).
Rounds alternate the sides. Ours: the jitted, donated step, 2 warm-up steps, then `--steps` timed
steps per round. MaxText: one process per round with `steps = --steps + 2`; its own per-step log
is parsed, steps 0–1 ignored (async dispatch). Each side reports the median round.

MFU = the step's FLOPs ÷ step time ÷ the measured peak of one 2048³ fp32 matmul, with two counts:
ours `cost_analysis()['flops']` of the compiled step (MaxText: its own logged count), and one
common count for every side, 6·N_active·tokens. NS efficiency = `cost_analysis` FLOPs of the Muon
update alone ÷ the ideal Newton–Schulz matmul FLOPs of all Muon matrices.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# One real CPU device: drop any fake-device flag inherited from the environment (here and in MaxText).
_XLA_FLAGS = " ".join(
  f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f
)
os.environ["XLA_FLAGS"] = _XLA_FLAGS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks.machine import describe as machine  # noqa: E402
from benchmarks.model_step import BATCH, BENCH, SEQ  # noqa: E402
from composer_jax import configs, model, optim, sharding, train  # noqa: E402
from composer_jax.optim import muon as muon_lib  # noqa: E402
from composer_jax.optim import newton_schulz  # noqa: E402
from composer_jax.train import metrics as metrics_lib  # noqa: E402
from composer_jax.train import pretrain  # noqa: E402
from composer_jax.train import step as step_lib  # noqa: E402
from composer_jax.train.batch import TokenBatch, place  # noqa: E402

TOKENS = BATCH * SEQ
WARMUP = 2

# MaxText flags for the same shape (notes: peers.md). shared_experts=1: with 0, MaxText's Muon divides
# by a zero fan-in; megablox=False: the default TPU kernel runs interpreted on CPU.
MAXTEXT_SHAPE = (
  "model_name=deepseek3-tiny override_model_config=True base_emb_dim=256 base_num_query_heads=8 "
  "base_num_kv_heads=8 base_mlp_dim=512 base_moe_mlp_dim=512 base_num_decoder_layers=4 "
  "first_num_dense_layers=0 num_experts=8 num_experts_per_tok=2 shared_experts=1 q_lora_rank=0 "
  "kv_lora_rank=64 qk_nope_head_dim=32 qk_rope_head_dim=16 v_head_dim=32 vocab_size=1024 "
  f"max_target_length={SEQ} per_device_batch_size={BATCH} dtype=float32 megablox=False"
).split()
MAXTEXT_CPU = (
  "hardware=cpu skip_jax_distributed_system=True dataset_type=synthetic enable_checkpointing=false"
).split()


# ---------------------------------------------------------------------------------------------------
# Ours


def single_device_meshes() -> sharding.Meshes:
  return sharding.build_meshes((1, 1, 1), (1, 1), jax.devices()[:1])


def flops_of(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  return float(cost.get("flops", float("nan")))


def ideal_ns_flops(cfg: model.ModelConfig, ocfg: optim.OptimizerConfig) -> float:
  """Matmul FLOPs of Newton–Schulz over every Muon matrix (`newton_schulz.flops` each)."""
  shapes = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))
  dns = optim.dimension_numbers(cfg)
  total = 0.0
  for leaf, dn in zip(
    jax.tree.leaves(shapes),
    jax.tree.leaves(dns, is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)),
    strict=True,
  ):
    if dn is None:
      continue
    fan_in, fan_out = muon_lib.fans(leaf.shape, dn)
    n = math.prod(leaf.shape) // (fan_in * fan_out)
    total += n * newton_schulz.flops(fan_in, fan_out, ocfg.ns_steps)
  return total


def muon_update_flops(cfg: model.ModelConfig, ocfg: optim.OptimizerConfig, meshes, params) -> float:
  """cost_analysis FLOPs of the Muon branch's update alone (the transform `build_optimizer` uses)."""
  tx = optim.muon_branch(cfg, ocfg, meshes, params)
  state = tx.init(params)
  return flops_of(jax.jit(tx.update).lower(params, state, params).compile())


def optimizer_update_flops(tx, params) -> float:
  state = tx.init(params)
  return flops_of(jax.jit(tx.update).lower(params, state, params).compile())


class OursSide:
  """The pretraining step (`train.step.make_step` with the next-token loss), compiled once, state donated
  every step."""

  def __init__(self, name: str, tx, cfg: model.ModelConfig, ocfg: optim.OptimizerConfig, meshes, batch):
    self.name, self.batch = name, batch
    self.state = train.create_state(cfg, tx, jax.random.key(0), meshes)
    step = step_lib.make_step(
      step_lib.next_token_loss(cfg, meshes), tx, cfg, schedule=optim.lr_schedule(ocfg), meshes=meshes,
      state_sharding=train.state.state_shardings(self.state),
      router_bias_rate=configs.TrainConfig().router_bias_rate,
    )  # fmt: skip
    t0 = time.perf_counter()
    self.step = step.lower(self.state, batch).compile()
    self.compile_s = time.perf_counter() - t0
    self.flops = flops_of(self.step)
    self.opt_flops = optimizer_update_flops(tx, self.state.params)
    self.losses: list[float] = []
    self.skipped = 0
    print(f"{name}: compiled in {self.compile_s:.1f}s, {self.flops / 1e9:.1f} GFLOP/step", flush=True)
    for _ in range(WARMUP):
      self.run(1)

  def run(self, steps: int) -> float:
    """Seconds per step over `steps` back-to-back steps (one block at the end)."""
    t0 = time.perf_counter()
    for _ in range(steps):
      self.state, m = self.step(self.state, self.batch)
    m = jax.device_get(m)
    jax.block_until_ready(self.state)
    dt = (time.perf_counter() - t0) / steps
    self.losses.append(float(m["loss"]))
    self.skipped += int(m["skipped"])
    return dt


# ---------------------------------------------------------------------------------------------------
# MaxText


def maxtext_info(python: str) -> dict:
  code = (
    "import importlib.metadata as m, json, os, maxtext;"
    "print(json.dumps({'dir': os.path.dirname(maxtext.__file__),"
    "**{p: m.version(p) for p in ('maxtext', 'jax', 'jaxlib', 'flax', 'optax')}}))"
  )
  out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, env=_maxtext_env())
  return json.loads(out.stdout.strip().splitlines()[-1])


def _maxtext_env() -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
  env["XLA_FLAGS"] = _XLA_FLAGS
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


_STEP_RE = re.compile(
  r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), Tokens/s/device: ([\d.]+)"
)


class MaxTextSide:
  def __init__(self, name: str, python: str, pkg_dir: str, extra: list[str], workdir: str):
    self.name, self.python, self.pkg_dir, self.extra, self.workdir = name, python, pkg_dir, extra, workdir
    self.flops = math.nan  # MaxText's own count per step (weights 6·N·tokens + attention)
    self.tok_s: list[float] = []
    self.runs = 0

  def command(self, steps: int) -> list[str]:
    self.runs += 1
    run_name = f"{self.name.replace(' ', '_')}_{self.runs}"
    return [
      self.python,
      "-m",
      "maxtext.trainers.pre_train.train",
      os.path.join(self.pkg_dir, "configs", "base.yml"),
      *MAXTEXT_SHAPE,
      *MAXTEXT_CPU,
      f"steps={steps + WARMUP}",
      f"run_name={run_name}",
      f"base_output_directory={self.workdir}",
      *self.extra,
    ]

  def run(self, steps: int) -> float:
    cmd = self.command(steps)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_maxtext_env())
    log = proc.stdout + proc.stderr
    rows = [(int(s), float(sec), float(tf), float(tok)) for s, sec, tf, tok in _STEP_RE.findall(log)]
    timed = [r for r in rows if r[0] >= WARMUP]
    if proc.returncode or not timed:
      tail = "\n".join(log.splitlines()[-40:])
      raise RuntimeError(f"{self.name}: exit {proc.returncode}, {len(timed)} timed steps parsed\n{tail}")
    # Its FLOPs per step = TFLOP/s × seconds; both are logged to 3 decimals, so take the step with the
    # largest TFLOP/s (step 0, whose `seconds` is only the dispatch) for the fewest rounding digits lost.
    best = max(rows, key=lambda r: r[2])
    self.flops = best[2] * best[1] * 1e12
    self.tok_s.append(statistics.median(r[3] for r in timed))
    return statistics.median(r[1] for r in timed)


# ---------------------------------------------------------------------------------------------------
# Report


def matmul_peak(n: int = 2048, tries: int = 5) -> float:
  """FLOP/s of the best of `tries` n×n×n fp32 matmuls on one device."""
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
  mm = jax.jit(jnp.matmul)
  mm(a, b).block_until_ready()
  best = math.inf
  for _ in range(tries):
    t0 = time.perf_counter()
    mm(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n**3 / best


def public_command(argv: list[str]) -> str:
  """The command line without this machine's paths: the MaxText interpreter becomes a placeholder, an
  `--out` file is given relative to the repository (or by its name)."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def local(flag: str, value: str) -> str:
    if flag == "--maxtext_python":
      return "<maxtext venv>/bin/python"
    if flag == "--out" and os.path.isabs(value):
      rel = os.path.relpath(value, repo)
      return os.path.basename(value) if rel.startswith("..") else rel
    return value

  out = []
  for i, a in enumerate(argv):
    flag, eq, value = a.partition("=")
    if eq and flag in ("--maxtext_python", "--out"):
      a = f"{flag}={local(flag, value)}"
    elif i and argv[i - 1] in ("--maxtext_python", "--out"):
      a = local(argv[i - 1], a)
    out.append(a)
  return "python benchmarks/train_step.py " + " ".join(out)


def versions(mt: dict | None) -> str:
  ours = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("jax", "jaxlib", "flax", "optax"))
  s = f"ours: {ours} (Python {platform.python_version()})"
  if mt:
    s += (
      "; MaxText "
      + mt["maxtext"]
      + ": "
      + ", ".join(f"{p} {mt[p]}" for p in ("jax", "jaxlib", "flax", "optax"))
    )
  return s


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=5, help="alternating rounds; each side reports its median")
  ap.add_argument("--steps", type=int, default=5, help="timed steps per round (MaxText runs steps+2)")
  ap.add_argument("--maxtext_python", default=None, help="python of a venv with `pip install 'maxtext[tpu]'`")
  ap.add_argument("--no_ours", action="store_true")
  ap.add_argument("--no_maxtext", action="store_true")
  ap.add_argument("--out", default=None, help="append a dated markdown section to this file")
  args = ap.parse_args()

  cfg = BENCH
  ocfg = optim.OptimizerConfig(learning_rate=3e-4, warmup_steps=100, total_steps=10_000)
  peak = matmul_peak()
  print(f"matmul peak (2048³ fp32, best of 5): {peak / 1e9:.1f} GFLOP/s; devices {jax.devices()}", flush=True)

  sides: dict = {}
  model_flops = metrics_lib.flops_per_token(pretrain.active_params(cfg)) * TOKENS
  ns = None
  if not args.no_ours:
    meshes = single_device_meshes()
    abstract = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, SEQ), dtype=np.int32)
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy()
    batch = place(TokenBatch(tokens, positions, np.ones((BATCH, SEQ), np.int32)), meshes)
    sides["ours Muon"] = OursSide(
      "ours Muon", optim.build_optimizer(cfg, ocfg, meshes, abstract), cfg, ocfg, meshes, batch
    )
    adamw_cfg = dataclasses.replace(ocfg, matrix_optimizer="adamw")
    tx_adamw = optim.build_optimizer(cfg, adamw_cfg, meshes, abstract)
    sides["ours AdamW"] = OursSide("ours AdamW", tx_adamw, cfg, ocfg, meshes, batch)
    ns = (muon_update_flops(cfg, ocfg, meshes, sides["ours Muon"].state.params), ideal_ns_flops(cfg, ocfg))

  mt_info = None
  if args.no_maxtext:
    print("MaxText sides skipped (--no_maxtext).", flush=True)
  elif not args.maxtext_python:
    print(
      "MaxText sides skipped: pass --maxtext_python=<venv>/bin/python "
      "(a Python ≥ 3.12 venv with `pip install 'maxtext[tpu]'`)."
    )
  else:
    mt_info = maxtext_info(args.maxtext_python)
    workdir = tempfile.mkdtemp(prefix="maxtext_bench_")
    for name, extra in (("MaxText AdamW", []), ("MaxText Muon", ["opt_type=muon"])):
      sides[name] = MaxTextSide(name, args.maxtext_python, mt_info["dir"], extra, workdir)
    print(f"MaxText {mt_info['maxtext']} at {mt_info['dir']}; output under {workdir}", flush=True)
  if not sides:
    sys.exit("nothing to run")
  workdirs = [s.workdir for s in sides.values() if isinstance(s, MaxTextSide)]

  times = {name: [] for name in sides}
  for r in range(args.rounds):
    for name, side in sides.items():
      t0 = time.perf_counter()
      times[name].append(side.run(args.steps))
      print(
        f"round {r + 1}/{args.rounds} {name}: {times[name][-1] * 1e3:.0f} ms/step "
        f"(round wall {time.perf_counter() - t0:.0f}s)",
        flush=True,
      )

  med = {name: statistics.median(ts) for name, ts in times.items()}
  lines = [
    "| side | optimizer | ms/step (median) | tok/s | GFLOP/step (source) | MFU | MFU (6·N·tokens) "
    "| rounds (ms/step) |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for name, side in sides.items():
    t = med[name]
    src = "cost analysis" if isinstance(side, OursSide) else "MaxText's count"
    rounds = ", ".join(f"{x * 1e3:.0f}" for x in times[name])
    who, opt = name.split()
    lines.append(
      f"| {who} | {opt} | {t * 1e3:.0f} | {TOKENS / t:,.0f} | {side.flops / 1e9:.1f} ({src}) "
      f"| {side.flops / t / peak:.1%} | {model_flops / t / peak:.1%} | {rounds} |"
    )
  lines.append("")
  for who in ("ours", "MaxText"):
    if f"{who} Muon" in med and f"{who} AdamW" in med:
      lines.append(f"- {who}: Muon ÷ AdamW step time = **{med[f'{who} Muon'] / med[f'{who} AdamW']:.2f}**")
  for opt in ("AdamW", "Muon"):
    if f"ours {opt}" in med and f"MaxText {opt}" in med:
      lines.append(f"- {opt}: ours ÷ MaxText tok/s = **{med[f'MaxText {opt}'] / med[f'ours {opt}']:.2f}**")
  if ns is not None:
    m, a = sides["ours Muon"].opt_flops, sides["ours AdamW"].opt_flops
    lines.append(
      f"- optimizer update alone (cost analysis): Muon optimizer {m / 1e9:.2f} GFLOP, AdamW-only "
      f"{a / 1e9:.3f} GFLOP; Muon branch alone {ns[0] / 1e9:.2f} GFLOP vs ideal NS "
      f"{ns[1] / 1e9:.2f} GFLOP (ratio **{ns[0] / ns[1]:.2f}**)"
    )
    for side in (sides["ours Muon"], sides["ours AdamW"]):
      lines.append(
        f"- {side.name}: loss {side.losses[0]:.3f} → {side.losses[-1]:.3f}, skipped steps {side.skipped}"
      )
  lines.append(
    f"- 6·N_active·tokens = {model_flops / 1e9:.1f} GFLOP/step (no attention scores, no optimizer): the "
    "common count of the MFU (6·N·tokens) column. XLA's cost analysis counts a scan (while-loop) body "
    "once, so ours misses most routed-expert FLOPs (the blocked path is a scan over blocks); the "
    "Newton–Schulz matmuls are not in a loop and are counted in full"
  )
  lines.append(f"- matmul peak (2048³ fp32, best of 5): {peak / 1e9:.1f} GFLOP/s")
  table = "\n".join(lines)
  print("\n" + table)
  for d in set(workdirs):
    shutil.rmtree(d, ignore_errors=True)

  if args.out:
    section = [
      f"\n## Full train step: ours vs MaxText, Muon vs AdamW ({datetime.date.today().isoformat()})\n",
      f"- **Machine**: {machine()}",
      f"- **Versions**: {versions(mt_info)}",
      f"- **Command**: `{public_command(sys.argv[1:])}`",
      f"- **Shape**: {BATCH} × {SEQ} = {TOKENS:,} tokens/step, DeepSeek block d256 L4 (all MoE) 8 heads, MLA "
      "no q-LoRA, 8 experts top-2 + 1 shared (width 512), vocab 1024, fp32, one CPU device. "
      f"MoE path: ours `expert_impl={cfg.expert_impl}`, MaxText `megablox=False` (`ragged_dot`). "
      f"{args.rounds} alternating rounds × {args.steps} timed steps, median round.",
      "- **MaxText flags**: `" + " ".join(MAXTEXT_SHAPE + MAXTEXT_CPU) + "` (+ `opt_type=muon`)",
      "",
      table,
      "",
    ]
    with open(args.out, "a") as f:
      f.write("\n".join(section))
    print(f"appended to {args.out}")


if __name__ == "__main__":
  main()
