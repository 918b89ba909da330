"""Metrics: one JSON line per step, and TensorBoard event files when `tensorboardX` is there.

Lines are written through as they come (a killed run keeps every finished step's record). A resumed run
calls `resume_from(step)` first: records of later steps (which the run is about to redo) are dropped from
the JSONL, and TensorBoard is told to purge them (`purge_step`), so each step appears once.

tensorboardX writes event files without TensorFlow (it needs only protobuf); without it we write JSONL
alone. MFU = 6·N_active·tokens/s ÷ peak FLOP/s (PaLM appendix B; attention FLOPs ignored).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax

try:
  from tensorboardX import SummaryWriter
except ImportError:  # optional: JSONL is always written
  SummaryWriter = None


class MetricsWriter:
  """Appends `{"step": s, **metrics}` to `<dir>/metrics.jsonl`, scalars to `<dir>/tb/`.

  Only process 0 of a multi-process run writes (every process logs the same replicated metrics);
  on the others the writer is a no-op, or wherever `enabled=False`.
  """

  def __init__(self, directory: str | pathlib.Path, *, tensorboard: bool = True, enabled: bool | None = None):
    self.directory = pathlib.Path(directory)
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._tensorboard = bool(tensorboard and SummaryWriter)
    self._jsonl, self._tb = None, None
    if self.enabled:
      self.directory.mkdir(parents=True, exist_ok=True)
      self._open()

  @property
  def path(self) -> pathlib.Path:
    return self.directory / "metrics.jsonl"

  @property
  def has_tensorboard(self) -> bool:
    """Whether TensorBoard events are written (by process 0 when this one writes nothing)."""
    return self._tensorboard

  def resume_from(self, step: int) -> None:
    """Drops the records of steps after `step` (a resumed run redoes them) before writing anything."""
    if not self.enabled:
      return
    self.close()
    if self.path.exists():
      kept = [line for line in self.path.read_text().splitlines() if line.strip() and _step(line) <= step]
      tmp = self.path.with_suffix(".jsonl.tmp")
      tmp.write_text("".join(line + "\n" for line in kept))
      tmp.replace(self.path)
    self._open(purge_step=step + 1)

  def _open(self, purge_step: int | None = None) -> None:
    self._jsonl = open(self.path, "a", buffering=1)  # noqa: SIM115 (line-buffered: each line lands at once)
    if self._tensorboard:
      self._tb = SummaryWriter(str(self.directory / "tb"), purge_step=purge_step)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    if self._jsonl is None:
      self._open()
    self._jsonl.write(json.dumps({"step": int(step), **{k: float(v) for k, v in metrics.items()}}) + "\n")
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(k, float(v), int(step))

  def flush(self) -> None:
    if self._jsonl is not None:
      self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self.flush()
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
    self._jsonl, self._tb = None, None


def _step(line: str) -> int:
  try:
    return int(json.loads(line).get("step", -1))
  except (ValueError, AttributeError):
    return 1 << 62  # a torn last line (the process was killed mid-write): dropped on resume


def flops_per_token(n_active_params: int) -> float:
  """Training FLOPs per token: 2 forward + 4 backward per active parameter."""
  return 6.0 * n_active_params


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
  """The records of a metrics file; a torn last line (a kill mid-write) is skipped."""
  out = []
  for line in pathlib.Path(path).read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    out.append(record)
  return out


def read_history(path: str | pathlib.Path, key: str) -> list[dict]:
  """The records of a metrics JSONL that carry `key`, one per step (the newest write wins), in step
  order; [] when there is none."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  by_step = {rec["step"]: rec for rec in read_jsonl(path) if "step" in rec and key in rec}
  return [by_step[s] for s in sorted(by_step)]
