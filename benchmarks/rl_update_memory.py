"""Memory and time of one RL update against the padded rollout length: before and after issue 40.

  python benchmarks/rl_update_memory.py               # all cells: benchmarks/results/rl_update_memory.json
  python benchmarks/rl_update_memory.py --lengths 512   # some lengths only

The tiny model of `experiments/composer25.py` (the rl stage's model, with a frozen teacher) on 64 synthetic
rollouts (`rl.batch.synthetic_batch`: 8 problems x 8, 75-100 % of the padded length T, 32 of them with a
teacher row); T in 512, 1024, 2048; on the default 8-device meshes
and on one device. Two paths:
  before  the whole batch in one pass, whole-sequence attention (model.attention_chunk 0);
  after   the defaults: attention over query chunks of 512, the update in the micro-batches `plan.host`
          chooses for rl.update_memory of this host.
Each cell runs in its own process (`--cell`), so its peak RSS (getrusage) is its own: compile, then, when
XLA's own accounting of the step (arguments + temporaries, all devices) is under 80 % of the host's memory,
one warm-up step and `--steps` timed ones (median). Cells over that are compiled only and reported so.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]

import composer25  # noqa: E402  (experiments/, on the path above)

from composer_jax import configs, optim, sharding, train  # noqa: E402
from composer_jax.plan import host  # noqa: E402
from composer_jax.rl import batch as rl_batch  # noqa: E402
from composer_jax.rl import step as rl_step  # noqa: E402
from composer_jax.rl.loss import LossSettings  # noqa: E402
from composer_jax.stages import rl as rl_stage  # noqa: E402
from composer_jax.train.batch import place  # noqa: E402
from composer_jax.train.step import make_step  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "rl_update_memory.json"
GIB = 2**30


def _config(devices: int, length: int, path: str):
  """The tiny config of the rl stage for this cell (rl.cache_len = T: the plan is made at the longest)."""
  base = configs.from_config(composer25.get_config("tiny"))
  mesh = ((4, 1, 2), (8, 1)) if devices == 8 else ((1, 1, 1), (1, 1))
  rl = dataclasses.replace(base.rl, env="ledger", max_turns=21, cache_len=length)
  model = base.model if path == "after" else dataclasses.replace(base.model, attention_chunk=0)
  return dataclasses.replace(
    base, rl=rl, model=model, mesh=dataclasses.replace(base.mesh, dense=mesh[0], expert=mesh[1])
  )


def run_cell(devices: int, length: int, path: str, steps: int) -> dict:
  """One cell in this process (its device count set before jax starts)."""

  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))

  config = _config(devices, length, path)
  rc = config.rl
  tokens = -1 if path == "before" else host.resolve_update_tokens(config)[0]
  rows = 64
  micro = rl_batch.micro_rows(rows, length, tokens, multiple=4 if devices == 8 else 1)
  meshes = sharding.make_meshes(config)
  ocfg = rl_stage.rl_optimizer(config, rc)
  tx = rl_step.teacher_optimizer(optim.build_optimizer(config.model, ocfg, meshes), rc)
  state = train.create_state(config.model, tx, jax.random.key(0), meshes)
  step = make_step(
    rl_step.loss_fn(config.model, LossSettings.of(rc), meshes), tx, config.model,
    schedule=optim.lr_schedule(ocfg), meshes=meshes, state_sharding=train.state.state_shardings(state),
  )  # fmt: skip
  batch = place(
    rl_batch.micro_batched(rl_batch.synthetic_batch(rows, length, rc.feedback_rows), rows // micro), meshes
  )
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  mem = compiled.memory_analysis()
  xla_bytes = (mem.argument_size_in_bytes + mem.temp_size_in_bytes) * devices
  out = {
    "devices": devices, "length": length, "path": path, "rollouts": rows, "micro_rows": micro,
    "update_tokens": tokens, "compile_s": round(time.perf_counter() - t0, 1),
    "xla_gib": round(xla_bytes / GIB, 3),
    "planned_gib": round(host.update_bytes(config, micro, length) / GIB, 3),
  }  # fmt: skip
  if xla_bytes > 0.8 * host.host_memory_bytes():
    out["ran"] = "no: XLA's accounting is over 80 % of this host's memory (compiled only)"
  else:
    times = []
    for i in range(steps + 1):
      t = time.perf_counter()
      state, metrics = compiled(state, batch)
      loss = float(jax.device_get(metrics["loss"]))
      if i:
        times.append(time.perf_counter() - t)
    out |= {"ran": "yes", "step_s": round(statistics.median(times), 2), "loss": loss}
  out["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--lengths", default="512,1024,2048")
  ap.add_argument("--devices", default="8,1")
  ap.add_argument("--steps", type=int, default=2)
  ap.add_argument("--cell", default="", help="devices,length,path: run one cell here and print its JSON")
  ap.add_argument("--out", default=str(RESULTS))
  args = ap.parse_args()
  if args.cell:
    d, n, path = args.cell.split(",")
    print(json.dumps(run_cell(int(d), int(n), path, args.steps)), flush=True)
    return
  cells = []
  for d in args.devices.split(","):
    for n in args.lengths.split(","):
      for path in ("before", "after"):
        cmd = [sys.executable, __file__, f"--cell={d},{n},{path}", f"--steps={args.steps}"]
        env = os.environ | {"JAX_PLATFORMS": "cpu"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode:
          last = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
          cell = {"devices": int(d), "length": int(n), "path": path, "ran": f"failed: {last}"}
        else:
          cell = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(cell), flush=True)
        cells.append(cell)
  tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
  dirty = subprocess.run(
    ["git", "status", "--porcelain", "composer_jax"], capture_output=True, text=True, cwd=ROOT
  )
  record = {
    "what": "one RL update of 64 rollouts vs padded length, before/after issue 40 (the script's docstring)",
    "command": "python benchmarks/rl_update_memory.py " + " ".join(sys.argv[1:]),
    "tree": tree.stdout.strip() + (" (composer_jax modified)" if dirty.stdout.strip() else ""),
    "date": datetime.date.today().isoformat(),
    "machine": f"{os.cpu_count()} cores, {host.host_memory_bytes() / GIB:.1f} GiB",
    "cells": cells,
  }
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
