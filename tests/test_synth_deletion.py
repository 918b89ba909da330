"""Feature deletion on a tiny fake package: stub/remove, reference cleanup, helpers, byte-exact gold patch."""

import difflib
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from composer_jax.synth import deletion

CORE = '''\
"""Core shapes."""
import functools

__all__ = [
  "area",
  "perimeter",
  "Shape",
]


def _twice(x):
  return 2 * x


def _square(x):
  # squares, via a private helper of its own
  return _twice(x * x) // 2


def _shared(x):
  return x + 1


@functools.lru_cache(maxsize=None)
def area(r: int, *, pi: int = 3) -> int:  # cached
  """Area of a circle of radius r (integer pi)."""
  return pi * _square(r) + _shared(0) - 1


def perimeter(r):
  """Perimeter."""
  return 6 * _shared(r - 1)


class Shape:
  """A shape."""

  def scale(self, k):
    """Scale by k."""
    return k * 2

  def name(self):
    return "shape"
'''
INIT = 'from .core import area, perimeter, Shape\n\n__all__ = ["area", "perimeter", "Shape"]\n'
OTHER = "from mypkg.core import area as circle_area\n\n\ndef use():\n  return circle_area(1)\n"
TEST = "from mypkg import area\n\n\ndef test_area():\n  assert area(1) == 3\n"


@pytest.fixture
def pkg(tmp_path):
  root = tmp_path / "repo"
  (root / "mypkg").mkdir(parents=True)
  (root / "tests").mkdir()
  (root / "mypkg" / "core.py").write_text(CORE)
  (root / "mypkg" / "__init__.py").write_text(INIT)
  (root / "mypkg" / "other.py").write_text(OTHER)
  (root / "tests" / "test_core.py").write_text(TEST)
  return root


def _write(root: pathlib.Path, d: deletion.Deletion) -> None:
  for rel, text in d.files.items():
    (root / rel).write_text(text)


def _py(root: pathlib.Path, code: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)], cwd=root, capture_output=True, text=True, check=False
  )


def _only_deletions(a: str, b: str) -> bool:
  ops = difflib.SequenceMatcher(None, a.splitlines(True), b.splitlines(True), autojunk=False).get_opcodes()
  return all(op in ("equal", "delete") for op, *_ in ops)


def test_stub_keeps_interface_and_raises(pkg):
  d = deletion.delete_feature(pkg, "mypkg.core.area", "stub")
  assert d.feature == ["mypkg.core.area", "mypkg.core._square", "mypkg.core._twice"]
  assert list(d.files) == ["mypkg/core.py"]
  _write(pkg, d)
  r = _py(
    pkg,
    """
    import inspect, mypkg
    from mypkg import core
    assert str(inspect.signature(mypkg.area)) == "(r: int, *, pi: int = 3) -> int"
    assert mypkg.area.__doc__ == "Area of a circle of radius r (integer pi).", mypkg.area.__doc__
    assert core._shared(1) == 2 and core.perimeter(1) == 6
    for f in (lambda: mypkg.area(2), lambda: core._square(2), lambda: core._twice(2)):
      try:
        f()
      except NotImplementedError:
        pass
      else:
        raise SystemExit("no NotImplementedError")
    """,
  )
  assert r.returncode == 0, r.stderr
  new = d.files["mypkg/core.py"]
  assert "@functools.lru_cache(maxsize=None)\ndef area(r: int, *, pi: int = 3) -> int:  # cached\n" in new
  assert "_square(r)" not in new and "return 2 * x" not in new and "return x + 1" in new


def test_remove_cleans_references_and_private_helpers(pkg):
  d = deletion.delete_feature(pkg, "mypkg.core.area", "remove")
  assert set(d.files) == {"mypkg/core.py", "mypkg/__init__.py", "mypkg/other.py"}
  assert d.collection_breaks == ["tests/test_core.py"]  # gold tests stay; collection breaks there
  assert (
    d.files["mypkg/__init__.py"] == 'from .core import perimeter, Shape\n\n__all__ = ["perimeter", "Shape"]\n'
  )
  assert d.files["mypkg/other.py"] == "\n\ndef use():\n  return circle_area(1)\n"  # fails at call time only
  assert _only_deletions(CORE, d.files["mypkg/core.py"])
  _write(pkg, d)
  r = _py(
    pkg,
    """
    import mypkg, mypkg.other
    from mypkg import core
    assert not hasattr(mypkg, "area") and not hasattr(core, "area")
    assert "area" not in core.__all__ and "area" not in mypkg.__all__
    assert not hasattr(core, "_square") and not hasattr(core, "_twice")
    assert core._shared(1) == 2 and core.perimeter(1) == 6 and core.Shape().name() == "shape"
    """,
  )
  assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("mode", ["stub", "remove"])
@pytest.mark.parametrize("target", ["mypkg.core.area", "mypkg.core.Shape.scale"])
def test_gold_patch_restores_bytes(pkg, tmp_path, mode, target):
  pristine = tmp_path / "pristine"
  shutil.copytree(pkg, pristine)
  d = deletion.delete_feature(pkg, target, mode)
  # The forward patch reproduces `files`; the gold patch then restores every byte.
  for patch, check in ((d.patch, d.files), (d.gold_patch, None)):
    p = subprocess.run(
      ["patch", "-p1", "-s"], input=patch, cwd=pkg, text=True, capture_output=True, check=False
    )
    assert p.returncode == 0, p.stdout + p.stderr
    if check:
      for rel, text in check.items():
        assert (pkg / rel).read_text() == text
  for f in pristine.rglob("*"):
    if f.is_file():
      assert (pkg / f.relative_to(pristine)).read_bytes() == f.read_bytes(), f


def test_method_remove_and_stub(pkg):
  d = deletion.delete_feature(pkg, "mypkg.core.Shape.scale", "remove")
  assert list(d.files) == ["mypkg/core.py"] and d.feature == ["mypkg.core.Shape.scale"]
  assert _only_deletions(CORE, d.files["mypkg/core.py"])
  _write(pkg, d)
  r = _py(
    pkg, "from mypkg.core import Shape\nassert not hasattr(Shape, 'scale') and Shape().name() == 'shape'"
  )
  assert r.returncode == 0, r.stderr
  stub = deletion.delete_function(CORE, "Shape.scale", "stub")
  assert '    """Scale by k."""\n    raise NotImplementedError\n\n  def name' in stub


def test_delete_function_edge_cases():
  src = (
    'x = 1  # keep\ndef f(a): return a + 1\n\n\ndef g():\n  """Only a docstring."""\n\n\ndef h():\n  pass\n'
  )
  assert deletion.delete_function(src, "f", "stub") == src.replace(
    "return a + 1", "raise NotImplementedError"
  )
  assert '  """Only a docstring."""\n  raise NotImplementedError\n' in deletion.delete_function(
    src, "g", "stub"
  )
  assert deletion.delete_function(src, "h", "remove") == src[: src.index("def h")].rstrip("\n") + "\n\n\n"
  only = "class A:\n  def m(self):\n    return 1\n"
  assert deletion.delete_function(only, "A.m", "remove") == "class A:\n  pass\n"
  with pytest.raises(deletion.DeletionRejected, match="no top-level"):
    deletion.delete_function(src, "nope", "stub")


def test_remove_rejects_module_level_use(pkg):
  (pkg / "mypkg" / "registry.py").write_text("from .core import area\n\nREGISTRY = {'area': area}\n")
  with pytest.raises(deletion.DeletionRejected, match=r"registry.py:\d+ uses area at import time"):
    deletion.delete_feature(pkg, "mypkg.core.area", "remove")


def test_remove_drops_wrapper_aliases(pkg):
  (pkg / "mypkg" / "curried.py").write_text("import mypkg\n\narea = mypkg.core.area\nstill = 1\n")
  d = deletion.delete_feature(pkg, "mypkg.core.area", "remove")
  assert d.files["mypkg/curried.py"] == "import mypkg\n\nstill = 1\n"


def test_statement_has_interface(pkg):
  text = deletion.statement(CORE, "area", "mypkg/core.py")
  assert "`area` in `mypkg/core.py`" in text and "NotImplementedError" in text
  assert "@functools.lru_cache(maxsize=None)\ndef area(r: int, *, pi: int = 3) -> int:  # cached\n" in text
  assert '"""Area of a circle of radius r (integer pi)."""' in text and "_square" not in text
  assert 'def scale(self, k):\n  """Scale by k."""\n' in deletion.statement(
    CORE, "Shape.scale", "m.py", "remove"
  )
