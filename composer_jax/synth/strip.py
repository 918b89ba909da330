"""The suite run's copy of a hidden test file: the file without the twinned tests' defs.

Why: a canary tells forged results from real ones only where nothing in its process shows the original
test (a canary next to its original is told apart by comparing the two). The hidden files' other tests
(PASS_TO_PASS, tests run as they are) run in the suite run from those files, so for the suite run to hold
canaries too (grading.jobs: every run that reports results the reward counts holds some), its hidden
files lose the defs of the twinned tests and the module tables only they read. Lines keep their numbers
(removed spans become `pass` and blank lines).
"""

import ast

from composer_jax.synth import canary


def _reads(node: ast.AST) -> set[str]:
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store)}


def _span(node: ast.AST) -> tuple[int, int]:
  first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
  return first, node.end_lineno


def _blanked(lines: list[str], spans: list[tuple[int, int, str]]) -> str:
  """`lines` with each 1-based (first, last) span replaced by `pass` at its indent and blank lines (the
  line numbers of everything else stay)."""
  out = list(lines)
  for first, last, indent in spans:
    out[first - 1] = f"{indent}pass\n"
    for i in range(first, last):
      out[i] = "\n"
  return "".join(out)


def strip_units(
  text: str, units: list[canary.Unit], keep_names: set[str]
) -> tuple[str, tuple[canary.Unit, ...]]:
  """(`text` without the defs of `units`, the units stripped). The suite run holds canaries only of tests
  whose original is not in its tree, so it gets the hidden files without them (and without the module
  tables only they read). A unit stays when the file, or another test that runs (`keep_names`: function
  names of the suite's ids, which inheritance keeps), still needs its def or one of its tables."""
  tree = canary.parse(text)
  if tree is None:
    return text, ()
  tables = set(canary.module_tables(tree))
  subclassed = {
    b.id for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for b in c.bases if isinstance(b, ast.Name)
  }
  gone = {
    u: fn
    for u in units
    if u.func not in keep_names and u.cls not in subclassed and (fn := canary.find_def(tree, u.cls, u.func))
  }
  while True:  # a def kept keeps its tables, which may keep another def: until nothing changes
    cut = {id(fn) for fn in gone.values()}
    rest = [n for stmt in tree.body for n in _kept_nodes(stmt, cut)]
    used = set().union(*map(_reads, rest)) | {
      n.attr for r in rest for n in ast.walk(r) if isinstance(n, ast.Attribute)
    }
    stay = [u for u, fn in gone.items() if fn.name in used or _reads(fn) & tables & used]
    if not stay:
      break
    for u in stay:
      del gone[u]
  dropped = set().union(*(_reads(fn) & tables for fn in gone.values())) if gone else set()
  spans = [(*_span(fn), " " * fn.col_offset) for fn in gone.values()]
  spans += [
    (*_span(a), "")
    for a in tree.body
    if isinstance(a, ast.Assign) and canary.module_tables(ast.Module([a], [])).keys() & dropped
  ]
  out = _blanked(text.splitlines(keepends=True), spans)
  return (out, tuple(gone)) if canary.parse(out) is not None else (text, ())


def _kept_nodes(stmt: ast.stmt, cut: set[int]) -> list[ast.AST]:
  """The parts of a module statement that stay: a class without its cut methods, the rest as it is."""
  if id(stmt) in cut:
    return []
  if isinstance(stmt, ast.ClassDef):
    return [*stmt.bases, *stmt.decorator_list, *(s for s in stmt.body if id(s) not in cut)]
  return [stmt]
