"""Every third-party package the library imports is declared in pyproject.toml's dependencies: one that
only arrives as another package's dependency is gone the day that package drops it."""

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PROJECT = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
# Runs inside the sandbox on the task's own venv (its pytest), never in ours.
_SANDBOXED = {"composer_jax/synth/runner.py"}


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
  return {_norm(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]) for spec in _PROJECT["dependencies"]}


def _top_level_imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      names.add(node.module.split(".")[0])
  return names


def _third_party() -> dict[str, set[str]]:
  """{import name: files importing it} over the package (and run.py), stdlib and our own left out."""
  files = [*sorted((_ROOT / "composer_jax").rglob("*.py")), _ROOT / "run.py"]
  out: dict[str, set[str]] = {}
  for path in files:
    rel = path.relative_to(_ROOT).as_posix()
    if rel in _SANDBOXED:
      continue
    for name in _top_level_imports(path) - set(sys.stdlib_module_names) - {"composer_jax", "__future__"}:
      out.setdefault(name, set()).add(rel)
  return out


def _undeclared(declared: set[str]) -> dict[str, list[str]]:
  dists = importlib.metadata.packages_distributions()
  return {
    name: sorted(where)
    for name, where in _third_party().items()
    if not {_norm(d) for d in dists.get(name, [name])} & declared
  }


def test_every_imported_package_is_declared():
  undeclared = _undeclared(_declared())
  assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"


def test_the_check_sees_an_undeclared_import():
  assert _undeclared(_declared() - {"tqdm"}) == {"tqdm": ["composer_jax/console.py"]}
