"""Delete a feature (a function or method, plus private helpers used only by it) from a package's source.

Why text edits on `ast` line/column spans rather than `ast.unparse`: unparse drops comments and reformats
whole files, so the diff would touch everything and leak the edit's location through style changes. Here
every byte outside the edited spans is kept, and `gold_patch` (the reverse diff) restores the original
exactly. `stub` keeps the interface (decorators, signature, docstring) and raises NotImplementedError;
`remove` deletes the definition and cleans what would break import (`__all__`, `from m import name`
re-exports, `x = wrap(name)` aliases), rejecting the deletion when a module-level use remains.
"""

import ast
import dataclasses
import difflib
import functools
import io
import os
import pathlib
import re
import textwrap
import tokenize

STUB = "raise NotImplementedError"
_ANY = "\0any"
_parse = functools.lru_cache(maxsize=1024)(ast.parse)  # read-only trees, shared across scans
_SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".tox", ".nox", "node_modules"}


class DeletionRejected(ValueError):
  """The deletion cannot be made safely; the message says why (the task generator counts reasons)."""


@dataclasses.dataclass(frozen=True)
class Deletion:
  feature: list[str]  # qualified names: the target first, then its private helpers
  mode: str
  patch: str  # unified diff, pristine -> task base (apply with `patch -p1`)
  gold_patch: str  # the reverse: task base -> pristine
  files: dict[str, str]  # relative path -> new text, for every changed file
  collection_breaks: list[str] = dataclasses.field(
    default_factory=list
  )  # test files importing a removed name


# ---- spans and text edits ----------------------------------------------------------------------------


def _offsets(text: str) -> list[int]:
  """Char offset of the start of each 1-based line (index 0 unused); one past the end as a sentinel."""
  starts = [0, 0]
  for line in text.splitlines(keepends=True):
    starts.append(starts[-1] + len(line))
  return starts


def _pos(text: str, starts: list[int], lineno: int, col_bytes: int) -> int:
  """`ast` columns count UTF-8 bytes; convert to a char offset into `text`."""
  line = text[starts[lineno] : starts[lineno + 1]]
  return starts[lineno] + len(line.encode()[:col_bytes].decode(errors="ignore"))


def _range(text: str, starts: list[int], node: ast.AST) -> tuple[int, int]:
  return _pos(text, starts, node.lineno, node.col_offset), _pos(
    text, starts, node.end_lineno, node.end_col_offset
  )


def _own_lines(text: str, s: int, e: int) -> tuple[int, int] | None:
  """If [s, e) is alone on its lines (only whitespace or a comment around it), the whole-line range."""
  ls = text.rfind("\n", 0, s) + 1
  le = text.find("\n", e)
  le = len(text) if le < 0 else le + 1
  if text[ls:s].strip() or not re.fullmatch(r"[ \t]*(#[^\n]*)?\n?", text[e:le]):
    return None
  return ls, le


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
  edits = sorted(set(edits))
  for (_, e1, _), (s2, _, _) in zip(edits, edits[1:], strict=False):
    if s2 < e1:
      raise DeletionRejected("overlapping edits")
  for s, e, r in reversed(edits):
    text = text[:s] + r + text[e:]
  return text


@functools.lru_cache(maxsize=1024)
def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
  return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _drop_stmt(text: str, starts: list[int], node: ast.stmt, parent: ast.AST) -> tuple[int, int, str]:
  """Delete a whole statement (with decorators); a block left empty gets `pass` so it still parses."""
  first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
  s = _pos(text, starts, first, 0)
  s = s + len(text[s:]) - len(text[s:].lstrip(" \t"))
  e = _pos(text, starts, node.end_lineno, node.end_col_offset)
  own = _own_lines(text, s, e)
  if own is None:
    raise DeletionRejected(f"line {node.lineno}: statement shares a line with other code")
  body = next(b for f in ("body", "orelse", "finalbody", "handlers") if node in (b := getattr(parent, f, [])))
  if len(body) == 1 and not isinstance(parent, ast.Module):
    return own[0], own[1], text[own[0] : s] + "pass\n"
  return own[0], _eat_blanks(text, *own), ""


def _eat_blanks(text: str, s: int, e: int) -> int:
  """Extend a deleted block's end so the blank lines around it collapse to max(before, after)."""
  before = len(re.search(r"(?:[ \t]*\n)*$", text[:s]).group().splitlines())
  after = re.match(r"(?:[ \t]*\n)*", text[e:]).group().splitlines(keepends=True)
  return e + sum(len(x) for x in after[: min(before, len(after))])


def _drop_elt(text: str, starts: list[int], node: ast.AST) -> tuple[int, int, str]:
  """Delete one element of a list/tuple literal or import-alias list, with its comma."""
  s, e = _range(text, starts, node)
  if m := re.match(r"[ \t]*,[ \t]*", text[e:]):
    e += m.end()
  elif m := re.search(r",[ \t]*$", text[:s]):
    s = m.start()
  own = _own_lines(text, s, e)
  return (own[0], own[1], "") if own else (s, e, "")


# ---- finding definitions -----------------------------------------------------------------------------


def _find(tree: ast.Module, qualname: str) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.AST]:
  """The def for `func` or `Class.method` at module/class level, and its parent."""
  parent: ast.AST = tree
  parts = qualname.split(".")
  for i, part in enumerate(parts):
    want = (ast.FunctionDef, ast.AsyncFunctionDef) if i == len(parts) - 1 else ast.ClassDef
    hits = [n for n in parent.body if isinstance(n, want) and n.name == part]
    if not hits:
      raise DeletionRejected(f"no top-level definition for {qualname!r}")
    if len(hits) > 1:
      raise DeletionRejected(f"{qualname!r} is defined {len(hits)} times (overloads/conditional defs)")
    if i == len(parts) - 1:
      return hits[0], parent
    parent = hits[0]
  raise AssertionError


def _body_start(node: ast.FunctionDef | ast.AsyncFunctionDef, keep_doc: bool) -> ast.stmt | None:
  if keep_doc and ast.get_docstring(node, clean=False) is not None:
    return node.body[1] if len(node.body) > 1 else None
  return node.body[0]


def _def_edits(text: str, tree: ast.Module, qualname: str, mode: str) -> list[tuple[int, int, str]]:
  node, parent = _find(tree, qualname)
  starts = _offsets(text)
  if mode == "remove":
    return [_drop_stmt(text, starts, node, parent)]
  if mode != "stub":
    raise ValueError(f"mode must be 'stub' or 'remove', not {mode!r}")
  first = _body_start(node, keep_doc=True)
  e = _pos(text, starts, node.end_lineno, node.end_col_offset)
  if first is None:  # docstring only: append the raise after it
    doc = node.body[0]
    indent = text[starts[doc.lineno] : _pos(text, starts, doc.lineno, doc.col_offset)]
    if indent.strip():
      return [(e, e, f"; {STUB}")]
    return [(e, e, f"\n{indent}{STUB}")]
  s = _pos(text, starts, first.lineno, first.col_offset)
  indent = text[starts[first.lineno] : s]
  if indent.strip():  # body on the header line (`def f(): return 1`)
    return [(s, e, STUB)]
  return [(starts[first.lineno], e, indent + STUB)]


def delete_function(source_text: str, qualname: str, mode: str = "stub") -> str:
  """Stub or remove `func` / `Class.method` in one module's text; everything else is kept byte for byte."""
  new = _apply(source_text, _def_edits(source_text, ast.parse(source_text), qualname, mode))
  ast.parse(new)
  return new


# ---- package-level analysis --------------------------------------------------------------------------


def _is_test(rel: str) -> bool:
  p = pathlib.PurePosixPath(rel)
  return bool({"tests", "test", "testing"} & set(p.parts[:-1])) or re.match(
    r"(test_.*|.*_test|conftest)\.py$", p.name
  )


def _py_files(src_dir: pathlib.Path) -> dict[str, str]:
  out = {}
  for dirpath, dirnames, filenames in os.walk(src_dir):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
    for f in sorted(filenames):
      if f.endswith(".py"):
        p = pathlib.Path(dirpath, f)
        out[p.relative_to(src_dir).as_posix()] = p.read_text(encoding="utf-8")
  return out


def _module_name(rel: str, roots: list[str]) -> str | None:
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


@functools.lru_cache(maxsize=1024)
def _token_index(text: str) -> dict[str, list[tuple[int, int]]]:
  """NAME tokens and string literals of a file -> their (line, col); cached, files are scanned per name."""
  out: dict[str, list[tuple[int, int]]] = {}
  try:
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if tok.type == tokenize.NAME:
        out.setdefault(tok.string, []).append(tok.start)
      elif tok.type == tokenize.STRING:
        out.setdefault(tok.string.strip("'\"rbuRBU"), []).append(tok.start)
  except (tokenize.TokenError, SyntaxError):
    out[_ANY] = [(0, 0)]  # unreadable file: counts as a reference to everything
  return out


def _name_tokens(text: str, name: str) -> list[tuple[int, int]]:
  """(line, col) of every NAME token `name` and every string literal equal to it (getattr, `__all__`)."""
  idx = _token_index(text)
  return idx.get(name, []) + idx.get(_ANY, [])


def _char_span(text: str, node: ast.AST, body_only: bool) -> tuple[tuple[int, int], tuple[int, int]]:
  """(line, char col) bounds of a def (with decorators) or of its body only."""
  lines = text.splitlines()

  def cc(lineno: int, col: int) -> int:
    return len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))

  if body_only:
    b = node.body[0]
    return (b.lineno, cc(b.lineno, b.col_offset)), (node.end_lineno, cc(node.end_lineno, node.end_col_offset))
  first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
  return (first, 0), (node.end_lineno, cc(node.end_lineno, node.end_col_offset))


def private_helpers(files: dict[str, str], rel: str, qualname: str) -> list[str]:
  """Module-level `_name` functions in `rel` referenced only from the target's body (transitively)."""
  text = files[rel]
  tree = _parse(text)
  target, _ = _find(tree, qualname)
  cands = {
    n.name: n
    for n in tree.body
    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    and n.name.startswith("_")
    and not n.name.endswith("__")
  }
  cands.pop(qualname, None)
  inside = [_char_span(text, target, body_only=True)]
  chosen: list[str] = []
  grew = True
  while grew:
    grew = False
    for name, node in cands.items():
      if name in chosen:
        continue
      own = _char_span(text, node, body_only=False)
      refs = _name_tokens(text, name)
      if any(_name_tokens(t, name) for r, t in files.items() if r != rel):
        continue
      within = [p for p in refs if any(a <= p <= b for a, b in inside)]
      if within and all(any(a <= p <= b for a, b in [*inside, own]) for p in refs):
        chosen.append(name)
        inside.append(_char_span(text, node, body_only=True))
        grew = True
  return chosen


# ---- remove mode: references ----------------------------------------------------------------------


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


def _remove_refs(files, roots, removed: set[str], edits: dict[str, list]) -> list[str]:
  """Clean every package module of names in `removed` (absolute dotted); return test files that break."""
  breaks: list[str] = []
  work = sorted(removed)
  while work:
    full = work.pop()
    mod, _, name = full.rpartition(".")
    for rel, text in files.items():
      module = _module_name(rel, roots)
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
          if _is_test(rel):
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
      if module == mod and not _is_test(rel):
        edits[rel] += _all_edits(text, starts, tree, parents, name)
  return breaks


def _all_edits(text, starts, tree, parents, name) -> list[tuple[int, int, str]]:
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
      and _dotted(n.value.func)
      in (
        "__all__.append",
        "__all__.remove",
      )
    ):
      if [a.value for a in n.value.args if isinstance(a, ast.Constant)] == [name]:
        out.append(_drop_stmt(text, starts, n, parents[n]))
  return out


def _wrapper_aliases(files, roots, removed: set[str], edits) -> bool:
  """`x = wrap(mod.name)` at module level (toolz.curried): drop it and remove `x` too. True if any."""
  grew = False
  for rel, text in files.items():
    module = _module_name(rel, roots)
    if module is None or _is_test(rel):
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


def _leftover_uses(rel, text, module, roots, removed: set[str], method: tuple[str, str] | None) -> list[str]:
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


# ---- the feature -------------------------------------------------------------------------------------


def _diff(rel: str, a: str, b: str) -> str:
  out = []
  for line in difflib.unified_diff(a.splitlines(True), b.splitlines(True), f"a/{rel}", f"b/{rel}"):
    out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
  return "".join(out)


def _locate(src_dir: pathlib.Path, qualname: str) -> tuple[str, str, str]:
  """Split `pkg.mod.Class.meth` into (file relative to src_dir, module name, in-module qualname)."""
  parts = qualname.split(".")
  for root in ("", "src"):
    for i in range(len(parts) - 1, 0, -1):
      base = pathlib.PurePosixPath(root, *parts[:i])
      for rel in (f"{base}.py", f"{base}/__init__.py"):
        if (src_dir / rel).is_file():
          return rel, ".".join(parts[:i]), ".".join(parts[i:])
  raise DeletionRejected(f"no module file for {qualname!r} under {src_dir}")


def delete_feature(
  src_dir: str | os.PathLike, qualname: str, mode: str = "stub", helpers: str | None = None
) -> Deletion:
  """Delete `pkg.mod.func` or `pkg.mod.Class.method` plus its private helpers from a source tree.

  `helpers` ("stub" | "remove" | "keep") defaults to the mode. Nothing is written: the result carries
  the new texts and both patches. Raises DeletionRejected with the reason when unsafe.
  """
  src_dir = pathlib.Path(src_dir)
  rel, module, inner = _locate(src_dir, qualname)
  if len(inner.split(".")) > 2:
    raise DeletionRejected(f"{qualname!r}: nested definitions are not features")
  files = _py_files(src_dir)
  roots = ["src"] if rel.startswith("src/") else [""]
  files = {r: t for r, t in files.items() if _module_name(r, roots) is not None}
  text = files[rel]
  helpers = helpers or mode
  extra = private_helpers(files, rel, inner) if helpers != "keep" else []
  tree = ast.parse(text)
  edits: dict[str, list] = {r: [] for r in files}
  edits[rel] += _def_edits(text, tree, inner, mode)
  for h in extra:
    edits[rel] += _def_edits(text, tree, h, helpers)
  breaks: list[str] = []
  if mode == "remove":
    removed = {f"{module}.{inner}"} | ({f"{module}.{h}" for h in extra} if helpers == "remove" else set())
    breaks = _remove_refs(files, roots, removed, edits)
    while _wrapper_aliases(files, roots, removed, edits):
      breaks = sorted(set(breaks) | set(_remove_refs(files, roots, removed, edits)))
  new_files = {r: _apply(files[r], e) for r, e in edits.items() if e}
  problems = []
  for r, t in new_files.items():
    try:
      ast.parse(t)
    except SyntaxError as err:
      raise DeletionRejected(f"{r} no longer parses: {err}") from err
  if mode == "remove":
    method = tuple(inner.split(".")) if "." in inner else None
    for r in files:
      if not _is_test(r):
        problems += _leftover_uses(
          r, new_files.get(r, files[r]), _module_name(r, roots), roots, removed, method
        )
  if problems:
    raise DeletionRejected("; ".join(problems))
  changed = {r: t for r, t in new_files.items() if t != files[r]}
  return Deletion(
    feature=[qualname, *(f"{module}.{h}" for h in extra)],
    mode=mode,
    patch="".join(_diff(r, files[r], t) for r, t in sorted(changed.items())),
    gold_patch="".join(_diff(r, t, files[r]) for r, t in sorted(changed.items())),
    files=changed,
    collection_breaks=breaks,
  )


def interface(source_text: str, qualname: str) -> str:
  """Decorators, signature and docstring of a definition, dedented: what the agent is told to implement."""
  node, _ = _find(ast.parse(source_text), qualname)
  lines = source_text.splitlines(keepends=True)
  first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
  body0 = node.body[0]
  if body0.lineno == node.lineno:  # one-line def: cut at the body
    head = "".join(lines[first - 1 : node.lineno - 1])
    line = lines[node.lineno - 1].encode()[: body0.col_offset].decode(errors="ignore").rstrip()
    return textwrap.dedent(head + line + "\n")
  end = body0.end_lineno if ast.get_docstring(node, clean=False) is not None else body0.lineno - 1
  return textwrap.dedent("".join(lines[first - 1 : end])).rstrip() + "\n"


def statement(source_text: str, qualname: str, module_path: str, mode: str = "stub") -> str:
  """Task text from the deleted feature's interface (signature + docstring) and where it lives.

  `source_text` is the pristine module text; `qualname` is `func` or `Class.method` within it.
  """
  where = f"`{qualname}` in `{module_path}`"
  state = (
    "Its body currently raises `NotImplementedError`."
    if mode == "stub"
    else "It has been removed from the module; add it back at a sensible place in the file."
  )
  return (
    f"Implement {where}. {state}\n\n"
    f"Interface:\n\n```python\n{interface(source_text, qualname)}```\n\n"
    "Make it behave as the docstring and the rest of the code base imply. Keep the signature and "
    "decorators as shown, do not modify tests or test configuration, and do not use code from outside "
    "the repository. Hidden tests will check the behaviour.\n"
  )
