"""Orbax checkpoints of the train state plus JSON metadata (data iterator state, config fingerprint).

Layout: `<dir>/<step>/{state,meta}` through one async `CheckpointManager` that keeps the newest
`keep` steps. Restores go onto the shardings of a freshly created state (an abstract tree from
`ocp.utils.to_shape_dtype_struct`), so a resumed run continues on exactly the layout it trained on.

Safety: a step that already exists is never written again, and an unreadable or incompatible
checkpoint raises (`CheckpointError`) instead of falling back to a fresh start that would later
overwrite it.

Multi-process: every process calls `save` and `restore` (orbax writes and reads each process's own
shards and writes the JSON metadata from process 0 alone), so the directory must be storage that
every process sees (GCS, a shared file system).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from composer_jax.strict import fingerprint
from composer_jax.train.state import TrainState


class CheckpointError(RuntimeError):
  pass


def _differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
  if isinstance(saved, dict) and isinstance(current, dict):
    out = []
    for k in sorted(set(saved) | set(current)):
      out += _differences(saved.get(k, "<absent>"), current.get(k, "<absent>"), f"{prefix}{k}.")
    return out
  return [] if saved == current else [f"{prefix[:-1]}: checkpoint {saved!r}, now {current!r}"]


class Checkpointer:
  """Save/restore of (TrainState, data state) under one directory; `record` is what must match."""

  def __init__(self, directory: str | pathlib.Path, record: dict, *, keep: int = 2, async_save: bool = True):
    self.directory = pathlib.Path(directory).absolute()
    self.record, self.fingerprint = record, fingerprint(record)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save, create=True
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, state: TrainState, data_state: dict, *, force: bool = False) -> bool:
    """Starts an async save of `state` at its step; False (nothing written) if that step exists."""
    step = int(state.step)
    if step in self._manager.all_steps():
      return False
    meta = {
      "step": step,
      "data_state": data_state,
      "fingerprint": self.fingerprint,
      "config": self.record,
    }
    return self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
      force=force,
    )

  def read_meta(self, step: int) -> dict:
    try:
      return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises several types for missing/corrupt files
      raise CheckpointError(
        f"Checkpoint {self.directory}/{step} has unreadable metadata ({type(e).__name__}: {e}). "
        "Move it away to start fresh, or point --workdir elsewhere."
      ) from e

  def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
    """(state, data_state) of `step` (default latest), placed like `template`.

    Raises CheckpointError when the checkpoint's config differs from this run's (naming each
    differing field) or its arrays cannot be read.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"No checkpoint under {self.directory}.")
    meta = self.read_meta(step)
    if meta.get("fingerprint") != self.fingerprint:
      diffs = _differences(meta.get("config", {}), self.record)
      raise CheckpointError(
        f"Checkpoint {self.directory}/{step} was written by an incompatible config:\n  "
        + "\n  ".join(diffs or ["(fingerprints differ)"])
        + "\nUse a new --workdir, or restore the checkpoint's settings."
      )
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    try:
      restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
      )
    except Exception as e:
      raise CheckpointError(
        f"Checkpoint {self.directory}/{step} could not be restored ({type(e).__name__}: {e}). "
        "It may be corrupt or incomplete; move it away to start fresh."
      ) from e
    return restored["state"], meta["data_state"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
