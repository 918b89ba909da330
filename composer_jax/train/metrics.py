"""Metrics: one JSON line per logged step, and TensorBoard event files when `tensorboardX` is there.

tensorboardX writes event files without TensorFlow (it needs only protobuf); without it we write
JSONL alone. MFU = 6·N_active·tokens/s ÷ peak FLOP/s (PaLM appendix B; attention FLOPs ignored).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

try:
  from tensorboardX import SummaryWriter
except ImportError:  # optional: JSONL is always written
  SummaryWriter = None


class MetricsWriter:
  """Appends `{"step": s, **metrics}` to `<dir>/metrics.jsonl`, scalars to `<dir>/tb/`."""

  def __init__(self, directory: str | pathlib.Path, *, tensorboard: bool = True):
    self.directory = pathlib.Path(directory)
    self.directory.mkdir(parents=True, exist_ok=True)
    self._jsonl = open(self.directory / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
    self._tb = SummaryWriter(str(self.directory / "tb")) if tensorboard and SummaryWriter else None

  @property
  def has_tensorboard(self) -> bool:
    return self._tb is not None

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    self._jsonl.write(json.dumps({"step": int(step), **{k: float(v) for k, v in metrics.items()}}) + "\n")
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(k, float(v), int(step))

  def flush(self) -> None:
    self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self.flush()
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def flops_per_token(n_active_params: int) -> float:
  """Training FLOPs per token: 2 forward + 4 backward per active parameter."""
  return 6.0 * n_active_params


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
