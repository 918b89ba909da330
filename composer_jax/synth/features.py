"""Candidate features from per-test coverage: functions the suite exercises, but not at import time.

`coverage run` with `dynamic_context = test_function` (in the sandbox, on a scratch copy) labels every
executed line with the test that ran it; lines run outside any test (import, collection) get the empty
context. A function is a candidate when its body (after the docstring) is executed by ≥1 test and never
under the empty context: toolz's three import-time functions were exactly its three invalid stubs
(observed when building tasks from
toolz). A feature is the candidate plus the private helpers only it uses
(`deletion.private_helpers`); helpers that belong to another candidate's feature are not offered alone.
"""

import ast
import dataclasses
import json
import os
import pathlib
import subprocess
import tempfile
import uuid

from composer_jax.synth import baseline, deletion, monitor, sandbox, sources

PIP_TIMEOUT_S = sources.PIP_TIMEOUT_S
_NOT_LIBRARY = {
  "docs",
  "doc",
  "examples",
  "example",
  "benchmarks",
  "bench",
  "scripts",
  "tools",
  "build",
  "dist",
}
_SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".tox", ".nox", "node_modules"}
_NOT_LIBRARY_FILES = {"setup.py", "conftest.py", "noxfile.py", "fabfile.py", "tasks.py"}


@dataclasses.dataclass(frozen=True)
class Feature:
  qualname: str  # pkg.mod.func or pkg.mod.Class.method
  rel: str  # file relative to the source root
  inner: str  # func or Class.method
  lineno: int
  tests: tuple[str, ...]  # coverage contexts (test functions) executing the body
  helpers: tuple[str, ...]  # private helpers (in-module names) deleted with it


def ensure_coverage(venv: str | os.PathLike, pip_args: tuple[str, ...] = ()) -> None:
  """Install `coverage` into the source venv with its own pip, outside the sandbox (which has no network)."""
  py = baseline.python(venv)
  if subprocess.run([py, "-c", "import coverage"], capture_output=True, check=False).returncode == 0:
    return
  sources.pip(py, "install", *pip_args, "coverage")


def is_library_file(rel: str) -> bool:
  p = pathlib.PurePosixPath(rel)
  if p.suffix != ".py" or p.name in _NOT_LIBRARY_FILES or monitor.is_test_path(rel):
    return False
  return not (set(p.parts[:-1]) & _NOT_LIBRARY) and not any(part.startswith(".") for part in p.parts)


def py_files(src_dir: pathlib.Path) -> dict[str, str]:
  """Every `.py` file outside VCS/venv/build dirs: rel path -> text (what `private_helpers` scans)."""
  return deletion.py_files(src_dir, errors="replace")


def module_name(rel: str) -> str:
  parts = list(pathlib.PurePosixPath(rel).with_suffix("").parts)
  if parts[0] == "src":
    parts = parts[1:]
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def functions(text: str) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
  """Module-level functions and methods of module-level classes, as (inner qualname, node)."""
  out = []
  for node in ast.parse(text).body:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      out.append((node.name, node))
    elif isinstance(node, ast.ClassDef):
      out += [
        (f"{node.name}.{m.name}", m)
        for m in node.body
        if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
      ]
  return out


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> range:
  """Lines of the body after the docstring (empty when the body is only a docstring)."""
  body = node.body
  if ast.get_docstring(node, clean=False) is not None:
    body = body[1:]
  return range(body[0].lineno, node.end_lineno + 1) if body else range(0)


def contexts_by_line(
  src_dir: str | os.PathLike, venv: str | os.PathLike, box: sandbox.Sandbox | None = None
) -> dict[str, dict[int, set[str]]]:
  """rel path -> line -> coverage contexts ("" = outside any test), from one sandboxed suite run."""
  box = box or baseline.make_sandbox(venv)
  tag = uuid.uuid4().hex
  with tempfile.TemporaryDirectory(prefix="coverage-") as tmp:
    work = baseline.copy_tree(src_dir, pathlib.Path(tmp, "repo"))
    w = box.workdir
    rc = work / f".covrc-{tag}"
    rc.write_text(f"[run]\ndata_file = {w}/.cov-{tag}\ndynamic_context = test_function\nsource = {w}\n")
    py = baseline.python(venv)
    box.run(
      [py, "-m", "coverage", "run", f"--rcfile={w}/{rc.name}", "-m", "pytest", *baseline.PYTEST_ARGS], work
    )
    out = f".cov-{tag}.json"
    r = box.run(
      [py, "-m", "coverage", "json", f"--rcfile={w}/{rc.name}", "--show-contexts", "-o", f"{w}/{out}"], work
    )
    if not (work / out).is_file():
      raise RuntimeError(f"coverage json failed (rc {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    data = json.loads((work / out).read_text())
  result: dict[str, dict[int, set[str]]] = {}
  for path, info in data.get("files", {}).items():
    rel = os.path.relpath(path, w) if os.path.isabs(path) else path
    result[pathlib.PurePosixPath(rel).as_posix()] = {
      int(line): set(ctxs) for line, ctxs in (info.get("contexts") or {}).items()
    }
  return result


def select(
  src_dir: str | os.PathLike,
  contexts: dict[str, dict[int, set[str]]],
  *,
  max_test_fraction: float = 0.5,
) -> list[Feature]:
  """Candidates in file and line order. `max_test_fraction` drops functions most of the suite runs
  (their deletion would leave no P2P); 0.2 suits large suites."""
  src_dir = pathlib.Path(src_dir)
  files = py_files(src_dir)
  all_tests = set().union(*(c for lines in contexts.values() for c in lines.values())) - {""}
  limit = max(1, int(max_test_fraction * len(all_tests)))
  found: list[Feature] = []
  for rel, text in sorted(files.items()):
    if not is_library_file(rel):
      continue
    lines = contexts.get(rel, {})
    try:
      defs = functions(text)
    except SyntaxError:
      continue
    for inner, node in defs:
      name = inner.rsplit(".", 1)[-1]
      if name.startswith("__") and name.endswith("__") or name.startswith("test"):
        continue
      covered = [lines[i] for i in body_lines(node) if i in lines]
      if not covered or any("" in c for c in covered):
        continue  # never run by a test, or run at import/collection time
      tests = sorted(set().union(*covered))
      if len(tests) > limit:
        continue
      try:
        helpers = deletion.private_helpers(files, rel, inner)
      except deletion.DeletionRejected:
        continue
      found.append(
        Feature(f"{module_name(rel)}.{inner}", rel, inner, node.lineno, tuple(tests), tuple(helpers))
      )
  owned = {(f.rel, h) for f in found for h in f.helpers}
  return [f for f in found if (f.rel, f.inner) not in owned]


def find_features(
  src_dir: str | os.PathLike,
  venv: str | os.PathLike,
  *,
  box: sandbox.Sandbox | None = None,
  pip_args: tuple[str, ...] = (),
  max_test_fraction: float = 0.5,
) -> list[Feature]:
  """Install coverage if needed, trace the suite per test in the sandbox, and select candidates."""
  ensure_coverage(venv, pip_args)
  return select(src_dir, contexts_by_line(src_dir, venv, box), max_test_fraction=max_test_fraction)
