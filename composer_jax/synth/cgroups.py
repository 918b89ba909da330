"""Whole-tree limits for one sandboxed run: a cgroup (v2, else v1) with CPU-time, memory and process caps.

Why: rlimits are per process. Eight children under `RLIMIT_CPU=12` may burn eight times 12 CPU-seconds,
and `RLIMIT_AS` bounds each process, not their sum. A cgroup counts the whole tree: `pids.max` caps the
number of tasks, the memory limit caps resident memory (tmpfs pages included), and the CPU usage counter
(polled by the sandbox, which kills the group past the budget) caps CPU-seconds of all processes together.

Where no cgroup can be made (`backend()` says why, in one line: no cgroup2 with the memory/pids
controllers delegated, no writable v1 hierarchies, not root ...) the sandbox falls back to what still
bounds a tree: per-process rlimits, the process limit of the throw-away uid (`RLIMIT_NPROC`, effective
as root, where every run has its own uid), the PID namespace killed with its init (`--die-with-parent`,
wall-clock SIGKILL), and `ProcTree`: the tree's CPU time and resident memory polled from /proc, the tree
killed past either budget.
"""

import dataclasses
import functools
import itertools
import os
import pathlib
import signal
import time

_counter = itertools.count()
_V1_CONTROLLERS = ("pids", "memory", "cpuacct")
# CPUs a sandboxed tree may use at once (cgroup v2 cpu.max, v1 CFS quota): without it a busy loop in two
# processes burns twice its wall time, and a run's CPU budget (cpu_s) is spent at twice the rate.
CPU_QUOTA = 1.0
_PERIOD_US = 100_000


@dataclasses.dataclass(frozen=True)
class Backend:
  kind: str  # "v2" | "v1" | "none"
  dirs: tuple[tuple[str, str], ...]  # (controller, parent dir) pairs; v2: one ("", dir)
  note: str  # one line: what bounds the tree here


def _mounts() -> list[tuple[str, str, str]]:
  """(mount point, fs type, super options) from /proc/self/mountinfo."""
  out = []
  try:
    lines = pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
  except OSError:
    return out
  for line in lines:
    left, _, right = line.partition(" - ")
    fields, rest = left.split(), right.split()
    if len(fields) >= 5 and len(rest) >= 3:
      out.append((fields[4].replace("\\040", " "), rest[0], rest[2]))
  return out


def _own_paths() -> dict[str, str]:
  """controller -> this process's cgroup path ("" for the v2 hierarchy)."""
  out = {}
  try:
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
      _, ctrls, path = line.split(":", 2)
      for c in ctrls.split(",") if ctrls else [""]:
        out[c] = path
  except (OSError, ValueError):
    pass
  return out


def _probe(parent: str) -> str:
  """'' if a child group can be made (and removed) under `parent`, else why not."""
  probe = os.path.join(parent, f"composer-probe-{os.getpid()}-{next(_counter)}")
  try:
    os.mkdir(probe)
    os.rmdir(probe)
    return ""
  except OSError as err:
    return f"{parent}: {err.strerror}"


def _v2(mounts, own) -> tuple[Backend | None, str]:
  root = next((m for m, fs, _ in mounts if fs == "cgroup2"), None)
  if root is None or "" not in own:
    return None, "no cgroup2 mount"
  parent = os.path.normpath(root + own[""])
  try:
    have = pathlib.Path(parent, "cgroup.controllers").read_text().split()
    enabled = pathlib.Path(parent, "cgroup.subtree_control").read_text().split()
  except OSError as err:
    return None, f"cgroup2 at {parent} unreadable ({err.strerror})"
  missing = [c for c in ("memory", "pids", "cpu") if c not in have]
  if missing:
    return None, f"cgroup2 without the {'/'.join(missing)} controller(s) delegated"
  if any(c not in enabled for c in ("memory", "pids", "cpu")):
    try:
      pathlib.Path(parent, "cgroup.subtree_control").write_text("+memory +pids +cpu")
    except OSError as err:
      return None, f"cgroup2 controllers not enabled for children ({err.strerror})"
  why = _probe(parent)
  return (
    (None, why)
    if why
    else (Backend("v2", (("", parent),), f"cgroup v2 (cpu quota {CPU_QUOTA:g} CPU, memory, pids)"), "")
  )


def _v1_dir(mounts, own, ctrl: str) -> tuple[str, str]:
  """(writable parent dir of `ctrl`, "") or ("", why not)."""
  mount = next((m for m, fs, opts in mounts if fs == "cgroup" and ctrl in opts.split(",")), None)
  if mount is None or ctrl not in own:
    return "", f"no cgroup v1 {ctrl} hierarchy"
  parent = os.path.normpath(mount + own[ctrl])
  why = _probe(parent)
  return ("", f"cgroup v1 {ctrl} not writable ({why})") if why else (parent, "")


def _v1(mounts, own) -> tuple[Backend | None, str]:
  dirs = []
  for ctrl in _V1_CONTROLLERS:
    parent, why = _v1_dir(mounts, own, ctrl)
    if why:
      return None, why
    dirs.append((ctrl, parent))
  parent, why = _v1_dir(mounts, own, "cpu")  # CFS quota: optional (without it, stated)
  if why:
    return Backend("v1", tuple(dirs), f"cgroup v1 (cpuacct, memory, pids; no CPU quota: {why})"), ""
  dirs.append(("cpu", parent))
  return Backend("v1", tuple(dirs), f"cgroup v1 (cpuacct, memory, pids, cpu quota {CPU_QUOTA:g} CPU)"), ""


@functools.cache
def backend() -> Backend:
  """The best cgroup backend this process can use (decided once per process)."""
  if os.environ.get("COMPOSER_SANDBOX_CGROUP") == "off":
    return Backend("none", (), "no cgroup (COMPOSER_SANDBOX_CGROUP=off): " + FALLBACK)
  mounts, own = _mounts(), _own_paths()
  reasons = []
  for make in (_v2, _v1):
    found, why = make(mounts, own)
    if found is not None:
      return found
    reasons.append(why)
  return Backend("none", (), f"no cgroup ({'; '.join(reasons)}): {FALLBACK}")


FALLBACK = (
  "per-process rlimits, RLIMIT_NPROC of a throw-away uid (as root), wall-clock kill of the PID namespace, "
  "tree CPU and resident memory polled from /proc"
)


class Group:
  """One run's cgroup: limits set on creation, the process attached before it execs anything."""

  def __init__(self, b: Backend, *, memory_bytes: int, max_procs: int):
    self.backend = b
    name = f"composer-sandbox-{os.getpid()}-{next(_counter)}"
    self.dirs = {ctrl: os.path.join(parent, name) for ctrl, parent in b.dirs}
    for d in self.dirs.values():
      os.mkdir(d)
    try:
      if b.kind == "v2":
        self._write("", "pids.max", max_procs)
        self._write("", "memory.max", memory_bytes)
        self._write("", "memory.swap.max", 0, optional=True)
        self._write("", "cpu.max", f"{int(CPU_QUOTA * _PERIOD_US)} {_PERIOD_US}")
      else:
        self._write("pids", "pids.max", max_procs)
        self._write("memory", "memory.limit_in_bytes", memory_bytes)
        self._write("memory", "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
        if "cpu" in self.dirs:
          self._write("cpu", "cpu.cfs_period_us", _PERIOD_US)
          self._write("cpu", "cpu.cfs_quota_us", int(CPU_QUOTA * _PERIOD_US))
    except OSError:
      self.close()
      raise

  def _path(self, ctrl: str, name: str) -> str:
    return os.path.join(self.dirs["" if self.backend.kind == "v2" else ctrl], name)

  def _write(self, ctrl: str, name: str, value, optional: bool = False) -> None:
    try:
      with open(self._path(ctrl, name), "w") as f:
        f.write(str(value))
    except OSError:
      if not optional:
        raise

  def _read(self, ctrl: str, name: str) -> str:
    try:
      with open(self._path(ctrl, name)) as f:
        return f.read()
    except OSError:
      return ""

  def add(self, pid: int) -> None:
    for d in self.dirs.values():
      with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write(str(pid))

  def cpu_seconds(self) -> float:
    if self.backend.kind == "v2":
      for line in self._read("", "cpu.stat").splitlines():
        if line.startswith("usage_usec "):
          return int(line.split()[1]) / 1e6
      return 0.0
    text = self._read("cpuacct", "cpuacct.usage").strip()
    return int(text) / 1e9 if text.isdigit() else 0.0

  def hit(self) -> str:
    """'memory' or 'pids' when that limit was reached during the run, else ''."""
    kv = "memory.events" if self.backend.kind == "v2" else "memory.oom_control"
    if _count(self._read("memory", kv), "oom_kill"):
      return "memory"
    if _count(self._read("pids", "pids.events"), "max"):
      return "pids"
    return ""

  def kill(self) -> None:
    """SIGKILL every process in the group (v2: cgroup.kill; v1: until cgroup.procs is empty)."""
    if self.backend.kind == "v2" and os.path.exists(self._path("", "cgroup.kill")):
      self._write("", "cgroup.kill", 1, optional=True)
      return
    for _ in range(100):
      pids = [int(p) for p in self._read("pids", "cgroup.procs").split()]
      if not pids:
        return
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      time.sleep(0.005)

  def close(self) -> None:
    self.kill()
    for d in self.dirs.values():
      for _ in range(200):  # the kernel removes exiting tasks asynchronously
        try:
          os.rmdir(d)
          break
        except FileNotFoundError:
          break
        except OSError:
          time.sleep(0.005)


def _count(text: str, key: str) -> int:
  for line in text.splitlines():
    parts = line.split()
    if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
      return int(parts[1])
  return 0


class ProcTree:
  """The fallback meter without a cgroup: CPU and resident memory of `root`'s live descendants.

  Each live process counts its own CPU plus that of the children it reaped (`cutime`/`cstime`), so a
  finished child is counted once, by its reaper. Polled by the sandbox; what forks and exits between two
  polls is seen through its reaper, what is still unreaped at a poll is missed until reaped.
  """

  def __init__(self, root: int):
    self.root = root
    self.tick = os.sysconf("SC_CLK_TCK")
    self.page = os.sysconf("SC_PAGE_SIZE")
    self.peak_cpu = 0.0

  def _stats(self) -> list[list[str]]:
    by_parent: dict[int, list[tuple[int, list[str]]]] = {}
    for name in os.listdir("/proc"):
      if not name.isdigit():
        continue
      try:
        with open(f"/proc/{name}/stat") as f:
          fields = f.read().rpartition(")")[2].split()
      except OSError:
        continue
      by_parent.setdefault(int(fields[1]), []).append((int(name), fields))
    out, todo = [], [self.root]
    while todo:
      for pid, fields in by_parent.get(todo.pop(), []):
        out.append(fields)
        todo.append(pid)
    return out

  def sample(self) -> tuple[float, int]:
    """(CPU seconds, resident bytes) of the tree now; CPU never goes down between samples."""
    stats = self._stats()
    cpu = sum(sum(int(x) for x in f[11:15]) for f in stats) / self.tick  # utime stime cutime cstime
    self.peak_cpu = max(self.peak_cpu, cpu)
    return self.peak_cpu, sum(int(f[21]) for f in stats) * self.page
