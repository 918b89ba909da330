"""Run untrusted (model-written) code under bubblewrap: no network, read-only system, one task dir.

Why each layer:
- bubblewrap namespaces hide the host FS, env, processes and network (~+4 ms per process start); the
  command line is built in `bwrap.py`. `/tmp` is a size-capped tmpfs, and with `copy_in` so is the task
  dir (the host tree is bound read-only and copied in): a run cannot fill the host disk or leave files
  the grader later reads.
- As root, bwrap keeps every capability unless told otherwise, and `RLIMIT_NPROC` is ignored for uid 0.
  So when the caller is root we skip the user namespace, keep only SETUID/SETGID/SETPCAP, and `setpriv`
  inside drops to a throw-away unprivileged uid with an empty bounding set: CapEff = CapBnd = 0 and the
  process limit bites. A seccomp filter (`seccomp.py`) forbids new namespaces inside, user ones included.
- rlimits are set by `prlimit` (not `preexec_fn`: the RL process runs JAX threads, and `preexec_fn` is
  unsafe with threads). The whole tree is bounded by a cgroup where one can be made (`cgroups.py`: CPU
  seconds, memory, process count; the process joins it before it runs anything), else by the fallback
  stated by `limits_statement()`. The wall-clock limit SIGKILLs the process group; the PID namespace plus
  `--die-with-parent` take every descendant down with bwrap.
- stdout and stderr are pipes read into bounded buffers (nothing is spooled to the host disk). With
  `channel=True` the command also gets the write end of a pipe: the test runner reports results there,
  never through a file the sandboxed code could replace.
- The extra fds (the channel's write end, the `inputs` memfd named "inputs", a gate's read end) are found
  by the command by kind among its fds above 2; no number goes into its environment, which
  `/proc/self/environ` would show for the life of the process (and which would differ between runs).
- Nothing one run does may be read by another: host-wide counters under /proc (open files,
  memory, load, CPU times, locks) are masked (`bwrap.py`), open files are capped per process, a tree
  gets at most `cgroups.CPU_QUOTA` CPUs, and what the command needs (the runner's spec) comes through a
  memfd (`inputs`), not a file in the sandbox.
- There is no fallback to unsandboxed execution: without bwrap, `SandboxUnavailable`.
"""

import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

from composer_jax.synth import cgroups, seccomp
from composer_jax.synth.bwrap import SRC_DIR, bwrap_args, default_env, venv_paths  # noqa: F401 (API)

WORKDIR = "/task"
MAX_OUTPUT_BYTES = 1 << 20
MAX_OPEN_FILES = 512  # per process: enough for pytest, not for a host-wide open-file counter signal
INSTALL_HINT = (
  "bubblewrap (`bwrap`) is required to run untrusted code and was not found on PATH. Install it: "
  "`sudo apt-get install -y bubblewrap` (Debian/Ubuntu; `bash .ci/setup` does this as root), "
  "`dnf install bubblewrap` (Fedora). Refusing to run unsandboxed."
)
# Throw-away uids, one per run drawn at random (a counter would tell a run its place among the others), so
# concurrent runs do not share a process budget.
_UID_BASE, _UID_SPAN = 200_000, 1 << 24
_POLL_S = 0.05


class SandboxUnavailable(RuntimeError):
  """bubblewrap (or prlimit) is missing; the caller must not run the code any other way."""


@dataclasses.dataclass(frozen=True)
class Gate:
  """A run started early and held: the command reads `fd` (the read end of a pipe, found by kind) before
  it runs anything untrusted; the caller writes the other end, then sets `opened`, from which the
  wall-clock limit counts."""

  fd: int  # read end; `run` closes it once the command holds it
  opened: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  returncode: int
  stdout: str
  stderr: str
  timed_out: bool
  wall_s: float
  truncated: bool = False  # stdout or stderr exceeded the cap; the text says where
  cpu_s: float = 0.0  # CPU seconds of the whole tree (cgroup counter, else wait4 of the reaped tree)
  limit: str = ""  # "" | "time" | "cpu" | "memory" | "pids": the tree limit that ended or marked the run
  channel: bytes = b""  # what the command wrote to the result channel (channel=True)
  channel_truncated: bool = False  # the channel passed max_channel_bytes (the rest was dropped)


def available() -> bool:
  """True when bwrap and prlimit are on PATH (tests skip the sandbox checks otherwise)."""
  return shutil.which("bwrap") is not None and shutil.which("prlimit") is not None


def limits_statement() -> str:
  """One line: what bounds a whole process tree on this machine (cgroup v2, v1, or the fallback)."""
  b = cgroups.backend()
  seccomp_note = "" if seccomp.supported() else f"; no seccomp filter for {seccomp.machine()}"
  return f"sandbox tree limits: {b.note}{seccomp_note}"


def _rlimit_args(cpu_s: int, memory_bytes: int, file_bytes: int, max_procs: int) -> list[str]:
  return [f"--cpu={cpu_s}:{cpu_s + 1}", f"--as={memory_bytes}", f"--fsize={file_bytes}"] + [
    f"--nproc={max_procs}",
    f"--nofile={MAX_OPEN_FILES}:{MAX_OPEN_FILES}",
    "--core=0",
  ]


def _chown_tree(root: str, uid: int, gid: int) -> None:
  """lchown only: the sandbox may have planted symlinks pointing out of the task dir."""
  os.lchown(root, uid, gid)
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      os.lchown(os.path.join(dirpath, name), uid, gid)


class _Drain(threading.Thread):
  """Reads a pipe to EOF, keeping the first `limit` bytes and counting the rest."""

  def __init__(self, f, limit: int):
    super().__init__(daemon=True)
    self.f, self.limit, self.parts, self.kept, self.total = f, limit, [], 0, 0
    self.start()

  def run(self) -> None:
    try:
      while chunk := os.read(self.f.fileno(), 1 << 16):
        self.total += len(chunk)
        if self.kept < self.limit:
          self.parts.append(chunk[: self.limit - self.kept])
          self.kept += len(self.parts[-1])
    except OSError:
      pass
    finally:
      self.f.close()

  def data(self) -> bytes:
    return b"".join(self.parts)

  def text(self) -> tuple[str, bool]:
    out = self.data().decode("utf-8", errors="replace")
    if self.total > self.kept:
      out += f"\n[sandbox: output truncated, {self.total - self.kept} of {self.total} bytes dropped]\n"
      return out, True
    return out, False


@dataclasses.dataclass
class _Watch:
  killed_for: str = ""
  done: bool = False
  event: threading.Event = dataclasses.field(default_factory=threading.Event)


def _watch(proc, group, tree, gate, lim, state: _Watch, lock: threading.Lock) -> None:
  """Kill the tree at the wall-clock deadline or once its CPU seconds (cgroup counter, else `tree`'s
  /proc sample) exceed the budget; without a cgroup also once its resident memory does."""
  deadline = time.monotonic() + lim.timeout_s
  while True:
    if gate is not None and not gate.opened.is_set():  # held at its gate: the clock has not started
      deadline = time.monotonic() + lim.timeout_s
    left = deadline - time.monotonic()
    if state.event.wait(max(0.0, min(_POLL_S, left))):
      return
    why = "time" if time.monotonic() >= deadline else ""
    if not why and group is not None and group.cpu_seconds() > lim.cpu_s:
      why = "cpu"
    if not why and tree is not None:
      cpu, rss = tree.sample()
      why = "cpu" if cpu > lim.cpu_s else "memory" if rss > lim.memory_bytes else ""
    if why:
      with lock:
        if state.done:
          return
        state.killed_for = why
        _kill(proc.pid, group)
        return


def _kill(pgid: int, group) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  if group is not None:
    group.kill()


def run(
  cmd: Sequence[str],
  *,
  task_dir: str | os.PathLike,
  timeout_s: float = 120.0,
  env: Mapping[str, str] | None = None,
  readonly_paths: Sequence[str | os.PathLike] = (),
  cpu_s: int | None = None,
  memory_bytes: int = 4 << 30,
  file_bytes: int = 256 << 20,
  max_procs: int = 256,
  workdir: str = WORKDIR,
  max_output_bytes: int = MAX_OUTPUT_BYTES,
  copy_in: bool = False,
  task_bytes: int = 256 << 20,
  tmp_bytes: int = 256 << 20,
  binds: Mapping[str, str] | None = None,
  channel: bool = False,
  max_channel_bytes: int = 64 << 20,
  tree_limits: bool = True,
  inputs: bytes | None = None,
  gate: Gate | None = None,
) -> SandboxResult:
  """Run `cmd` in the sandbox with `task_dir` at `workdir` (read-write, or copied into a tmpfs).

  `readonly_paths` are bound at their own paths (pass `venv_paths(venv)` so `python -m pytest` works).
  `cpu_s` (CPU seconds for the whole tree; per process without a cgroup) defaults to the wall-clock
  budget. `memory_bytes` caps each process's address space and, with a cgroup, the tree's memory.
  With `gate` the command is started at once but held (see Gate). `inputs` reach the command as a memfd
  named "inputs" (read it, then close it: no path in the sandbox holds them).
  `tree_limits=False` skips the whole-tree meter (cgroup or /proc polling; a v1 cgroup costs tens of ms
  per run in migrations): for fixed commands on the agent's files (`cat`, `find`), never for its code.
  Raises `SandboxUnavailable` when bwrap is missing.
  """
  bwrap_bin, prlimit = shutil.which("bwrap"), shutil.which("prlimit")
  if bwrap_bin is None:
    raise SandboxUnavailable(INSTALL_HINT)
  if prlimit is None:
    raise SandboxUnavailable("`prlimit` (util-linux) is required to set resource limits; install util-linux.")
  task_dir = os.path.realpath(task_dir)
  if not os.path.isdir(task_dir):
    raise FileNotFoundError(task_dir)
  ro = [os.path.realpath(p) for p in readonly_paths]
  cpu_s = int(cpu_s if cpu_s is not None else max(1, int(timeout_s) + 1))
  drop_to_uid, owner = None, None
  if os.geteuid() == 0:
    drop_to_uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
    owner = os.stat(task_dir)  # lent to the throw-away uid for the run (copy_in: so it can read it all)
    _chown_tree(task_dir, drop_to_uid, drop_to_uid)
  spec = _Spec(task_dir, workdir, ro, dict(env or {}), drop_to_uid, binds, copy_in, task_bytes, tmp_bytes)
  limits = _Limits(
    timeout_s, cpu_s, memory_bytes, file_bytes, max_procs, max_output_bytes, max_channel_bytes, tree_limits
  )
  try:
    return _execute(cmd, spec, limits, prlimit, bwrap_bin, channel, inputs, gate)
  finally:
    if owner is not None:
      _chown_tree(task_dir, owner.st_uid, owner.st_gid)


@dataclasses.dataclass(frozen=True)
class _Spec:
  task_dir: str
  workdir: str
  ro: list
  env: dict
  drop_to_uid: int | None
  binds: Mapping[str, str] | None
  copy_in: bool
  task_bytes: int
  tmp_bytes: int


@dataclasses.dataclass(frozen=True)
class _Limits:
  timeout_s: float
  cpu_s: int
  memory_bytes: int
  file_bytes: int
  max_procs: int
  max_output_bytes: int
  max_channel_bytes: int
  tree: bool = True  # meter the whole tree (cgroup, else /proc)


def _argv(cmd, spec: _Spec, lim: _Limits, prlimit: str, bwrap_bin: str, env: dict, seccomp_fd) -> list[str]:
  argv = [prlimit, *_rlimit_args(lim.cpu_s, lim.memory_bytes, lim.file_bytes, lim.max_procs), "--", bwrap_bin]
  argv += bwrap_args(
    task_dir=spec.task_dir,
    workdir=spec.workdir,
    readonly_paths=spec.ro,
    env=default_env(spec.ro, env),
    drop_to_uid=spec.drop_to_uid,
    binds=spec.binds,
    copy_in=spec.copy_in,
    task_bytes=spec.task_bytes,
    tmp_bytes=spec.tmp_bytes,
    seccomp_fd=seccomp_fd,
  )
  if spec.copy_in:
    argv += ["/bin/sh", "-c", f'cp -R {SRC_DIR}/. {spec.workdir}/ && exec "$@"', "sh"]
  return argv + list(cmd)


def _close(*fds) -> None:
  for fd in fds:
    if fd is not None:
      os.close(fd)


def _execute(
  cmd, spec: _Spec, lim: _Limits, prlimit: str, bwrap_bin: str, channel: bool, inputs, gate
) -> SandboxResult:
  """Pipes and seccomp fd, the cgroup gate, Popen, drains, wait; every fd is closed exactly once."""
  seccomp_r = chan_r = chan_w = input_fd = None
  env = dict(spec.env)
  if inputs is not None:
    input_fd = os.memfd_create("inputs", 0)
    os.write(input_fd, inputs)
    os.lseek(input_fd, 0, os.SEEK_SET)
  if seccomp.supported():
    seccomp_r, w = os.pipe()
    os.write(w, seccomp.program())
    os.close(w)
  if channel:
    chan_r, chan_w = os.pipe()
  argv = _argv(cmd, spec, lim, prlimit, bwrap_bin, env, seccomp_r)
  b = cgroups.backend()
  group = (
    cgroups.Group(b, memory_bytes=lim.memory_bytes, max_procs=lim.max_procs) if b.kind != "none" else None
  )
  if group is not None:  # held at a gate until it is in the cgroup: nothing it forks can escape
    argv = ["/bin/sh", "-c", 'read _ ; exec "$@" </dev/null', "sh", *argv]
  start = time.perf_counter()
  try:
    proc = subprocess.Popen(
      argv,
      stdin=subprocess.PIPE if group is not None else subprocess.DEVNULL,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      env={},
      start_new_session=True,
      pass_fds=tuple(fd for fd in (seccomp_r, chan_w, input_fd, gate and gate.fd) if fd is not None),
    )
  except BaseException:
    _close(chan_r)
    if group is not None:
      group.close()
    raise
  finally:
    _close(seccomp_r, chan_w, input_fd, gate and gate.fd)
  drains = [_Drain(proc.stdout, lim.max_output_bytes), _Drain(proc.stderr, lim.max_output_bytes)]
  if chan_r is not None:
    drains.append(_Drain(os.fdopen(chan_r, "rb", buffering=0), lim.max_channel_bytes))
  try:
    state, rusage, tree = _wait(proc, group, lim, gate)
  finally:
    if group is not None:
      group.kill()
  for d in drains:
    d.join(timeout=2.0)
  wall_s = time.perf_counter() - start
  return _result(proc, group, tree, state, rusage, drains, wall_s, lim.cpu_s)


def _result(proc, group, tree, state, rusage, drains, wall_s: float, cpu_s: int) -> SandboxResult:
  tree_cpu, hit = rusage.ru_utime + rusage.ru_stime, ""
  if group is not None:
    tree_cpu = max(tree_cpu, group.cpu_seconds())
    hit = group.hit()
    group.close()
  elif tree is not None:
    tree_cpu = max(tree_cpu, tree.peak_cpu)
  over = tree_cpu > cpu_s or proc.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU)
  limit = state.killed_for or hit or ("cpu" if over else "")
  stdout, t1 = drains[0].text()
  stderr, t2 = drains[1].text()
  channel = drains[2].data() if len(drains) > 2 else b""
  cut = len(drains) > 2 and drains[2].total > drains[2].kept
  timed_out = state.killed_for == "time"
  return SandboxResult(
    proc.returncode, stdout, stderr, timed_out, wall_s, t1 or t2, tree_cpu, limit, channel, cut
  )


def _wait(proc: subprocess.Popen, group, lim: _Limits, gate: Gate | None = None):
  """Release the gate, block until exit, reap with `wait4`; (watch state, rusage, /proc meter or None).

  `Popen.wait(timeout)` polls with sleeps of up to 50 ms, so a watcher thread kills instead.
  `waitid(WNOWAIT)` observes the exit without reaping, so the watcher never signals a recycled group id.
  """
  state, lock = _Watch(), threading.Lock()
  if group is not None:
    try:
      group.add(proc.pid)
      proc.stdin.write(b"\n")
      proc.stdin.close()
    except BaseException:
      _kill(proc.pid, group)
      raise
  tree = cgroups.ProcTree(proc.pid) if group is None and lim.tree else None
  watcher = threading.Thread(target=_watch, args=(proc, group, tree, gate, lim, state, lock), daemon=True)
  watcher.start()
  try:
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
  except BaseException:
    with lock:
      _kill(proc.pid, group)  # interrupted (e.g. KeyboardInterrupt): never leave the sandbox running
    raise
  finally:
    with lock:
      state.done = True
      state.event.set()
  _, status, rusage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  return state, rusage, tree


@dataclasses.dataclass(frozen=True)
class Sandbox:
  """Limits and bindings fixed once (e.g. per task venv); `run` varies only the command."""

  readonly_paths: tuple[str, ...] = ()
  timeout_s: float = 120.0
  cpu_s: int | None = None
  memory_bytes: int = 4 << 30
  file_bytes: int = 256 << 20
  max_procs: int = 256
  env: tuple[tuple[str, str], ...] = ()
  workdir: str = WORKDIR

  def run(self, cmd: Sequence[str], task_dir: str | os.PathLike, **overrides) -> SandboxResult:
    kwargs = dict(
      timeout_s=self.timeout_s,
      env=dict(self.env),
      readonly_paths=self.readonly_paths,
      cpu_s=self.cpu_s,
      memory_bytes=self.memory_bytes,
      file_bytes=self.file_bytes,
      max_procs=self.max_procs,
      workdir=self.workdir,
    )
    kwargs.update(overrides)
    return run(cmd, task_dir=task_dir, **kwargs)
