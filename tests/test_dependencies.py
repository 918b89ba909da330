"""Every third-party package the library imports is declared in pyproject.toml's dependencies: one that
only arrives as another package's dependency is gone the day that package drops it. A package imported
only inside functions may be an optional extra's instead (e.g. tiktoken, extra `tiktoken`): the
library imports without it."""

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


def _names(specs: list[str]) -> set[str]:
  return {_norm(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]) for spec in specs}


def _declared() -> set[str]:
  return _names(_PROJECT["dependencies"])


def _extras() -> set[str]:
  return _names([spec for specs in _PROJECT["optional-dependencies"].values() for spec in specs])


def _imported(node: ast.AST) -> set[str]:
  if isinstance(node, ast.Import):
    return {a.name.split(".")[0] for a in node.names}
  if isinstance(node, ast.ImportFrom) and not node.level and node.module:
    return {node.module.split(".")[0]}
  return set()


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
  """(top-level names imported at module level, those imported inside functions)."""
  tree = ast.parse(path.read_text())
  functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
  inside = {id(node) for f in functions for node in ast.walk(f)}
  every = list(ast.walk(tree))
  module = set().union(*(_imported(n) for n in every if id(n) not in inside))
  lazy = set().union(*(_imported(n) for n in every if id(n) in inside))
  return module, lazy


def _third_party() -> dict[str, dict[str, bool]]:
  """{import name: {file importing it: at module level?}} over the package (and run.py), stdlib and our
  own left out."""
  files = [*sorted((_ROOT / "composer_jax").rglob("*.py")), _ROOT / "run.py"]
  out: dict[str, dict[str, bool]] = {}
  ours = set(sys.stdlib_module_names) | {"composer_jax", "__future__"}
  for path in files:
    rel = path.relative_to(_ROOT).as_posix()
    if rel in _SANDBOXED:
      continue
    module, lazy = _imports(path)
    for name in lazy - ours:
      out.setdefault(name, {})[rel] = False
    for name in module - ours:
      out.setdefault(name, {})[rel] = True
  return out


def _undeclared(declared: set[str], extras: set[str] = frozenset()) -> dict[str, list[str]]:
  """Imports whose package is not declared: in the dependencies, or for an import inside functions only,
  in an optional extra."""
  dists = importlib.metadata.packages_distributions()
  out = {}
  for name, where in _third_party().items():
    packages = {_norm(d) for d in dists.get(name, [name])}
    allowed = declared if any(where.values()) else declared | extras
    if not packages & allowed:
      out[name] = sorted(where)
  return out


def test_every_imported_package_is_declared():
  undeclared = _undeclared(_declared(), _extras())
  assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"


def test_the_check_sees_an_undeclared_import():
  assert _undeclared(_declared() - {"tqdm"}, _extras()) == {"tqdm": ["composer_jax/console.py"]}
  # tiktoken is imported inside a function only: its extra declares it, the dependencies do not.
  assert _undeclared(_declared(), _extras() - {"tiktoken"}) == {
    "tiktoken": ["composer_jax/data/tokenizer.py"]
  }
