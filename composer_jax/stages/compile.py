"""Stage `compile`: the real train (or RL) step compiled ahead of time for an accelerator topology, its
memory, FLOPs and collectives judged by the compiler itself (`composer_jax/plan/compile.py`)."""

from __future__ import annotations

from typing import Any

from composer_jax.configs import Config
from composer_jax.stages.record import Stage


def run(config: Config, workdir: str) -> dict[str, Any]:
  from composer_jax.plan import compile as compile_lib  # libtpu: imported only by this stage

  return compile_lib.run(config, workdir)


def _check(config: Config) -> None:
  from composer_jax.configs import ConfigError, check_meshes

  check_meshes(config)
  from composer_jax.plan.compile import STEPS  # noqa: PLC0415

  if config.compile.step not in STEPS:
    raise ConfigError(f"compile.step {config.compile.step!r}: use one of {', '.join(STEPS)}")


def _summarize(s: dict, w: Any) -> dict:
  keys = ("step", "topology", "devices", "compile_seconds", "fits", "flops_per_device", "error")
  est, mem = s.get("estimate") or {}, s["memory"]
  return {k: s.get(k) for k in keys} | {
    # XLA refused a program too big for the chip: its temporaries are all that is known
    "peak_gib": (mem["peak"] if "peak" in mem else mem.get("temp") or 0) / 2**30,
    "file": str(w / "compile.json"),
    "step_seconds_estimate": est.get("step_seconds"),
    "mfu_estimate": est.get("mfu"),
    "muon_seconds_estimate": est.get("muon_seconds"),
  }


def _lines(r: dict) -> list[str]:
  fits = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[r["fits"]]
  if r.get("error"):
    return [
      f"  {r['topology']} ({r['devices']} devices): XLA refused the {r.get('step') or 'train'} step, "
      f"temporaries {r['peak_gib']:.2f} GiB per device; {r['file']}"
    ]
  return [
    f"  {r['topology']} ({r['devices']} devices): compiled in {r['compile_seconds']:.0f} s, peak "
    f"{r['peak_gib']:.2f} GiB per device, {fits}; {r['file']}"
  ] + _estimate_line(r)


def _estimate_line(r: dict) -> list[str]:
  if r.get("step_seconds_estimate") is None:
    return []
  mfu = r.get("mfu_estimate")
  return [
    f"  estimated step {r['step_seconds_estimate'] * 1e3:.1f} ms (XLA cost model, loops x trip counts), "
    f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}, Muon update {r['muon_seconds_estimate'] * 1e3:.1f} ms"
  ]


STAGE = Stage(
  name="compile",
  run=run,
  doc="compile the real step for an accelerator topology (XLA:TPU on a CPU host) and check it fits",
  depends=("model", "mesh", "train", "optim", "compile", "rl"),
  outputs=("compile.json",),
  check=_check,
  summarize=_summarize,
  lines=_lines,
  always_run=True,
)
