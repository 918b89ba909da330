"""Run untrusted (model-written) code under bubblewrap: no network, read-only system, one writable dir.

Why each layer (measured facts in notes/synth.md §5):
- bubblewrap namespaces hide the host FS, env, processes and network (~+4 ms per process start).
- As root, bwrap keeps every capability unless told otherwise, and `RLIMIT_NPROC` is ignored for uid 0.
  So when the caller is root we skip the user namespace, keep only SETUID/SETGID/SETPCAP, and `setpriv`
  inside drops to a throw-away unprivileged uid with an empty bounding set: CapEff = CapBnd = 0 and the
  process limit bites. A non-root caller gets `--unshare-all --cap-drop ALL` (its own uid; the process
  limit then counts all of that user's processes).
- rlimits are set by `prlimit` (not `preexec_fn`: the RL process runs JAX threads, and `preexec_fn` is
  unsafe with threads); the wall-clock timeout SIGKILLs the process group, and the PID namespace plus
  `--die-with-parent` take every descendant down with bwrap.
- There is no fallback: without bwrap, `SandboxUnavailable` — never silent unsandboxed execution.
"""

import dataclasses
import itertools
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

WORKDIR = "/task"
MAX_OUTPUT_BYTES = 1 << 20
INSTALL_HINT = (
  "bubblewrap (`bwrap`) is required to run untrusted code and was not found on PATH. Install it: "
  "`sudo apt-get install -y bubblewrap` (Debian/Ubuntu; `bash .ci/setup` does this as root), "
  "`dnf install bubblewrap` (Fedora). Refusing to run unsandboxed."
)
# System paths bound read-only when present; symlinks (merged /usr) are recreated as symlinks.
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Enough of /etc for the dynamic linker, locale/time, name lookup and TLS roots; nothing else.
_ETC_PATHS = (
  "/etc/alternatives",
  "/etc/ld.so.cache",
  "/etc/ld.so.conf",
  "/etc/ld.so.conf.d",
  "/etc/localtime",
  "/etc/nsswitch.conf",
  "/etc/passwd",
  "/etc/group",
  "/etc/ssl",
  "/etc/ca-certificates",
)
_UID_BASE = 200_000  # throw-away uids, one per run, so concurrent runs do not share a process budget
_uid_counter = itertools.count()


class SandboxUnavailable(RuntimeError):
  """bubblewrap (or prlimit) is missing; the caller must not run the code any other way."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  returncode: int
  stdout: str
  stderr: str
  timed_out: bool
  wall_s: float
  truncated: bool = False  # stdout or stderr exceeded MAX_OUTPUT_BYTES; the text says where


def _which(name: str) -> str | None:
  return shutil.which(name)


def available() -> bool:
  """True when bwrap and prlimit are on PATH (tests skip the sandbox checks otherwise)."""
  return _which("bwrap") is not None and _which("prlimit") is not None


def venv_paths(venv: str | os.PathLike) -> tuple[str, ...]:
  """A venv plus the base interpreter prefix its `bin/python` symlinks into (from `pyvenv.cfg`)."""
  venv = pathlib.Path(venv).resolve()
  paths = [str(venv)]
  cfg = venv / "pyvenv.cfg"
  if cfg.is_file():
    for line in cfg.read_text().splitlines():
      key, _, value = line.partition("=")
      if key.strip() == "home" and value.strip():
        paths.append(str(pathlib.Path(value.strip()).resolve().parent))
  # The interpreter binary may live elsewhere still (e.g. a symlink chain); bind its prefix too.
  python = venv / "bin" / "python"
  if python.exists():
    paths.append(str(python.resolve().parent.parent))
  return tuple(dict.fromkeys(p for p in paths if p not in ("/", "/usr")))


def bwrap_args(
  *,
  task_dir: str,
  workdir: str,
  readonly_paths: Sequence[str],
  env: Mapping[str, str],
  drop_to_uid: int | None,
) -> list[str]:
  """The bwrap command line (pure: decided from its arguments and what exists on disk)."""
  args = ["--perms", "1777", "--tmpfs", "/tmp"]  # first: later mounts shadow earlier ones
  binds = [("--ro-bind", p) for p in _SYSTEM_PATHS if os.path.isdir(p) and not os.path.islink(p)]
  binds += [("--ro-bind", p) for p in _ETC_PATHS if os.path.exists(p)]
  binds += [("--ro-bind", p) for p in sorted(readonly_paths)]
  dests = [p for _, p in binds] + [workdir]
  # bwrap creates missing parents 0700, unreadable for the unprivileged uid: make them 0755 first.
  made: set[str] = set()
  for dest in dests:
    for parent in reversed(pathlib.PurePosixPath(dest).parents[:-1]):
      name = str(parent)
      if name not in made and not any(name == d or name.startswith(d + "/") for d in dests):
        args += ["--perms", "0755", "--dir", name]
        made.add(name)
  for path in _SYSTEM_PATHS:
    if os.path.islink(path):
      args += ["--symlink", os.readlink(path), path]
  for flag, path in binds:
    args += [flag, path, path]
  args += ["--bind", task_dir, workdir, "--chdir", workdir, "--proc", "/proc", "--dev", "/dev"]
  args += ["--die-with-parent", "--new-session", "--clearenv"]
  if drop_to_uid is None:
    args += ["--unshare-all", "--cap-drop", "ALL"]
  else:
    # Real root, no user namespace: keep only what setpriv needs to become an unprivileged uid (and the
    # search right bwrap needs to chdir into a 0700 task dir); setpriv drops them all before exec.
    args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--cap-drop", "ALL"]
    for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_READ_SEARCH"):
      args += ["--cap-add", cap]
  for key, value in env.items():
    args += ["--setenv", key, value]
  if drop_to_uid is not None:
    args += ["--", "setpriv", f"--reuid={drop_to_uid}", f"--regid={drop_to_uid}", "--clear-groups"]
    args += ["--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]
  return args + ["--"]


def default_env(readonly_paths: Sequence[str], extra: Mapping[str, str] | None) -> dict[str, str]:
  """Minimal environment: the bound prefixes' bin dirs first on PATH, bytecode off, home on the tmpfs."""
  bins = [f"{p}/bin" for p in readonly_paths if os.path.isdir(f"{p}/bin")]
  env = {
    "PATH": ":".join([*bins, "/usr/local/bin", "/usr/bin", "/bin"]),
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
  }
  env.update(extra or {})
  return env


def _rlimit_args(cpu_s: int, memory_bytes: int, file_bytes: int, max_procs: int) -> list[str]:
  return [
    f"--cpu={cpu_s}:{cpu_s + 1}",
    f"--as={memory_bytes}",
    f"--fsize={file_bytes}",
    f"--nproc={max_procs}",
    "--core=0",
  ]


def _read_bounded(f, limit: int) -> tuple[str, bool]:
  f.seek(0, os.SEEK_END)
  size = f.tell()
  f.seek(0)
  data = f.read(limit).decode("utf-8", errors="replace")
  if size > limit:
    return data + f"\n[sandbox: output truncated, {size - limit} of {size} bytes dropped]\n", True
  return data, False


def _chown_tree(root: str, uid: int, gid: int) -> None:
  """lchown only: the sandbox may have planted symlinks pointing out of the task dir."""
  os.lchown(root, uid, gid)
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      os.lchown(os.path.join(dirpath, name), uid, gid)


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
) -> SandboxResult:
  """Run `cmd` with `task_dir` (mounted at `workdir`) as the only writable host path.

  `readonly_paths` are bound at their own paths (pass `venv_paths(venv)` so `python -m pytest` works).
  `cpu_s` defaults to the wall-clock budget. Raises `SandboxUnavailable` when bwrap is missing.
  """
  bwrap, prlimit = _which("bwrap"), _which("prlimit")
  if bwrap is None:
    raise SandboxUnavailable(INSTALL_HINT)
  if prlimit is None:
    raise SandboxUnavailable("`prlimit` (util-linux) is required to set resource limits; install util-linux.")
  task_dir = os.path.realpath(task_dir)
  if not os.path.isdir(task_dir):
    raise FileNotFoundError(task_dir)
  ro = [os.path.realpath(p) for p in readonly_paths]
  cpu_s = int(cpu_s if cpu_s is not None else max(1, int(timeout_s) + 1))
  drop_to_uid = None
  if os.geteuid() == 0:
    drop_to_uid = _UID_BASE + (os.getpid() % 1000) * 1000 + next(_uid_counter) % 1000
    owner = os.stat(task_dir)
    _chown_tree(task_dir, drop_to_uid, drop_to_uid)
  argv = [prlimit, *_rlimit_args(cpu_s, memory_bytes, file_bytes, max_procs), "--", bwrap]
  argv += bwrap_args(
    task_dir=task_dir, workdir=workdir, readonly_paths=ro, env=default_env(ro, env), drop_to_uid=drop_to_uid
  )
  argv += list(cmd)
  start = time.perf_counter()
  try:
    # Output goes to files (not pipes) so a flood cannot grow this process; RLIMIT_FSIZE caps them.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
      proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={}, start_new_session=True
      )
      timed_out = _wait(proc, timeout_s)
      returncode = proc.returncode
      wall_s = time.perf_counter() - start
      stdout, t1 = _read_bounded(out, max_output_bytes)
      stderr, t2 = _read_bounded(err, max_output_bytes)
  finally:
    if drop_to_uid is not None:
      _chown_tree(task_dir, owner.st_uid, owner.st_gid)
  return SandboxResult(returncode, stdout, stderr, timed_out, wall_s, t1 or t2)


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
  """Block until exit, SIGKILLing the group at the deadline; True if it was killed for time.

  `Popen.wait(timeout)` polls with sleeps of up to 50 ms (measured: +60 ms per run), so a timer thread
  kills instead. `waitid(WNOWAIT)` observes the exit without reaping, so the timer can never signal a
  recycled process-group id.
  """
  lock, state = threading.Lock(), {"done": False, "killed": False}

  def kill():
    with lock:
      if not state["done"]:
        state["killed"] = True
        _kill_group(proc.pid)

  timer = threading.Timer(timeout_s, kill)
  timer.daemon = True
  timer.start()
  try:
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
  except BaseException:
    kill()  # interrupted (e.g. KeyboardInterrupt): never leave the sandbox running
    raise
  finally:
    with lock:
      state["done"] = True
    timer.cancel()
    proc.wait()
  return state["killed"]


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass


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
