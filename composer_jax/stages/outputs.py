"""A training stage's outputs: its checkpoint directory and its metrics directory, opened and closed
together, so no stage repeats the lifecycle (close both however the fit ends)."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator
from typing import Any, NamedTuple


class Outputs(NamedTuple):
  ckpt: Any  # train.checkpoint.Checkpointer
  writer: Any  # train.metrics.MetricsWriter

  def save(self, state: Any, final: bool) -> None:
    """`fit`'s save hook for stages without a data iterator (the batch of step s is a function of s)."""
    self.ckpt.save(state, {}, force=final)


@contextlib.contextmanager
def opened(ckpt_dir: pathlib.Path, record: dict, keep: int, metrics_dir: pathlib.Path) -> Iterator[Outputs]:
  """A Checkpointer over `ckpt_dir` (refusing checkpoints of another `record`) and a MetricsWriter."""
  from composer_jax.train import checkpoint, metrics  # orbax: imported by the stages that train

  ckpt = checkpoint.Checkpointer(ckpt_dir, record, keep=keep)
  writer = metrics.MetricsWriter(metrics_dir)
  try:
    yield Outputs(ckpt, writer)
  finally:
    ckpt.close()
    writer.close()
