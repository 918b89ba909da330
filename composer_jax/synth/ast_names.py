"""What a name in Python source refers to, the way the interpreter will see it.

The code rules match dotted names (`os._exit`, `sys._getframe`), so each expression is resolved through
the module's imports and simple aliases first: `import os as o; o._exit`, `from os import _exit as e`,
`x = os`, `getattr(os, "_exit")`, `__import__("os")`, `importlib.import_module("os")`,
`sys.modules["os"]`. Identifiers come from the parser, which NFKC-normalises them exactly as the
interpreter does, so a homoglyph identifier (fullwidth `ｅｘｅｃ`) *is* `exec` here; string constants
used as names (getattr's) are normalised the same way. What cannot be resolved statically (a computed
attribute name of a sensitive module, `__import__` of a computed name) is itself a finding (dynamic_code).

By resolution, not by name: a dotted name that starts at a standard-library module is followed
through the real module objects (each step looked up in the module's `__dict__`, nothing else run), so
`pathlib.os._exit`, `logging.sys._getframe` or `from tempfile import _os` resolve to the sensitive module
they reach (`os._exit`, `sys._getframe`, `os`); a computed attribute name on any module that reaches a
sensitive one (`getattr(pathlib, "o" + "s")`) is a finding too.
"""

import ast
import functools
import importlib
import sys
import textwrap
import types
import unicodedata

# Modules whose attributes, fetched under a computed name, hide what is called.
SENSITIVE = {
  "os", "sys", "builtins", "__builtins__", "inspect", "gc", "pytest", "_pytest", "importlib", "atexit",
  "signal", "ctypes", "subprocess", "unittest", "traceback", "types", "marshal", "socket", "shutil",
  "multiprocessing", "pty", "threading", "io", "faulthandler", "pathlib", "runpy", "code",
}  # fmt: skip
_IMPORTERS = ("__import__", "importlib.import_module", "builtins.__import__")
# Standard-library modules never imported to resolve a name (side effects at import, or a GUI).
_NO_IMPORT = {"antigravity", "this", "__hello__", "__phello__", "idlelib", "tkinter", "turtle", "turtledemo"}


def _module(name: str) -> types.ModuleType | None:
  """The standard-library module `name` (imported into the grader if need be), or None."""
  if name in sys.modules:
    return sys.modules[name]
  if name.split(".")[0] not in sys.stdlib_module_names or name.split(".")[0] in _NO_IMPORT:
    return None
  try:
    return importlib.import_module(name)
  except Exception:  # noqa: BLE001 (a module that does not import here resolves nothing)
    return None


@functools.lru_cache(maxsize=4096)
def canonical(dotted: str) -> str:
  """`dotted` as the sensitive module it reaches through standard-library module objects, else unchanged:
  `pathlib.os._exit` -> `os._exit`. Only module `__dict__`s are read (no attribute code runs)."""
  parts = dotted.split(".")
  obj = None if parts[0].startswith(".") else _module(parts[0])
  for i, part in enumerate(parts[1:], 1):
    if obj is None:
      return dotted
    nxt = vars(obj).get(part)
    if not isinstance(nxt, types.ModuleType):
      nxt = sys.modules.get(f"{obj.__name__}.{part}")  # a submodule not bound in its parent yet
    if not isinstance(nxt, types.ModuleType):
      return dotted
    if nxt.__name__.split(".")[0] in SENSITIVE and nxt.__name__ != ".".join(parts[: i + 1]):
      return canonical(".".join([nxt.__name__, *parts[i + 1 :]]))
    obj = nxt
  return dotted


@functools.lru_cache(maxsize=1024)
def reaches_sensitive(dotted: str) -> bool:
  """True when `dotted` is a sensitive module, or a standard-library module holding one as an attribute."""
  if dotted.split(".")[0] in SENSITIVE:
    return True
  mod = _module(dotted)
  return mod is not None and any(
    isinstance(v, types.ModuleType) and v.__name__.split(".")[0] in SENSITIVE for v in vars(mod).values()
  )


def norm(name: str) -> str:
  return unicodedata.normalize("NFKC", name)


def parse(text: str) -> ast.Module | None:
  try:
    return ast.parse(text)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return None


def parse_fragment(text: str) -> ast.Module | None:
  """A run of lines out of context: dedented; a dangling block header gets a `pass` body."""
  text = textwrap.dedent(text)
  tree = parse(text)
  if tree is None and text.rstrip().endswith(":"):
    tree = parse(text.rstrip() + " pass")
  return tree


def parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
  return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _const_str(node: ast.AST | None) -> str | None:
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return norm(node.value)
  return None


class Names:
  """Aliases of one module (imports anywhere in it, and `x = <resolvable>` assignments)."""

  def __init__(self, tree: ast.AST):
    self.alias: dict[str, str] = {}
    self.modules: set[str] = set()  # local names bound by `import x`: modules for sure
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        self.modules |= {a.asname or a.name.split(".")[0] for a in node.names}
        for a in node.names:
          self.alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
      elif isinstance(node, ast.ImportFrom):
        base = "." * node.level + (node.module or "")
        for a in node.names:
          self.alias[a.asname or a.name] = f"{base}.{a.name}"
    for _ in range(2):  # one level of `x = y`, then chains of two
      for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
          target = node.targets[0].id
          value = self.resolve(node.value)
          if value and value.split(".")[0] in SENSITIVE | {"exec", "eval", "getattr", "compile", "open"}:
            self.alias[target] = value

  def resolve(self, node: ast.AST) -> str | None:
    """Dotted name an expression refers to, or None."""
    if isinstance(node, ast.Name):
      return canonical(self.alias.get(node.id, node.id))
    if isinstance(node, ast.Attribute):
      base = self.resolve(node.value)
      return canonical(f"{base}.{node.attr}") if base else None
    if isinstance(node, ast.Subscript):
      base = self.resolve(node.value)
      key = _const_str(node.slice)
      if base == "sys.modules" and key:
        return key
      if base in ("builtins.__dict__", "__builtins__") and key:
        return f"builtins.{key}"
      return None
    if isinstance(node, ast.Call):
      return self._resolve_call(node)
    return None

  def _resolve_call(self, node: ast.Call) -> str | None:
    fn = self.resolve(node.func)
    first = node.args[0] if node.args else None
    if fn in _IMPORTERS and (name := _const_str(first)):
      return name
    if fn == "getattr" and len(node.args) >= 2 and (attr := _const_str(node.args[1])):
      base = self.resolve(node.args[0])
      return canonical(f"{base}.{attr}") if base else None
    if fn == "vars" and first is not None:
      return self.resolve(first)
    return None

  def dynamic(self, node: ast.Call) -> str | None:
    """Why a call hides its target (computed module or attribute name), or None."""
    fn = self.resolve(node.func)
    first = node.args[0] if node.args else None
    if fn in _IMPORTERS and first is not None and _const_str(first) is None:
      return f"{fn} of a computed name"
    if fn in ("getattr", "setattr", "delattr") and len(node.args) >= 2 and _const_str(node.args[1]) is None:
      base = self.resolve(node.args[0]) or ""
      # A module outside the standard library (the task's own, whose imports are not inspected here)
      # may hold any sensitive module under any name: a computed attribute of it hides what it reaches.
      opaque = isinstance(node.args[0], ast.Name) and node.args[0].id in self.modules and not _module(base)
      if base and (reaches_sensitive(base) or opaque):
        return f"{fn}({base}, <computed name>)"
    return None
