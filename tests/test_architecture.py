"""The shape of the library, checked: no import circles, small files and functions, one module naming
mesh axes, nothing importing the runner. Read from the source (AST), so it costs no jax."""

import ast
import pathlib

import pytest

_PKG = pathlib.Path(__file__).resolve().parents[1] / "composer_jax"
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
_MESH_AXES = ("replica", "fsdp", "context", "expert", "expert_fsdp")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(_PKG.rglob("*.py")):
    parts = path.relative_to(_PKG.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """composer_jax modules `name` imports, at module level or inside functions (lazy imports count:
  a circle through a function-level import is still a circle of responsibilities)."""
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(
          package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
        )
      targets = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    for t in targets:
      while t and t not in known:
        t = t.rpartition(".")[0]
      if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is not a cycle edge
        out.add(t)
  return out


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle, if any (depth-first search with colours)."""
  colour, stack = {}, []

  def visit(node):
    colour[node] = 1
    stack.append(node)
    for nxt in sorted(graph[node]):
      if colour.get(nxt) == 1:
        return stack[stack.index(nxt) :] + [nxt]
      if nxt not in colour and (found := visit(nxt)):
        return found
    colour[node] = 2
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in colour and (found := visit(node)):
      return found
  return None


def test_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
  assert _cycle(_graph()) is None


def test_nothing_imports_the_runner():
  importers = [name for name, deps in _graph().items() if "composer_jax.pipeline" in deps]
  assert importers == [], importers


@pytest.mark.parametrize("path", sorted(_PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(_PKG)))
def test_files_and_functions_are_small(path):
  assert len(path.read_text().splitlines()) <= MAX_FILE_LINES
  long = [
    f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
  ]
  assert long == []


def test_only_sharding_names_mesh_axes():
  """A mesh axis name as a string constant anywhere but sharding.py (and the planner's report, which
  may print them) means a second source of truth for the layout."""
  offenders = []
  for path in sorted(_PKG.rglob("*.py")):
    if path.name == "sharding.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and node.value in ("expert_fsdp", "replica", "fsdp"):
        offenders.append(f"{path.relative_to(_PKG)}:{node.lineno} {node.value!r}")
  assert offenders == []


def test_the_repo_stands_alone():
  """No file points a reader at a design doc or note that lives outside the repository."""
  import re

  root = _PKG.parent
  outside = re.compile(r"\bnotes/\w+\.md|\bDESIGN\.md|\bSTYLE\.md")
  files = [*root.glob("*.md"), *root.glob("*.py"), *root.glob("docs/*.md"), *root.glob("experiments/*.py")]
  files += [*root.glob("benchmarks/*.py"), *root.glob("notebooks/*.ipynb"), *_PKG.rglob("*.py")]
  files += [*root.glob("tests/*.py")]
  hits = [
    f"{p.relative_to(root)}:{i}"
    for p in files
    if p.name != "test_architecture.py"
    for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
    if outside.search(line)
  ]
  assert hits == []
