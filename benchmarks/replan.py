"""Put the current planner's prediction into a `compile.json` written by an earlier tree whose compiled
program is the same (only the planner changed since), so that XLA's figures need not be recompiled.

  python benchmarks/replan.py <compile.json> [<out.json>]

The config is rebuilt from the JSON's `variant` and `step` (the shipped variants of
experiments/composer25.py); `plan`, `plan_terms` and `biggest_plan_terms` are replaced and `plan_note`
says so, and `report` is formatted again. XLA's own figures (`memory`, `estimate`, `collectives`) are
left untouched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys

from composer_jax import configs
from composer_jax.plan import core, report, rollout

_EXPERIMENT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "composer25.py"


def _config(variant: str, topology: str, step: str) -> configs.Config:
  spec = importlib.util.spec_from_file_location("composer25", _EXPERIMENT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = configs.from_config(module.get_config(variant))
  return dataclasses.replace(
    config, compile=dataclasses.replace(config.compile, topology=topology, step=step)
  )


def replan(result: dict) -> dict:
  config = _config(result["variant"], result["topology"], result["step"])
  if result["step"] == "train":
    plan = core.make_plan(config, tpu=True)
    new = {"plan": plan.xla, "biggest_plan_terms": report.biggest_terms(plan)}
  else:
    other = {"rl": rollout.rl_step, "decode": rollout.decode_step}[result["step"]](config, tpu=True)
    terms = sorted(other["terms"].items(), key=lambda kv: -kv[1])
    new = {"plan": other["xla"], "plan_terms": other["terms"], "biggest_plan_terms": terms[:3]}
  note = "plan fields recomputed with benchmarks/replan.py after the compile (same compiled program)"
  result = result | new | {"plan_note": note}
  return result | {"report": report.format_compile(result)}


def main() -> None:
  src = pathlib.Path(sys.argv[1])
  dst = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else src
  result = replan(json.loads(src.read_text()))
  dst.write_text(json.dumps(result, indent=1) + "\n")
  mem, plan = result["memory"], result["plan"]
  print(f"{result['variant']} {result['step']}: temp plan/XLA {plan['temp'] / mem['temp']:.3f}")


if __name__ == "__main__":
  main()
