"""A training stage's outputs: its checkpoint directory and its metrics directory, opened and closed
together, so no stage repeats the lifecycle (close both however the fit ends)."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections.abc import Iterator
from typing import Any, NamedTuple


class Outputs(NamedTuple):
  ckpt: Any  # train.checkpoint.Checkpointer
  writer: Any  # train.metrics.MetricsWriter

  def check(self) -> None:
    """The loop's per-step check: raises when an async save failed."""
    self.ckpt.check()

  def save(self, state: Any, final: bool) -> None:
    """`fit`'s save hook for stages without a data iterator (the batch of step s is a function of s)."""
    self.ckpt.save(state, {}, force=final)


@contextlib.contextmanager
def opened(
  ckpt_dir: pathlib.Path, record: dict, keep: int, metrics_dir: pathlib.Path, notes: dict | None = None
) -> Iterator[Outputs]:
  """A Checkpointer over `ckpt_dir` (refusing checkpoints of another `record`; `notes` kept with each
  save) and a MetricsWriter."""
  from composer_jax.train import checkpoint, metrics  # orbax: imported by the stages that train

  ckpt = checkpoint.Checkpointer(ckpt_dir, record, keep=keep, notes=notes)
  writer = metrics.MetricsWriter(metrics_dir)
  try:
    yield Outputs(ckpt, writer)
  finally:
    try:
      ckpt.close()
    finally:
      writer.close()


def start(out: Outputs, name: str, ocfg: Any, abstract: Any, fresh: Any) -> tuple[Any, dict | None]:
  """(state, data state): the newest good checkpoint restored into `abstract` (`train.state.
  abstract_state`: nothing initialised or read, so a resumed run never holds a second copy of the
  state), or (`fresh()`, None) when there is no checkpoint, e.g. an `init_from` checkpoint's weights."""
  if out.ckpt.latest_step() is None:
    return fresh(), None
  return resume(out, abstract, name, ocfg)


def resume(out: Outputs, state: Any, name: str, ocfg: Any) -> tuple[Any, dict | None]:
  """(state, data state) of the newest good checkpoint (an unreadable one is set aside, one line says so),
  or (state, None) when there is none. An extended run (more steps) logs how its schedule changed."""
  from absl import logging

  from composer_jax import optim

  if out.ckpt.latest_step() is None:
    return state, None
  state, data_state = out.ckpt.restore(state)
  step = int(state.step)
  logging.info("[%s] resumed from %s/%d", name, out.ckpt.directory, step)
  old = out.ckpt.read_meta(step).get("notes", {}).get("total_steps")
  if old is not None and old != ocfg.total_steps:
    was = optim.lr_schedule(dataclasses.replace(ocfg, total_steps=old))(step)
    logging.info(
      "[%s] extended: the lr schedule is re-derived over %d steps, not %d (lr at step %d: %.2e -> %.2e)",
      name, ocfg.total_steps, old, step, float(was), float(optim.lr_schedule(ocfg)(step)),
    )  # fmt: skip
  return state, data_state
