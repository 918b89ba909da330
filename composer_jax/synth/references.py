"""Remove-mode reference cleanup: what else must change when a definition is deleted outright.

Why a module of its own: stubbing keeps every name importable, but `remove` deletes one, so every
`from m import name` re-export, `__all__` entry and `x = wrap(name)` alias across the package would break
`import`. Resolving those needs a small import resolver (relative imports, `import *`, aliases) that the
definition-level edits in `deletion` never use; it is kept here so each file reads on its own.
Names are absolute dotted (`pkg.mod.name`); edits are `_text` char ranges, listed per file.
"""

import ast
import pathlib
import re

from composer_jax.synth._text import _drop_elt, _drop_stmt, _offsets, _parents, _parse


def is_test(rel: str) -> bool:
  """Test files are never edited: a removed name they import is a collection break, not a cleanup."""
  p = pathlib.PurePosixPath(rel)
  return bool({"tests", "test", "testing"} & set(p.parts[:-1])) or bool(
    re.match(r"(test_.*|.*_test|conftest)\.py$", p.name)
  )


def module_name(rel: str, roots: list[str]) -> str | None:
  """Dotted module of a file path under one of the import `roots` ("" or "src"); None outside them."""
  for root in roots:
    if root == "" or rel.startswith(root + "/"):
      sub = rel[len(root) + 1 :] if root else rel
      parts = sub[:-3].split("/")
      if parts[-1] == "__init__":
        parts.pop()
      return ".".join(parts)
  return None


def _resolve(module: str, rel: str, level: int, name: str | None) -> str:
  """Absolute module named by `from <level dots><name> import ...` inside `module` (file `rel`)."""
  if level == 0:
    return name or ""
  pkg = module.split(".") if rel.endswith("__init__.py") else module.split(".")[:-1]
  base = pkg[: len(pkg) - level + 1]
  return ".".join([*base, name] if name else base)


def _import_time(node: ast.AST, future_annotations: bool):
  """Yield nodes evaluated when the module is imported (skips function bodies)."""
  if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
    a = node.args
    parts = [*getattr(node, "decorator_list", []), *a.defaults, *(d for d in a.kw_defaults if d)]
    if not future_annotations and not isinstance(node, ast.Lambda):
      args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
      parts += [x.annotation for x in args if x.annotation] + ([node.returns] if node.returns else [])
    for p in parts:
      yield from _import_time(p, future_annotations)
    return
  yield node
  for child in ast.iter_child_nodes(node):
    yield from _import_time(child, future_annotations)


def _dotted(node: ast.AST) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
    return f"{base}.{node.attr}"
  return None


def _bindings(tree: ast.Module, module: str, rel: str) -> dict[str, str]:
  """Local name -> absolute dotted name, for imports and the module's own top-level names."""
  out = {}
  for n in tree.body:
    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
      out[n.name] = f"{module}.{n.name}"
  for n in ast.walk(tree):
    if isinstance(n, ast.Import):
      for a in n.names:
        out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(n, ast.ImportFrom):
      base = _resolve(module, rel, n.level, n.module)
      for a in n.names:
        out[a.asname or a.name] = f"{base}.{a.name}"
  return out


def remove_refs(files, roots, removed: set[str], edits: dict[str, list]) -> list[str]:
  """Clean every package module of names in `removed` (absolute dotted); return test files that break.

  Grows `removed` with re-exported names (`from .core import area` makes `pkg.area` removed too) and
  appends to `edits[rel]`.
  """
  breaks: list[str] = []
  work = sorted(removed)
  while work:
    full = work.pop()
    mod, _, name = full.rpartition(".")
    for rel, text in files.items():
      module = module_name(rel, roots)
      if module is None:
        continue
      tree = _parse(text)
      starts, parents = _offsets(text), _parents(tree)
      hit_test = False
      for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
          base = _resolve(module, rel, n.level, n.module)
          hits = [a for a in n.names if base == mod and a.name == name]
          star = base == mod and any(a.name == "*" for a in n.names) and not name.startswith("_")
          if star and f"{module}.{name}" not in removed:
            removed.add(f"{module}.{name}")
            work.append(f"{module}.{name}")
          if not hits:
            continue
          if is_test(rel):
            hit_test = True
            continue
          bound = hits[0].asname or name
          if len(hits) == len(n.names):
            edits[rel].append(_drop_stmt(text, starts, n, parents[n]))
          else:
            edits[rel].append(_drop_elt(text, starts, hits[0]))
          if f"{module}.{bound}" not in removed:
            removed.add(f"{module}.{bound}")
            work.append(f"{module}.{bound}")
      if hit_test and rel not in breaks:
        breaks.append(rel)
      if module == mod and not is_test(rel):
        edits[rel] += _all_edits(text, starts, tree, parents, name)
  return breaks


def _all_edits(text, starts, tree, parents, name) -> list[tuple[int, int, str]]:
  """Drop `name` from `__all__ = [...]` literals and `__all__.append/remove("name")` statements."""
  out = []
  for n in tree.body:
    tgt = getattr(n, "targets", None) or [getattr(n, "target", None)]
    if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign) and any(
      _dotted(t) == "__all__" for t in tgt
    ):
      for seq in ast.walk(n.value):
        if isinstance(seq, ast.List | ast.Tuple):
          out += [
            _drop_elt(text, starts, e) for e in seq.elts if isinstance(e, ast.Constant) and e.value == name
          ]
    elif (
      isinstance(n, ast.Expr)
      and isinstance(n.value, ast.Call)
      and _dotted(n.value.func) in ("__all__.append", "__all__.remove")
    ):
      if [a.value for a in n.value.args if isinstance(a, ast.Constant)] == [name]:
        out.append(_drop_stmt(text, starts, n, parents[n]))
  return out


def wrapper_aliases(files, roots, removed: set[str], edits) -> bool:
  """`x = wrap(mod.name)` at module level (toolz.curried): drop it and remove `x` too. True if any."""
  grew = False
  for rel, text in files.items():
    module = module_name(rel, roots)
    if module is None or is_test(rel):
      continue
    tree = _parse(text)
    binds, starts, parents = _bindings(tree, module, rel), _offsets(text), _parents(tree)
    for n in tree.body:
      if not (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)):
        continue
      if f"{module}.{n.targets[0].id}" in removed:
        continue
      v = n.value  # only `x = name` and `x = wrap(name, ...)`; anything richer is rejected later
      direct = (
        [v] if isinstance(v, ast.Name | ast.Attribute) else [*v.args] if isinstance(v, ast.Call) else []
      )
      if any(_absolute(x, binds) in removed for x in direct):
        edits[rel].append(_drop_stmt(text, starts, n, parents[n]))
        removed.add(f"{module}.{n.targets[0].id}")
        grew = True
  return grew


def _absolute(node: ast.AST, binds: dict[str, str]) -> str | None:
  d = _dotted(node) if isinstance(node, ast.Name | ast.Attribute) else None
  if d is None:
    return None
  head, _, rest = d.partition(".")
  return binds.get(head, head) + (f".{rest}" if rest else "")


def leftover_uses(rel, text, module, removed: set[str], method: tuple[str, str] | None) -> list[str]:
  """Import-time uses of removed names that would still break `import` after the edits."""
  tree = _parse(text)
  fut = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in tree.body)
  binds = _bindings(tree, module, rel)
  for n in tree.body:  # names removed from this module no longer resolve to themselves
    if (
      isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and f"{module}.{n.name}" in removed
    ):
      binds.pop(n.name, None)
  found = []
  for n in _import_time(tree, fut):
    if isinstance(n, ast.Name | ast.Attribute) and isinstance(n.ctx, ast.Load):
      a = _absolute(n, binds)
      if a in removed or (isinstance(n, ast.Name) and f"{module}.{n.id}" in removed and n.id not in binds):
        found.append(f"{rel}:{n.lineno} uses {a or n.id} at import time")
    if method and isinstance(n, ast.ClassDef) and n.name == method[0]:
      for m in n.body:
        if not isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef):
          for x in _import_time(m, fut):
            if isinstance(x, ast.Name) and x.id == method[1]:
              found.append(f"{rel}:{x.lineno} uses {method[0]}.{method[1]} in the class body")
  return found
