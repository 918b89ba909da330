"""Source fetching without network: local sdist archives, sha256 pinning, one-time atomic extraction."""

import io
import pathlib
import subprocess
import sys
import tarfile

import pytest

from composer_jax.synth import sources


def _sdist(tmp_path: pathlib.Path, body: str = "VALUE = 1\n") -> pathlib.Path:
  path = tmp_path / "dist" / "tiny-0.1.tar.gz"
  path.parent.mkdir(exist_ok=True)
  files = {
    "tiny-0.1/pyproject.toml": '[project]\nname = "tiny"\nversion = "0.1"\n',
    "tiny-0.1/tiny/__init__.py": body,
    "tiny-0.1/tests/test_tiny.py": "import tiny\n\n\ndef test_value():\n  assert tiny.VALUE == 1\n",
  }
  with tarfile.open(path, "w:gz") as t:
    for name, text in files.items():
      data = text.encode()
      info = tarfile.TarInfo(name)
      info.size = len(data)
      t.addfile(info, io.BytesIO(data))
  return path


def test_defaults_are_pinned():
  assert {s.name for s in sources.DEFAULT_SOURCES} == {
    "toolz",
    "boltons",
    "cachetools",
    "tabulate",
    "humanize",
    "inflection",
  }
  assert all(s.sha256 and len(s.sha256) == 64 and s.kind == "sdist" for s in sources.DEFAULT_SOURCES)


def test_fetch_verifies_extracts_once(tmp_path):
  archive = _sdist(tmp_path)
  src = sources.Source("tiny", "0.1", sources.sha256_file(archive), path=str(archive))
  out = sources.fetch(src, tmp_path / "cache")
  assert out == tmp_path / "cache" / "tiny-0.1" / "src"
  assert (out / "tiny" / "__init__.py").read_text() == "VALUE = 1\n" and (out / "pyproject.toml").exists()
  (out / "marker").write_text("kept")  # a second call must reuse the tree, not re-extract
  assert sources.fetch(src, tmp_path / "cache") == out and (out / "marker").read_text() == "kept"
  assert not [p for p in out.parent.iterdir() if p.name.startswith(".src-")]  # no temp dirs left


def test_fetch_rejects_tampered_archive(tmp_path):
  good = sources.sha256_file(_sdist(tmp_path))
  archive = _sdist(tmp_path, body="VALUE = 2  # tampered\n")
  bad = sources.sha256_file(archive)
  src = sources.Source("tiny", "0.1", good, path=str(archive))
  with pytest.raises(sources.ChecksumError, match=f"expected {good}, actual {bad}"):
    sources.fetch(src, tmp_path / "cache")
  assert not (tmp_path / "cache" / "tiny-0.1" / "src").exists()


def test_unpinned_source_records_then_verifies(tmp_path):
  archive = _sdist(tmp_path)
  src = sources.Source("tiny", "0.1", None, path=str(archive))
  sources.fetch(src, tmp_path / "cache")
  cached = tmp_path / "cache" / "tiny-0.1" / "archive" / "tiny-0.1.tar.gz"
  record = cached.with_name(cached.name + ".sha256")
  assert record.read_text().strip() == sources.sha256_file(archive)
  cached.write_bytes(cached.read_bytes() + b"\0")  # the cached archive changes under us
  with pytest.raises(sources.ChecksumError, match="expected"):
    sources.fetch(src, tmp_path / "cache")


def test_local_directory_source(tmp_path):
  d = tmp_path / "here"
  (d / "pkg").mkdir(parents=True)
  (d / "pkg" / "__init__.py").write_text("X = 1\n")
  out = sources.fetch(sources.Source("here", "0", kind="local", path=str(d)), tmp_path / "cache")
  assert (out / "pkg" / "__init__.py").read_text() == "X = 1\n" and out != d


@pytest.mark.slow
def test_make_venv_editable_offline(tmp_path):
  # Offline, Python 3.11's bundled setuptools (< 70.1) cannot do `-e` without the `wheel` package; a newer
  # setuptools can. Take one from the local pip cache, or skip.
  wheels = sorted(pathlib.Path.home().glob(".cache/pip/wheels/**/setuptools-*.whl"))
  if not wheels:
    pytest.skip("no cached setuptools wheel for an offline editable install")
  src = sources.fetch(sources.Source("tiny", "0.1", path=str(_sdist(tmp_path))), tmp_path / "cache")
  offline = ("--no-build-isolation", "--no-index", "--find-links", str(wheels[-1].parent))
  py = sources.make_venv(src, tmp_path / "venv", extras=("setuptools>=70.1",), pip_args=offline)
  (src / "tiny" / "__init__.py").write_text("VALUE = 5\n")  # editable: the venv sees source edits
  r = subprocess.run(
    [str(py), "-c", "import tiny; print(tiny.VALUE)"], capture_output=True, text=True, check=False
  )
  assert r.stdout.strip() == "5", r.stderr
  assert sys.executable != str(py)
