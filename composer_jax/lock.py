"""One run per workdir: `<workdir>/.lock` names the run that holds it (pid, host, process start time).

  with lock.hold(workdir):     # raises WorkdirBusy naming the holder's pid and host
    ...

A second run on the same workdir would move the first's in-progress checkpoints aside and rewrite its
metrics; it stops at once instead. A lock left by a process that is gone (killed, crashed) on this host is
taken over with one line saying so; the start time tells a dead holder from a new process that reuses its
pid. On another host liveness cannot be checked: the message says how to remove the lock. In a
multi-process run process 0 holds the lock for all (the others share its workdir).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import time
from collections.abc import Iterator

import numpy as np
from absl import logging

from composer_jax.strict import ConfigError

NAME = ".lock"


class WorkdirBusy(ConfigError):
  """Another live run holds the workdir."""


def _start_time(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (Linux /proc), None where unknown."""
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  return stat.rsplit(")", 1)[1].split()[19]  # field 22 of stat; the name before ")" may hold spaces


def _alive(holder: dict) -> bool:
  """Whether the process a lock names still runs (only decidable on this host: else assumed alive)."""
  if holder.get("host") != socket.gethostname():
    return True
  pid = int(holder.get("pid", -1))
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process: it exists
    pass
  started = holder.get("start")
  return started is None or _start_time(pid) in (None, started)


def _me() -> dict:
  pid = os.getpid()
  return dict(pid=pid, host=socket.gethostname(), start=_start_time(pid), since=time.time())


def _create(path: pathlib.Path, me: dict) -> bool:
  """Writes the lock if there is none, else False (O_EXCL: of two runs starting at once, one wins)."""
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w") as f:
    json.dump(me, f)
  return True


def _read(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):  # half-written by a run that died at that moment, or removed meanwhile
    return {}


def acquire(workdir: str) -> dict:
  """Takes the workdir's lock (see the module docstring); returns what it wrote."""
  path, me = pathlib.Path(workdir, NAME), _me()
  for _ in range(3):  # a stale lock removed by another run taking it over at the same moment: try again
    if _create(path, me):
      return me
    holder = _read(path)
    if holder and _alive(holder):
      raise WorkdirBusy(
        f"--workdir {workdir} is in use by pid {holder.get('pid')} on host {holder.get('host')} (since "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('since', 0)))}); wait for it to "
        f"end, use another --workdir, or delete {path} if that run is gone"
      )
    logging.warning(
      "[run] %s: taking over the lock of pid %s on host %s, which is no longer running",
      workdir, holder.get("pid", "?"), holder.get("host", "?"),
    )  # fmt: skip
    with contextlib.suppress(FileNotFoundError):
      path.unlink()
  raise WorkdirBusy(f"--workdir {workdir}: could not take {path} (other runs keep taking it)")


def release(workdir: str, mine: dict) -> None:
  """Removes the lock if it is still this process's."""
  path = pathlib.Path(workdir, NAME)
  if _read(path).get("pid") == mine["pid"] and _read(path).get("host") == mine["host"]:
    with contextlib.suppress(FileNotFoundError):
      path.unlink()


def _agreed(busy: WorkdirBusy | None) -> None:
  """Raises on every process when process 0 could not take the lock (the others would otherwise go on
  into the first stage's collectives and wait there for it)."""
  import jax

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    if multihost_utils.broadcast_one_to_all(np.int32(busy is not None)) and busy is None:
      busy = WorkdirBusy("process 0 could not take the workdir's lock: another run holds it (see its line)")
  if busy is not None:
    raise busy


@contextlib.contextmanager
def hold(workdir: str, primary: bool = True) -> Iterator[None]:
  """The workdir's lock for the duration (taken by the primary process; all raise if it could not)."""
  mine, busy = None, None
  if primary:
    try:
      mine = acquire(workdir)
    except WorkdirBusy as e:
      busy = e
  _agreed(busy)
  try:
    yield
  finally:
    if mine is not None:
      release(workdir, mine)
