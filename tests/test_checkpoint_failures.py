"""A failed save, forced at one moment rather than hoped for: `Checkpointer` keeps exactly the checkpoints
that were complete and leaves no temporary directory, whatever its writers do after the first failure;
a temporary directory that a crash left is removed with one line when the directory is next opened.

The failure is a writer that orbax's JSON handler is given besides its own: it raises ENOSPC at once
(what a full disk does to the first write that needs room); a second injected writer can keep writing
after that failure was reported, as tensorstore's writers of the same save do.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import pathlib
import shutil
import threading
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from orbax.checkpoint import future

from composer_jax.train import checkpoint
from composer_jax.train.state import TrainState

_RECORD = {"what": "test"}


def _state(step: int) -> TrainState:
  return TrainState(
    step=jnp.asarray(step, jnp.int32),
    params={"w": jnp.arange(512.0) + step},
    opt_state={"count": jnp.asarray(step, jnp.int32)},
  )


def _left(directory: pathlib.Path) -> list[str]:
  return sorted(p.name for p in directory.iterdir())


def _partial(directory: pathlib.Path) -> list[str]:
  return [str(p.relative_to(directory)) for p in directory.rglob("*orbax-checkpoint-tmp*")]


async def _full_disk(directory) -> None:
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))


async def _late_writer(directory) -> None:
  """Writes into the failed save's directory once it was removed (or after 5 s), 1 s later, through a
  tensorstore file kvstore, which creates the directories it writes into."""
  directory = pathlib.Path(str(directory))
  deadline = time.monotonic() + 5
  while directory.exists() and time.monotonic() < deadline:
    await asyncio.sleep(0.05)
  if not directory.exists():
    await asyncio.sleep(1)
  kv = await ts.KvStore.open({"driver": "file", "path": f"{directory}/"})
  await kv.write("late", b"written after the save's failure was reported")


def _inject(monkeypatch, *, late_writer: bool = False) -> list:
  """From now on, every save fails with ENOSPC in the background (and, with `late_writer`, has one more
  writer that ends after that); returns the late writers started, to wait for."""
  real = ocp.JsonCheckpointHandler.async_save
  late = []

  async def async_save(self, directory, args):
    ops = [future.CommitFutureAwaitingContractedSignals(_full_disk(directory), name="full_disk")]
    if late_writer:
      late.append(future.CommitFutureAwaitingContractedSignals(_late_writer(directory), name="late_writer"))
      ops.append(late[-1])
    return ops + list(await real(self, directory, args=args) or [])

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", async_save)
  return late


def _saved_4(tmp_path, keep: int) -> checkpoint.Checkpointer:
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", _RECORD, keep=keep)
  assert ckpt.save(_state(4), {"at": 4})
  ckpt.wait()
  return ckpt


def _restores_4(tmp_path) -> None:
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", _RECORD)
  state, data_state = ckpt.restore(_state(0))
  ckpt.close()
  assert int(state.step) == 4 and data_state == {"at": 4}
  np.testing.assert_array_equal(state.params["w"], _state(4).params["w"])


def test_a_failed_save_removes_its_files_only_after_its_last_writer_ended(tmp_path, monkeypatch):
  """Step 4 saved; the save of step 8 fails while another of its writers goes on for seconds and then
  writes into the step's temporary directory (creating it again if it was removed). Only outcome: the
  close raises CheckpointSaveError naming the full disk and step 4, and once that writer has ended, the
  directory holds step 4 and no temporary directory (the cleanup waited for it)."""
  ckpt = _saved_4(tmp_path, keep=2)
  late = _inject(monkeypatch, late_writer=True)
  assert ckpt.save(_state(8), {"at": 8})
  with pytest.raises(checkpoint.CheckpointSaveError, match=r"No space left on device.*kept: \[4\]"):
    ckpt.close()
  for writer in late:
    writer.result(timeout=60)
  assert _partial(tmp_path / "ckpt") == [] and _left(tmp_path / "ckpt") == ["4"]
  _restores_4(tmp_path)


def test_a_check_while_a_failed_save_ends_keeps_the_checkpoint_it_was_to_replace(tmp_path, monkeypatch):
  """keep=1: the save of step 8 would replace step 4. It fails; `check()` (every training step calls it)
  runs after its writers failed but before orbax's finalize thread has looked (that thread is held until
  then). Only outcome: CheckpointSaveError (from `check` or at the latest from `close`) saying step 4 is
  kept, and step 4 on disk, restorable; no temporary directory. Asking orbax for the error from `check`
  took it from the finalize thread, which then went on as if the save had succeeded and deleted step 4."""
  ckpt = _saved_4(tmp_path, keep=1)
  _inject(monkeypatch)
  checked = threading.Event()
  real_wait = ocp.CheckpointManager._wait_for_checkpointers

  def held_until_checked(manager):
    checked.wait(timeout=5)
    return real_wait(manager)

  monkeypatch.setattr(ocp.CheckpointManager, "_wait_for_checkpointers", held_until_checked)
  assert ckpt.save(_state(8), {"at": 8})
  deadline = time.monotonic() + 60  # until the save's writers have failed and its async thread ended
  while any(t.name == "async_save" for t in threading.enumerate()) and time.monotonic() < deadline:
    time.sleep(0.01)
  with pytest.raises(checkpoint.CheckpointSaveError) as failed:
    try:
      ckpt.check()
    finally:
      checked.set()
    ckpt.close()
  assert "kept: [4]" in str(failed.value)
  assert _partial(tmp_path / "ckpt") == [] and _left(tmp_path / "ckpt") == ["4"]
  _restores_4(tmp_path)


def test_a_partial_checkpoint_left_by_a_crash_is_removed_with_one_line(tmp_path, caplog):
  """A save killed mid-write (SIGKILL, power loss) leaves `<step>.orbax-checkpoint-tmp`: the next
  Checkpointer on the directory removes it before anything else, in one warning naming it, then restores
  the last complete step and saves the next one as usual."""
  _saved_4(tmp_path, keep=2).close()
  shutil.copytree(tmp_path / "ckpt" / "4", tmp_path / "ckpt" / "6.orbax-checkpoint-tmp")
  (tmp_path / "ckpt" / "6.orbax-checkpoint-tmp" / "state" / "_METADATA").unlink()  # cut short
  caplog.set_level(logging.WARNING)
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", _RECORD, keep=2)
  lines = [r.getMessage() for r in caplog.records if "orbax-checkpoint-tmp" in r.getMessage()]
  assert len(lines) == 1 and "removed 6.orbax-checkpoint-tmp" in lines[0], caplog.text
  assert _left(tmp_path / "ckpt") == ["4"] and ckpt.all_steps() == [4]
  state, _ = ckpt.restore(_state(0))
  assert int(state.step) == 4
  assert ckpt.save(_state(6), {"at": 6})
  ckpt.close()
  assert _left(tmp_path / "ckpt") == ["4", "6"]
