"""Stage `plan`: per-device memory, collective bytes and Newton–Schulz time of the config (`plan`)."""

from __future__ import annotations

from typing import Any

from composer_jax.configs import Config
from composer_jax.stages.record import Stage


def run(config: Config, workdir: str) -> dict[str, Any]:
  from composer_jax import plan  # host arithmetic over abstract shapes

  return plan.run(config, workdir)


STAGE = Stage(
  name="plan",
  run=run,
  doc="per-device memory, collective bytes and Newton–Schulz time of the config for its device count",
  depends=("model", "mesh", "train", "optim", "plan"),
  outputs=("plan.json",),
  always_run=True,
)
