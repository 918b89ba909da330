"""Read an agent's working tree once, into memory, without trusting anything in it.

Why: reading the tree twice (a diff for the monitor, a copy for the run) would let it change in between,
and a plain walk follows symlinks, blocks on FIFOs and reads sparse files whole. Here every directory and
file is opened relative to its parent's descriptor with `O_NOFOLLOW`, so a symlink swapped in anywhere is
never followed; only regular files with one link are read, non-blocking, up to a size cap (a file that
exists in the reference with the same size may be read up to that size); everything else is *refused* with
a reason: symlink, fifo, device, socket, hard link, oversize, over budget. The monitor and the run both
use this one snapshot, and `changed_since` re-stats the tree after grading: a tree that changed while it
was graded had a writer running, which an honest episode never has.
"""

import dataclasses
import errno
import os
import stat
from collections.abc import Mapping

MAX_FILE_BYTES = 1 << 20
MAX_TOTAL_BYTES = 64 << 20
MAX_FILES = 20_000
MAX_DEPTH = 64
SKIP = (".git",)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC


@dataclasses.dataclass(frozen=True)
class Snapshot:
  files: dict[str, bytes]  # repo-relative path -> content, regular files accepted
  refused: dict[str, str]  # repo-relative path -> why it was not read
  stamps: dict[str, tuple[int, int, int]]  # path -> (size, mtime_ns, inode) of everything seen


def _kind(mode: int) -> str:
  for test, name in ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket")):
    if test(mode):
      return name
  return "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file"


def _readlink(name: str, dfd: int) -> str:
  try:
    return os.readlink(name, dir_fd=dfd)[:200]
  except OSError:
    return "?"


class _Reader:
  def __init__(self, expected_sizes: Mapping[str, int], max_file: int, max_total: int, max_files: int):
    self.expected, self.max_file, self.max_total, self.max_files = (
      expected_sizes,
      max_file,
      max_total,
      max_files,
    )
    self.files: dict[str, bytes] = {}
    self.refused: dict[str, str] = {}
    self.stamps: dict[str, tuple[int, int, int]] = {}
    self.total = 0

  def walk(self, dfd: int, prefix: str, depth: int) -> None:
    with os.scandir(dfd) as it:
      entries = sorted(it, key=lambda e: e.name)
    for e in entries:
      rel = prefix + e.name
      if not prefix and e.name in SKIP:
        continue
      try:
        st = e.stat(follow_symlinks=False)
      except OSError:
        self.refused[rel] = "unreadable"
        continue
      self.stamps[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
      if stat.S_ISDIR(st.st_mode):
        self._dir(dfd, e.name, rel, depth)
      elif stat.S_ISLNK(st.st_mode):
        self.refused[rel] = f"symlink -> {_readlink(e.name, dfd)}"
      elif not stat.S_ISREG(st.st_mode):
        self.refused[rel] = _kind(st.st_mode)
      else:
        self._file(dfd, e.name, rel)

  def _dir(self, dfd: int, name: str, rel: str, depth: int) -> None:
    if depth >= MAX_DEPTH:
      self.refused[rel] = "too deep"
      return
    try:
      sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except OSError as err:
      self.refused[rel] = f"unreadable directory ({err.strerror})"
      return
    try:
      self.walk(sub, rel + "/", depth + 1)
    finally:
      os.close(sub)

  def _file(self, dfd: int, name: str, rel: str) -> None:
    try:
      fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
    except OSError as err:
      self.refused[rel] = "symlink" if err.errno == errno.ELOOP else f"unreadable ({err.strerror})"
      return
    try:
      why = self._read(fd, rel)
      if why:
        self.refused[rel] = why
    finally:
      os.close(fd)

  def _read(self, fd: int, rel: str) -> str:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      return _kind(st.st_mode)
    if st.st_nlink > 1:
      return "hard link"
    cap = max(self.max_file, self.expected.get(rel, 0))
    if st.st_size > cap:
      return f"oversize ({st.st_size} bytes)"
    if len(self.files) >= self.max_files or self.total + st.st_size > self.max_total:
      return "over budget"
    chunks, n = [], 0
    while n <= cap and (chunk := os.read(fd, min(1 << 20, cap + 1 - n))):
      chunks.append(chunk)
      n += len(chunk)
    if n > cap:
      return "oversize (grew while read)"
    self.files[rel] = b"".join(chunks)
    self.total += n
    return ""


def take(
  root: str | os.PathLike,
  *,
  expected_sizes: Mapping[str, int] | None = None,
  max_file_bytes: int = MAX_FILE_BYTES,
  max_total_bytes: int = MAX_TOTAL_BYTES,
  max_files: int = MAX_FILES,
) -> Snapshot:
  """Snapshot of the tree under `root` (`.git` at the top skipped). `root` itself must be a real dir."""
  reader = _Reader(expected_sizes or {}, max_file_bytes, max_total_bytes, max_files)
  top = os.open(os.fspath(root), _DIR_FLAGS)
  try:
    reader.walk(top, "", 0)
  finally:
    os.close(top)
  return Snapshot(reader.files, reader.refused, reader.stamps)


def changed_since(root: str | os.PathLike, snap: Snapshot) -> list[str]:
  """Paths added, removed or re-stamped since `snap` was taken (lstat only: nothing is opened)."""
  now = take(root, max_file_bytes=0, max_total_bytes=0, max_files=0).stamps
  return sorted(rel for rel in set(now) | set(snap.stamps) if now.get(rel) != snap.stamps.get(rel))


def write_tree(dest: str | os.PathLike, files: Mapping[str, bytes]) -> None:
  """Write `files` into the fresh, grader-owned dir `dest` (0755 dirs, 0644 files, nothing followed)."""
  dest = os.fspath(dest)
  os.makedirs(dest, mode=0o755, exist_ok=True)
  os.chmod(dest, 0o755)
  made = {""}
  for rel in sorted(files):
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
      raise ValueError(f"bad path in a run tree: {rel!r}")
    for i in range(1, len(parts)):
      d = "/".join(parts[:i])
      if d not in made:
        os.mkdir(os.path.join(dest, d), 0o755)
        os.chmod(os.path.join(dest, d), 0o755)  # whatever the umask: the sandbox's uid must read it
        made.add(d)
    fd = os.open(os.path.join(dest, rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
      os.fchmod(fd, 0o644)
      view = memoryview(files[rel])
      while view:
        view = view[os.write(fd, view) :]
    finally:
      os.close(fd)
