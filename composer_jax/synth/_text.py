"""Byte-exact text edits on `ast` spans, shared by `deletion` (definitions) and `references` (imports).

Edits are (start, end, replacement) char ranges applied right to left, so every byte outside them is kept.
"""

import ast
import functools
import re

_parse = functools.lru_cache(maxsize=1024)(ast.parse)  # read-only trees, shared across scans


class DeletionRejected(ValueError):
  """The deletion cannot be made safely; the message says why (the task generator counts reasons)."""


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
