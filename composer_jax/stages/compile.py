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
  if config.compile.step not in ("train", "rl"):
    raise ConfigError(f"compile.step {config.compile.step!r}: use 'train' or 'rl'")


def _summarize(s: dict, w: Any) -> dict:
  keys = ("topology", "devices", "compile_seconds", "fits", "flops_per_device")
  return {k: s.get(k) for k in keys} | {
    "peak_gib": s["memory"]["peak"] / 2**30,
    "file": str(w / "compile.json"),
  }


def _lines(r: dict) -> list[str]:
  fits = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[r["fits"]]
  return [
    f"  {r['topology']} ({r['devices']} devices): compiled in {r['compile_seconds']:.0f} s, peak "
    f"{r['peak_gib']:.2f} GiB per device, {fits}; {r['file']}"
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
