"""The bubblewrap command line of one sandboxed run (pure: from its arguments and what exists on disk).

Layout inside: system dirs and the venv read-only at their own paths, `/tmp` a size-capped tmpfs, and the
task dir at `workdir` either bound read-write (the agent's own tools) or, with `copy_in`, bound read-only
at `SRC_DIR` while `workdir` is a fresh size-capped tmpfs the command copies it into (grading: nothing the
graded code writes reaches the host, and a disk-filling write stops at the cap). Extra read-only binds
(`binds`: host path -> path inside) carry grader-owned files such as the test runner.
"""

import atexit
import functools
import os
import pathlib
import tempfile
from collections.abc import Mapping, Sequence

SRC_DIR = "/.src"
HOSTNAME = "sandbox"
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
# Host-wide kernel state /proc shows whatever the namespaces: counters another sandbox can move
# (open files, memory, load, CPU times, locks, interrupts) are a covert channel between runs, so they are
# masked: directories by an empty read-only tmpfs, files by an empty file. Per-process entries stay.
_PROC_DIRS = (
  "/proc/sys",
  "/proc/pressure",
  "/proc/irq",
  "/proc/bus",
  "/proc/fs",
  "/proc/driver",
  "/proc/tty",
)
_PROC_FILES = tuple(
  f"/proc/{name}"
  for name in (
    "loadavg stat meminfo uptime vmstat diskstats interrupts softirqs schedstat locks buddyinfo zoneinfo "
    "slabinfo pagetypeinfo vmallocinfo swaps partitions key-users keys timer_list sched_debug cpuinfo "
    "kallsyms modules latency_stats mdstat crypto sysrq-trigger kmsg kcore"
  ).split()
)
# Kept by the root path so setpriv can become an unprivileged uid (and bwrap can chdir into a 0700 task
# dir); setpriv drops them all before it execs the command.
_ROOT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_READ_SEARCH")


@functools.cache
def _empty_file() -> str:
  """An empty read-only regular file (a device node bound under /proc, nodev, could not be opened)."""
  fd, path = tempfile.mkstemp(prefix="composer-sandbox-empty-")
  os.close(fd)
  os.chmod(path, 0o444)
  atexit.register(os.unlink, path)
  return path


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


def _parent_dirs(dests: Sequence[str]) -> list[str]:
  """bwrap creates missing parents 0700, unreadable for the unprivileged uid: make them 0755 first."""
  args, made = [], set()
  for dest in dests:
    for parent in reversed(pathlib.PurePosixPath(dest).parents[:-1]):
      name = str(parent)
      if name not in made and not any(name == d or name.startswith(d + "/") for d in dests):
        args += ["--perms", "0755", "--dir", name]
        made.add(name)
  return args


def bwrap_args(
  *,
  task_dir: str,
  workdir: str,
  readonly_paths: Sequence[str],
  env: Mapping[str, str],
  drop_to_uid: int | None,
  binds: Mapping[str, str] | None = None,
  copy_in: bool = False,
  task_bytes: int = 256 << 20,
  tmp_bytes: int = 256 << 20,
  seccomp_fd: int | None = None,
) -> list[str]:
  """The bwrap arguments up to and including the `--` before the command."""
  args = ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]  # first: later mounts shadow it
  ro = [p for p in _SYSTEM_PATHS if os.path.isdir(p) and not os.path.islink(p)]
  ro += [p for p in _ETC_PATHS if os.path.exists(p)] + sorted(readonly_paths)
  pairs = [(p, p) for p in ro] + sorted((binds or {}).items())
  if copy_in:
    pairs.append((task_dir, SRC_DIR))
  args += _parent_dirs([dest for _, dest in pairs] + [workdir])
  for path in _SYSTEM_PATHS:
    if os.path.islink(path):
      args += ["--symlink", os.readlink(path), path]
  for host, dest in pairs:
    args += ["--ro-bind", host, dest]
  if copy_in:
    args += ["--perms", "0777", "--size", str(task_bytes), "--tmpfs", workdir]
  else:
    args += ["--bind", task_dir, workdir]
  args += ["--chdir", workdir, "--proc", "/proc", "--dev", "/dev"]
  for d in _PROC_DIRS:
    if os.path.isdir(d):
      args += ["--perms", "0555", "--tmpfs", d, "--remount-ro", d]
  args += [a for f in _PROC_FILES if os.path.exists(f) for a in ("--ro-bind", _empty_file(), f)]
  args += ["--die-with-parent", "--new-session", "--clearenv"]
  if drop_to_uid is None:
    args += ["--unshare-all", "--cap-drop", "ALL"]
  else:
    # Real root, no user namespace (the seccomp filter forbids making one inside).
    args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--cap-drop", "ALL"]
    for cap in _ROOT_CAPS:
      args += ["--cap-add", cap]
  args += ["--hostname", HOSTNAME]  # the host's name is no business of the sandbox (uts is unshared)
  if seccomp_fd is not None:
    args += ["--add-seccomp-fd", str(seccomp_fd)]
  for key, value in env.items():
    args += ["--setenv", key, value]
  if drop_to_uid is not None:
    args += ["--", "setpriv", f"--reuid={drop_to_uid}", f"--regid={drop_to_uid}", "--clear-groups"]
    args += ["--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]
  return args + ["--"]
