"""Real Python repositories with test suites, as pinned PyPI sdists (or local dirs), cached and verified.

Why sdists: wheels ship without tests. Why sha256 pins: a task records exactly which code it was cut from,
and a changed upload must not silently change the task set. Why one editable venv per source: a plain
`pip install .` leaves pristine copies of the deleted code in `site-packages` and `build/lib`, which
the agent could read.
"""

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

PIP_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Source:
  """One repository. kind "sdist": from PyPI, or from `path` when it names a local sdist archive;
  kind "local": `path` is a source directory, copied as is (no hash)."""

  name: str
  version: str
  sha256: str | None = None
  kind: str = "sdist"
  path: str | None = None


class ChecksumError(RuntimeError):
  """The downloaded archive is not the pinned one; tasks cut from it would not be reproducible."""


# Hashes measured on 2026-12-02 with `pip download --no-binary :all: --no-deps` from PyPI. A Source with
# sha256=None is pinned on first download (the hash is
# written next to the archive as `<archive>.sha256`) and verified against that record afterwards.
DEFAULT_SOURCES: tuple[Source, ...] = (
  Source("toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490"),
  Source("boltons", "26.2.0", "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c"),
  Source("cachetools", "8.0.2", "30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0"),
  Source("tabulate", "0.10.0", "e2cfde8f79420f6deeffdeda9aaec3b6bc5abce947655d17ac662b126e48a60d"),
  Source("humanize", "4.17.0", "1d6a36c453dbfbb3f0b34601d2e0b4ce5d48d780305cd45714843f0068fde6ac"),
  Source("inflection", "0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417"),
)


def sha256_file(path: str | os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def verify(path: str | os.PathLike, expected: str | None) -> str:
  """Check `path` against `expected` (a full hex digest); return the actual digest. None checks nothing."""
  actual = sha256_file(path)
  if expected is not None and actual != expected.lower():
    raise ChecksumError(f"sha256 mismatch for {path}: expected {expected}, actual {actual}")
  return actual


def _pip() -> list[str]:
  return [sys.executable, "-m", "pip"]


def _download(source: Source, dest: pathlib.Path) -> pathlib.Path:
  """Fetch the sdist archive into `dest` (pip, or a copy of a local archive) and return its path."""
  dest.mkdir(parents=True, exist_ok=True)
  prefix = f"{source.name}-{source.version}".lower().replace("_", "-")
  found = [
    p for p in dest.iterdir() if _is_archive(p) and p.name.lower().replace("_", "-").startswith(prefix)
  ]
  if found:
    return found[0]
  if source.path is not None:
    target = dest / pathlib.Path(source.path).name
    shutil.copyfile(source.path, target)
    return target
  cmd = [*_pip(), "download", "--no-binary", ":all:", "--no-deps", f"{source.name}=={source.version}"]
  proc = subprocess.run(
    [*cmd, "-d", str(dest)], capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
  )
  found = [p for p in dest.iterdir() if _is_archive(p)]
  if proc.returncode != 0 or not found:
    raise RuntimeError(f"`{' '.join(cmd)}` failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
  return found[0]


def _is_archive(p: pathlib.Path) -> bool:
  return p.name.endswith((".tar.gz", ".tgz", ".zip", ".tar.bz2"))


def _check(source: Source, archive: pathlib.Path) -> str:
  """Verify against the pin; without a pin, record the first digest and hold later calls to it."""
  record = archive.with_name(archive.name + ".sha256")
  expected = source.sha256 or (record.read_text().strip() if record.exists() else None)
  actual = verify(archive, expected)
  if not record.exists():
    record.write_text(actual + "\n")
  return actual


def _extract(archive: pathlib.Path, dest: pathlib.Path) -> None:
  """Unpack and strip the single top-level directory, refusing paths that escape `dest`."""
  dest.mkdir(parents=True)
  if archive.name.endswith(".zip"):
    with zipfile.ZipFile(archive) as z:
      names = z.namelist()
      _check_members(names)
      z.extractall(dest)
  else:
    with tarfile.open(archive) as t:
      _check_members(t.getnames())
      t.extractall(dest, filter="data")
  tops = list(dest.iterdir())
  if len(tops) == 1 and tops[0].is_dir():
    inner = tops[0]
    for child in list(inner.iterdir()):
      child.rename(dest / child.name)
    inner.rmdir()


def _check_members(names: list[str]) -> None:
  for n in names:
    if n.startswith("/") or ".." in pathlib.PurePosixPath(n).parts:
      raise ValueError(f"refusing archive member outside the target: {n!r}")


def fetch(source: Source, cache_dir: str | os.PathLike) -> pathlib.Path:
  """Return `<cache>/<name>-<version>/src`, downloading, verifying and extracting only the first time.

  The archive is re-verified on every call (cheap) so a tampered cache is caught; extraction goes to a
  temporary sibling and is renamed into place, so a crash never leaves a half-extracted tree that later
  calls would trust.
  """
  root = pathlib.Path(cache_dir) / f"{source.name}-{source.version}"
  src = root / "src"
  if source.kind == "local":
    if src.exists():
      return src
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".src-", dir=root))
    shutil.copytree(source.path, tmp / "src", symlinks=True)
    _rename_into_place(tmp / "src", src)
    shutil.rmtree(tmp, ignore_errors=True)
    return src
  if source.kind != "sdist":
    raise ValueError(f"unknown source kind {source.kind!r} (want 'sdist' or 'local')")
  archive = _download(source, root / "archive")
  _check(source, archive)
  if src.exists():
    return src
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=".src-", dir=root))
  try:
    _extract(archive, tmp / "src")
    _rename_into_place(tmp / "src", src)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return src


def _rename_into_place(tmp: pathlib.Path, final: pathlib.Path) -> None:
  try:
    tmp.rename(final)
  except OSError:
    if not final.exists():  # lost a race only if someone else finished; otherwise a real error
      raise


def make_venv(
  src_dir: str | os.PathLike,
  venv_dir: str | os.PathLike,
  *,
  extras: tuple[str, ...] = ("pytest",),
  pip_args: tuple[str, ...] = (),
) -> pathlib.Path:
  """Create `venv_dir` with the source installed editable (`pip install -e .`) plus `extras`.

  Editable, because a regular install copies the package into site-packages where the deleted code
  survives. `pip_args` passes e.g. `--no-build-isolation`/`--no-index` for offline builds. Returns the
  venv's python.
  """
  venv_dir = pathlib.Path(venv_dir)
  subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True, capture_output=True)
  py = venv_dir / "bin" / "python"
  steps = [["install", *pip_args, *extras]] if extras else []  # first: build helpers (e.g. wheel) too
  steps.append(["install", *pip_args, "-e", str(src_dir)])
  for step in steps:
    pip(py, *step)
  return py


def pip(python: str | os.PathLike, *args: str) -> None:
  """`python -m pip <args>` (at most PIP_TIMEOUT_S); RuntimeError with pip's stderr if it fails."""
  cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
  run_checked(cmd, f"pip {' '.join(args)}", timeout=PIP_TIMEOUT_S)


def run_checked(cmd: list[str], what: str, error: type[Exception] = RuntimeError, **kwargs) -> str:
  """Run `cmd` (text, output captured) and return its stdout; `error` with `what`, the exit code and the
  tail of stderr when it fails."""
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
  if proc.returncode != 0:
    raise error(f"{what} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
  return proc.stdout
