"""MaxText's ahead-of-time train step compile, saved for `compile_vs_maxtext.py` (run in MaxText's venv).

  <maxtext venv>/bin/python benchmarks/_maxtext_compile.py OUT_DIR key=value ...

MaxText (`maxtext[tpu]`) needs Python >= 3.12 and its own jax/libtpu, so it runs in a separate venv
and process; this file imports nothing from composer_jax. It calls MaxText's own entry point
(`maxtext.trainers.pre_train.train_compile.main` with `configs/base.yml` and the key=value overrides),
keeps the `Compiled` object its `jit_and_compile` returns, and writes into OUT_DIR:
- `maxtext.hlo.txt`: the optimized HLO (`compiled.as_text()`);
- `maxtext.json`: `cost_analysis()`, `memory_analysis()` fields, compile wall and CPU seconds, the
  device kind and count, the overrides and the jax / jaxlib / libtpu / maxtext versions.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import sys
import time


def _versions() -> dict[str, str]:
  out = {}
  for name in ("jax", "jaxlib", "libtpu", "maxtext", "flax", "optax"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = "absent"
  return out


def main() -> None:
  out_dir, overrides = pathlib.Path(sys.argv[1]), sys.argv[2:]
  out_dir.mkdir(parents=True, exist_ok=True)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import maxtext  # noqa: PLC0415  (only in MaxText's venv)
  from maxtext.trainers.pre_train import train_compile  # noqa: PLC0415

  kept: dict = {}
  original = train_compile.jit_and_compile

  def keep(*args, **kwargs):
    t0, cpu0 = time.perf_counter(), time.process_time()
    kept["compiled"] = original(*args, **kwargs)
    kept["seconds"], kept["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - cpu0
    return kept["compiled"]

  train_compile.jit_and_compile = keep
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  train_compile.main([sys.argv[0], base, *overrides])
  compiled = kept["compiled"]
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  mem = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
  devices = _devices(compiled.input_shardings)
  (out_dir / "maxtext.hlo.txt").write_text(compiled.as_text())
  record = {
    "overrides": overrides,
    "versions": _versions(),
    "compile_seconds": kept["seconds"],
    "compile_cpu_seconds": kept["cpu_seconds"],
    "cost_analysis": {k: float(v) for k, v in cost.items() if isinstance(v, int | float)},
    "memory": {k.removesuffix("_size_in_bytes"): int(getattr(mem, k)) for k in fields},
    "device_kind": devices[0].device_kind if devices else None,
    "devices": len(devices),
  }
  (out_dir / "maxtext.json").write_text(json.dumps(record, indent=1))
  print(json.dumps({k: v for k, v in record.items() if k != "cost_analysis"}, indent=1))


def _devices(shardings) -> list:
  """The devices of the first sharded input (all of MaxText's state lies on one mesh)."""
  import jax  # noqa: PLC0415

  leaves = [s for s in jax.tree.leaves(shardings) if hasattr(s, "device_set")]
  return sorted(leaves[0].device_set, key=lambda d: d.id) if leaves else []


if __name__ == "__main__":
  main()
