"""Delete a feature (a function or method, plus private helpers used only by it) from a package's source.

Why text edits on `ast` line/column spans rather than `ast.unparse`: unparse drops comments and reformats
whole files, so the diff would touch everything and leak the edit's location through style changes. Here
every byte outside the edited spans is kept, and `gold_patch` (the reverse diff) restores the original
exactly. `stub` keeps the interface (decorators, signature, docstring) and raises NotImplementedError;
`remove` deletes the definition and cleans what would break import (`__all__`, `from m import name`
re-exports, `x = wrap(name)` aliases; see `references`), rejecting the deletion when a module-level use
remains.
"""

import ast
import dataclasses
import difflib
import functools
import io
import os
import pathlib
import textwrap
import tokenize

from composer_jax.synth import references
from composer_jax.synth._text import DeletionRejected, _apply, _drop_stmt, _offsets, _parse, _pos

STUB = "raise NotImplementedError"
_ANY = "\0any"
_SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".tox", ".nox", "node_modules"}


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


def py_files(src_dir: pathlib.Path, errors: str = "strict") -> dict[str, str]:
  """Every `.py` file outside VCS/venv/build dirs: rel path -> text."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(src_dir):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
    for f in sorted(filenames):
      if f.endswith(".py"):
        p = pathlib.Path(dirpath, f)
        out[p.relative_to(src_dir).as_posix()] = p.read_text(encoding="utf-8", errors=errors)
  return out


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
  files = py_files(src_dir)
  roots = ["src"] if rel.startswith("src/") else [""]
  files = {r: t for r, t in files.items() if references.module_name(r, roots) is not None}
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
    breaks = references.remove_refs(files, roots, removed, edits)
    while references.wrapper_aliases(files, roots, removed, edits):
      breaks = sorted(set(breaks) | set(references.remove_refs(files, roots, removed, edits)))
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
      if not references.is_test(r):
        problems += references.leftover_uses(
          r, new_files.get(r, files[r]), references.module_name(r, roots), removed, method
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
