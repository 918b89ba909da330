"""What a name in Python source refers to, the way the interpreter will see it.

The code rules match dotted names (`os._exit`, `sys._getframe`), so each expression is resolved through
the module's imports and simple aliases first: `import os as o; o._exit`, `from os import _exit as e`,
`x = os`, `getattr(os, "_exit")`, `__import__("os")`, `importlib.import_module("os")`,
`sys.modules["os"]`. Identifiers come from the parser, which NFKC-normalises them exactly as the
interpreter does, so a homoglyph identifier (fullwidth `ｅｘｅｃ`) *is* `exec` here; string constants
used as names (getattr's) are normalised the same way. What cannot be resolved statically (a computed
attribute name of a sensitive module, `__import__` of a computed name) is itself a finding (dynamic_code).
"""

import ast
import textwrap
import unicodedata

# Modules whose attributes, fetched under a computed name, hide what is called.
SENSITIVE = {
  "os", "sys", "builtins", "__builtins__", "inspect", "gc", "pytest", "_pytest", "importlib", "atexit",
  "signal", "ctypes", "subprocess", "unittest", "traceback", "types", "marshal", "socket", "shutil",
  "multiprocessing", "pty", "threading", "io", "faulthandler", "pathlib", "runpy", "code",
}  # fmt: skip
_IMPORTERS = ("__import__", "importlib.import_module", "builtins.__import__")


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
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
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
      return self.alias.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
      base = self.resolve(node.value)
      return f"{base}.{node.attr}" if base else None
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
      return f"{base}.{attr}" if base else None
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
      if base.split(".")[0] in SENSITIVE:
        return f"{fn}({base}, <computed name>)"
    return None
