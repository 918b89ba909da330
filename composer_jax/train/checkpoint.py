"""Orbax checkpoints of the train state plus JSON metadata (data iterator state, config fingerprint),
verified on load, with a fallback to the previous good checkpoint.

Layout: `<dir>/<step>/{state,meta,checksums.process_<k>.json}` through one async `CheckpointManager` that
keeps the newest `keep` steps. Restores go onto the shardings of a freshly created state (an abstract tree
from `ocp.utils.to_shape_dtype_struct`), so a resumed run continues on exactly the layout it trained on.

Safety:
- A step that already exists is never written again.
- Once a save is final, every process writes the size and SHA-256 of the files it owns (process k: its
  `ocdbt.process_k`, process 0: the rest). `restore` checks them first, each process its own files; a
  checkpoint that fails the check on any process or that orbax cannot read is moved to `<dir>/corrupt/`
  (never deleted) by all processes together (verdicts combined, process 0's newest step restored by all)
  and the next older one is used, with one line saying so. No readable checkpoint left →
  `CheckpointError`, never a silent fresh start.
- A save that fails (a full disk, a permission change) raises `CheckpointSaveError` — an async one at the
  first `check()` after it ended, or at `wait`/`close` — once every writer of that save has stopped and
  its temporary directory is removed; the message lists the checkpoints on disk, which are kept (a
  failed save never deletes the older ones it was to replace).
- A temporary directory that a crash (SIGKILL, power loss) left is removed, with one line, when the
  directory is next opened.
- An incompatible checkpoint (another model, optimizer or data config) raises, naming each field.

Multi-process: every process calls `save` and `restore`, so the directory must be storage that every
process sees (GCS, a shared file system).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import pathlib
import shutil
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from composer_jax.strict import fingerprint
from composer_jax.train.state import TrainState

_TMP_MARK = ".orbax-checkpoint-tmp"
_WRITERS_TIMEOUT_S = 600  # how long a failed save's last writers may take to stop before its files go


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used: incompatible config, or none readable."""


class CheckpointSaveError(RuntimeError):
  """A save that failed; the run stops (what was saved before stays good)."""


def _differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
  if isinstance(saved, dict) and isinstance(current, dict):
    out = []
    for k in sorted(set(saved) | set(current)):
      out += _differences(saved.get(k, "<absent>"), current.get(k, "<absent>"), f"{prefix}{k}.")
    return out
  return [] if saved == current else [f"{prefix[:-1]}: checkpoint {saved!r}, now {current!r}"]


def _owned_files(step_dir: pathlib.Path, process: int) -> list[pathlib.Path]:
  """The files of a step's items (`state/`, `meta/`) one process wrote (and so checksums). Files at the
  step's top level are orbax's own bookkeeping, rewritten when the save commits: not checked."""
  out = []
  for p in sorted(step_dir.rglob("*")):
    if not p.is_file() or p.parent == step_dir or p.name == "commit_success.txt":
      continue
    owner = next((int(part.rsplit("_", 1)[1]) for part in p.parts if part.startswith("ocdbt.process_")), 0)
    if owner == process:
      out.append(p)
  return out


def _digest(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def write_checksums(step_dir: pathlib.Path, process: int) -> None:
  """`checksums.process_<k>.json`: {relative path: [size, sha256]} of the files process k owns."""
  files = {
    str(p.relative_to(step_dir)): [p.stat().st_size, _digest(p)] for p in _owned_files(step_dir, process)
  }
  tmp = step_dir / f".checksums.process_{process}.json.tmp"
  tmp.write_text(json.dumps(files, sort_keys=True))
  tmp.rename(step_dir / f"checksums.process_{process}.json")


def verify_checksums(step_dir: pathlib.Path, process: int = 0, processes: int = 1) -> str | None:
  """None if every file listed in the manifests this process checks has its recorded size and hash, else
  what is wrong (one line). Process i of n checks the manifests of writers k with k mod n == i (on the
  same process count: its own files), so no host reads every host's files. A step without any checksum
  file (written before checksums existed) passes unverified."""
  for manifest in sorted(step_dir.glob("checksums.process_*.json")):
    if int(manifest.stem.rsplit("_", 1)[1]) % processes != process:
      continue
    for rel, (size, digest) in json.loads(manifest.read_text()).items():
      p = step_dir / rel
      if not p.is_file():
        return f"{rel} is missing"
      if p.stat().st_size != size:
        return f"{rel} has {p.stat().st_size} bytes, {size} were written"
      if _digest(p) != digest:
        return f"{rel} does not match its checksum"
  return None


class Checkpointer:
  """Save/restore of (TrainState, data state) under one directory; `record` is what must match."""

  def __init__(
    self,
    directory: str | pathlib.Path,
    record: dict,
    *,
    keep: int = 2,
    async_save: bool = True,
    notes: dict | None = None,
  ):
    """`record`: what a restore must match; `notes`: kept with each save, never compared (e.g. the lr
    schedule's horizon, which an extended run re-derives)."""
    self.directory = pathlib.Path(directory).absolute()
    self.record, self.fingerprint, self.notes = record, fingerprint(record), dict(notes or {})
    self._keep, self._async = keep, async_save
    self._pending = False  # a save started whose outcome `check` has not seen yet
    self._writers: list[threading.Thread] = []  # the threads of the last save
    self._manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    self._remove_stale_partial_saves()
    options = ocp.CheckpointManagerOptions(
      max_to_keep=self._keep,
      enable_async_checkpointing=self._async,
      create=True,
      cleanup_tmp_directories=True,  # (finds none of ours: see `_remove_stale_partial_saves`)
      async_options=ocp.AsyncOptions(post_finalization_callback=self._checksum_new_steps)
      if self._async
      else None,
    )
    return ocp.CheckpointManager(self.directory, options=options)

  def _checksum_new_steps(self) -> None:
    """Checksums of this process's files for every step directory that has none yet. Orbax calls this
    once a save's files are complete, before it renames `<step>.orbax-checkpoint-tmp-*` to `<step>`, so
    the manifest moves with the directory; `wait` calls it too (synchronous saves)."""
    k = jax.process_index()
    for d in self.directory.iterdir():
      step = d.name.split(_TMP_MARK)[0]
      if step.isdigit() and d.is_dir() and not (d / f"checksums.process_{k}.json").exists():
        write_checksums(d, k)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def check(self) -> None:
    """Raises CheckpointSaveError if the last async save failed. A save still in flight is not waited
    for: its failure is raised by the first call after it ended (or by `wait`, `save`, `close`). Cheap:
    call it every step.

    Never orbax's `check_for_errors()`: it hands a failed save's error to whichever thread asks first,
    and when this one asked first, orbax's finalize thread saw no error and finished the save as if it
    had succeeded (deleting the older checkpoints it was to replace) while this one cleaned up."""
    if self._pending and not self._manager.is_saving_in_progress():
      self._settle()

  def _settle(self) -> None:
    """Waits for the save in flight, if any; one that failed raises CheckpointSaveError."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      self._failed(e)
    self._pending, self._writers = False, []

  def _remove_partial_saves(self) -> None:
    """Deletes `<step>.orbax-checkpoint-tmp*` directories: only call it when no save is in flight."""
    for tmp in self.directory.glob(f"*{_TMP_MARK}*"):
      shutil.rmtree(tmp, ignore_errors=True)

  def _remove_stale_partial_saves(self) -> None:
    """What a save cut short by a crash (SIGKILL, power loss) left: removed by process 0, with one line,
    before the manager opens (no save of this directory is in flight then, and every process's first
    save starts behind a barrier that process 0 reaches only after this)."""
    if jax.process_index() != 0 or not self.directory.is_dir():
      return
    stale = sorted(self.directory.glob(f"*{_TMP_MARK}*"))
    if not stale:
      return
    for tmp in stale:
      shutil.rmtree(tmp, ignore_errors=True)
    logging.warning(
      "[checkpoint] removed %s under %s: the partial checkpoint(s) of a save that did not finish (a crash?)",
      ", ".join(p.name for p in stale),
      self.directory,
    )

  def _stop_writers(self) -> None:
    """Waits until every thread of the last save has ended. Orbax reports a save's first failed writer
    at once while its others go on writing, and tensorstore recreates the directories it writes into: a
    temporary directory removed before they end comes back."""
    deadline = time.monotonic() + _WRITERS_TIMEOUT_S
    for t in self._writers:  # Thread.join itself: orbax's subclasses re-raise (and use up) the error
      threading.Thread.join(t, max(0.0, deadline - time.monotonic()))
    if running := [t.name for t in self._writers if t.is_alive()]:
      logging.warning("[checkpoint] writers of the failed save still running: %s", ", ".join(running))
    self._writers = []

  def _failed(self, e: BaseException) -> None:
    self._pending = False
    self._stop_writers()
    self._remove_partial_saves()
    with contextlib.suppress(Exception):  # the steps on disk, not orbax's list (it dropped the ones
      self._manager.reload()  # the failed save was to replace, which a failed save never removes)
    reason = _root_reason(e)
    raise CheckpointSaveError(
      f"saving a checkpoint under {self.directory} failed ({reason}); the run stopped. Steps saved "
      f"before are kept: {self.all_steps() or 'none'}; free space (or fix the directory) and rerun to resume."
    ) from e

  def save(self, state: TrainState, data_state: dict, *, force: bool = False) -> bool:
    """Starts an async save of `state` at its step; False (nothing written) if that step exists."""
    self.check()
    step = int(state.step)
    if step in self._manager.all_steps():
      return False
    meta = {"step": step, "data_state": data_state, "fingerprint": self.fingerprint, "config": self.record}
    meta["notes"] = self.notes
    # One save in flight at a time: the next waits for the last to commit. Two would need the disk and
    # host memory of both, and on a nearly full disk the older one could lose its room to the newer.
    self._settle()
    before = set(threading.enumerate())
    try:
      saved = self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=force,
      )
    except Exception as e:  # its writers that had started may still be running: `_failed` waits for them
      self._writers = _save_threads(before)
      self._failed(e)
    self._writers, self._pending = _save_threads(before), saved
    if not self._async and saved:
      self.wait()
    return saved

  def read_meta(self, step: int) -> dict:
    try:
      return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises several types for missing/corrupt files
      raise CheckpointError(
        f"checkpoint {self.directory}/{step} has unreadable metadata ({type(e).__name__})"
      ) from e

  def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
    """(state, data_state) of `step`, or of the newest good checkpoint, placed like `template`.

    Without `step`, a checkpoint that fails its checksums or cannot be read is set aside and the next
    older one is tried. Raises CheckpointError when the config differs from this run's (naming each
    differing field) or when no checkpoint is readable.
    """
    if step is not None:
      return self._restore_step(template, step)
    set_aside = []
    while (latest := _agreed_step(self.latest_step())) is not None:
      try:
        return self._restore_step(template, latest)
      except _Unreadable as e:
        set_aside.append(self._set_aside(latest, str(e)))
    raise CheckpointError(
      f"no readable checkpoint under {self.directory} (set aside: {', '.join(set_aside) or 'none'})"
    )

  def _restore_step(self, template: TrainState, step: int) -> tuple[TrainState, dict]:
    problem = verify_checksums(self.directory / str(step), jax.process_index(), jax.process_count())
    try:  # by every process whatever its verdict: orbax's multi-process reads synchronise the processes
      meta = self.read_meta(step)
    except CheckpointError:
      problem, meta = problem or "unreadable metadata", {}
    problem = _combined(problem)  # every process sets the step aside, or none
    if problem:
      raise _Unreadable(problem)
    if meta.get("fingerprint") != self.fingerprint:
      diffs = _differences(meta.get("config", {}), self.record)
      raise CheckpointError(
        f"checkpoint {self.directory}/{step} was written by another config: "
        + "; ".join(diffs or ["(fingerprints differ)"])
        + ". Use a new --workdir, or restore the checkpoint's settings."
      )
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    try:
      restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
      )
    except Exception as e:
      raise _Unreadable(f"orbax could not read it: {type(e).__name__}") from e
    return restored["state"], meta["data_state"]

  def _set_aside(self, step: int, why: str) -> str:
    """Moves a bad step to `<dir>/corrupt/<step>-<time>` (process 0) and reopens the manager."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    dest = self.directory / "corrupt" / f"{step}-{stamp}"
    if jax.process_index() == 0:
      dest.parent.mkdir(parents=True, exist_ok=True)
      shutil.move(str(self.directory / str(step)), str(dest))
    if jax.process_count() > 1:  # no process lists the steps again before the move
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
    logging.warning(
      "[checkpoint] %s/%d is unusable (%s): moved to %s; trying the previous one",
      self.directory,
      step,
      why,
      dest,
    )
    self._manager.close()
    self._manager = self._open()
    return f"{step} ({why})"

  def wait(self) -> None:
    """Waits for pending saves; one that failed (e.g. the final save on a full disk) raises
    CheckpointSaveError, like a failure that `check` finds."""
    self._settle()
    try:
      self._checksum_new_steps()
    except Exception as e:
      self._failed(e)

  def close(self) -> None:
    """Waits for pending saves and closes; a failed save is reported (raised) as CheckpointSaveError.
    Closing the manager re-raises a failed save's error: ignored then, the first report stands."""
    try:
      self.wait()
    except BaseException:
      with contextlib.suppress(Exception):
        self._manager.close()
      raise
    else:
      self._manager.close()
    finally:
      self._remove_partial_saves()  # nothing is in flight now: a tmp directory left is a failed save's


def _save_threads(before: set[threading.Thread]) -> list[threading.Thread]:
  """The threads a save started (those alive now that were not in `before`) that write its files: its
  commit futures and its finalize thread (orbax's own thread classes) and the `async_save` thread that
  waits for them; not the thread pools orbax starts once and keeps (metadata_store_*, asyncio_*)."""
  return [
    t
    for t in threading.enumerate()
    if t not in before and (type(t).__module__.startswith("orbax.") or t.name == "async_save")
  ]


def _root_reason(e: BaseException) -> str:
  """What a user can act on in a chain of wrapped exceptions (orbax wraps tensorstore's): a known OS
  condition named anywhere in the chain, else the first OS error's text, else the last line of the
  outermost message."""
  chain, cause = [], e
  while cause is not None and all(cause is not c for c in chain):
    chain.append(cause)
    cause = cause.__cause__ or cause.__context__
  text = " ".join(str(c) for c in chain)
  for marker in (
    "No space left on device",
    "Disk quota exceeded",
    "File too large",
    "Read-only file system",
    "Permission denied",
  ):
    if marker in text or any(isinstance(c, OSError) and c.strerror == marker for c in chain):
      return marker
  for c in chain:
    if isinstance(c, OSError) and c.strerror:
      return c.strerror
  outer = str(e).strip()
  return outer.splitlines()[-1][:200] if outer else type(e).__name__


def _combined(problem: str | None) -> str | None:
  """On several processes: this process's problem, or which others found one (an all-gather of the
  verdicts, so all agree); on one, `problem` itself."""
  if jax.process_count() == 1:
    return problem
  from jax.experimental import multihost_utils

  bad = multihost_utils.process_allgather(np.int32(problem is not None))
  if not bad.any():
    return None
  return problem or f"process(es) {', '.join(map(str, np.flatnonzero(bad)))} found it unusable"


def _agreed_step(step: int | None) -> int | None:
  """Process 0's newest step on every process (each lists the shared directory on its own)."""
  if jax.process_count() == 1:
    return step
  from jax.experimental import multihost_utils

  agreed = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if step is None else step)))
  return None if agreed < 0 else agreed


class _Unreadable(Exception):
  """A checkpoint that failed its checksums or could not be read (internal: triggers the fallback)."""
