"""An agent's changes as the monitor reads them: unified diff text or {path: (old, new)} -> FileChanges.

Full texts (the grader's input: old from the task's view, new from the snapshot) let the code rules parse
whole files; diff text alone gives only the added and removed lines, which the rules parse in runs of
consecutive lines. Sides may be bytes: Python sources are then decoded with their own declared encoding
(PEP 263), as the interpreter will decode them, never as UTF-8 by assumption.
"""

import dataclasses
import difflib
import io
import re
import tokenize
from collections.abc import Mapping

MAX_DIFF_LINES = 20_000


@dataclasses.dataclass(frozen=True)
class FileChange:
  """One file of the diff: lines added / removed as (line number, text); `new` is None when deleted."""

  path: str
  added: tuple[tuple[int, str], ...]
  removed: tuple[tuple[int, str], ...]
  deleted: bool = False
  new: str | None = None  # full new text when known (dict input)
  old: str | None = None  # full old text when known
  encoding: str = "utf-8"  # the new side's declared source encoding (Python files)


Diff = str | Mapping[str, tuple[str | bytes | None, str | bytes | None]]


def decode_source(data: str | bytes | None, path: str) -> tuple[str | None, str]:
  """(text, encoding): Python files by their coding cookie / BOM, anything else as UTF-8 (replaced)."""
  if data is None or isinstance(data, str):
    return data, "utf-8"
  if path.endswith(".py"):
    try:
      enc, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
      return data.decode(enc, errors="replace"), enc
    except (SyntaxError, LookupError, UnicodeDecodeError):
      pass
  return data.decode("utf-8", errors="replace"), "utf-8"


def parse_diff(diff: Diff) -> list[FileChange]:
  """Unified diff text, or {path: (old, new)} with None for a missing side, into FileChanges."""
  if isinstance(diff, Mapping):
    return [change_from_texts(path, old, new) for path, (old, new) in diff.items()]
  changes, path, deleted, added, removed = [], None, False, [], []
  old_no = new_no = 0

  def flush():
    if path is not None:
      changes.append(FileChange(path, tuple(added), tuple(removed), deleted))

  lines = diff.splitlines()
  for i, line in enumerate(lines):
    if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
      flush()
      old_path, new_path = _diff_path(line[4:]), _diff_path(lines[i + 1][4:])
      deleted = new_path is None
      path, added, removed = new_path or old_path, [], []
    elif line.startswith("+++ ") and path is not None and not added and not removed:
      continue
    elif line.startswith("@@"):
      m = re.match(r"@@ -(\d+)(?:,\d+)? \+(\d+)", line)
      old_no, new_no = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    elif path is None:
      continue
    elif line.startswith("+"):
      added.append((new_no, line[1:]))
      new_no += 1
    elif line.startswith("-"):
      removed.append((old_no, line[1:]))
      old_no += 1
    elif line.startswith(" ") or line == "":
      old_no, new_no = old_no + 1, new_no + 1
  flush()
  return changes


def _diff_path(text: str) -> str | None:
  text = text.split("\t")[0].strip()
  if text == "/dev/null":
    return None
  return text[2:] if text[:2] in ("a/", "b/") else text


def change_from_texts(path: str, old: str | bytes | None, new: str | bytes | None) -> FileChange:
  old_text, _ = decode_source(old, path)
  new_text, enc = decode_source(new, path)
  added, removed = [], []
  a, b = (old_text or "").splitlines(), (new_text or "").splitlines()
  if max(len(a), len(b)) > MAX_DIFF_LINES:  # difflib is quadratic: a huge file counts as all new
    return FileChange(
      path, tuple(enumerate(b, 1)), tuple(enumerate(a, 1)), new is None, new_text, old_text, enc
    )
  for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
    if tag in ("replace", "delete"):
      removed += [(i + 1, a[i]) for i in range(i1, i2)]
    if tag in ("replace", "insert"):
      added += [(j + 1, b[j]) for j in range(j1, j2)]
  return FileChange(path, tuple(added), tuple(removed), new is None, new_text, old_text, enc)
