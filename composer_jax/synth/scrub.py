"""Remove what would hand the agent the deleted code, and scan what it can see for leftovers.

Residues (each one reproduced as a leak when this was built): bytecode (`marshal.loads` on a `.pyc`
recovers a deleted function in ~5 lines), type-checker and test caches, build/dist copies and egg-info,
coverage data and `htmlcov` (full source), VCS history, `.pyi` stubs, in-tree venvs holding installed
copies. After the scrub, `.git` is recreated with one commit so the agent sees a repo with no history.

The leak scan looks for *distinctive* pieces of the deleted code — whole lines that occur nowhere in the
kept code, and (for bytecode, which holds no source lines) identifiers and string constants that occur
nowhere in it — across every file the agent can read, text or binary.
"""

import ast
import fnmatch
import io
import os
import pathlib
import re
import shutil
import subprocess
import tokenize
from collections.abc import Iterable, Sequence

RESIDUE_DIRS = (
  "__pycache__",
  ".mypy_cache",
  ".dmypy.json",
  ".pytype",
  ".pyre",
  ".pytest_cache",
  ".ruff_cache",
  ".hypothesis",
  ".benchmarks",
  "htmlcov",
  "build",
  "dist",
  ".eggs",
  "pip-wheel-metadata",
  "*.egg-info",
  "*.dist-info",
  ".venv",
  "venv",
  ".tox",
  ".nox",
  ".ipynb_checkpoints",
  "site-packages",
)
RESIDUE_FILES = (
  "*.pyc",
  "*.pyo",
  ".coverage",
  ".coverage.*",
  "coverage.xml",
  "coverage.json",
  "junit*.xml",
  "report.json",
  "*.orig",
  "*.rej",
  "*.patch",
  "*.diff",
  "*~",
  ".*.swp",
)
_COMMON_LINES = {
  "return",
  "return none",
  "return true",
  "return false",
  "return result",
  "pass",
  "else:",
  "try:",
  "finally:",
  "raise",
  "continue",
  "break",
  "yield",
}
MIN_LINE_CHARS = 12
MIN_TOKEN_CHARS = 8
_GIT = ("git", "-c", "user.name=task", "-c", "user.email=task@localhost", "-c", "init.defaultBranch=main")


def is_residue(rel: str) -> bool:
  """Whether a repo-relative path is (inside) a residue, or `.git`."""
  parts = pathlib.PurePosixPath(rel).parts
  if any(p == ".git" or any(fnmatch.fnmatch(p, pat) for pat in RESIDUE_DIRS) for p in parts[:-1]):
    return True
  name = parts[-1] if parts else ""
  return name == ".git" or any(fnmatch.fnmatch(name, pat) for pat in (*RESIDUE_DIRS, *RESIDUE_FILES))


def scrub_residues(
  repo_dir: str | os.PathLike, deleted_names: Sequence[str] = (), *, git_commit: bool = True
) -> list[str]:
  """Delete residues (and `.pyi` files declaring a deleted name); re-init git with one commit.

  `deleted_names` are qualified names (`pkg.mod.func`, `pkg.mod.Class.meth`); a stub declaring the last
  component with `def name(` is removed. Returns the removed repo-relative paths, sorted.
  """
  root = pathlib.Path(repo_dir)
  removed: list[str] = []
  defs = [re.compile(rf"\bdef\s+{re.escape(n.rsplit('.', 1)[-1])}\s*\(") for n in deleted_names]
  for dirpath, dirnames, filenames in os.walk(root, topdown=True):
    here = pathlib.Path(dirpath)
    for d in list(dirnames):
      rel = (here / d).relative_to(root).as_posix()
      if d == ".git" or is_residue(rel):
        _rm(here / d)
        removed.append(rel)
        dirnames.remove(d)
      elif (here / d / ".git").exists() and here != root:
        pass  # nested repos keep their files; their `.git` is caught when walked
    for f in filenames:
      path = here / f
      rel = path.relative_to(root).as_posix()
      drop = f == ".git" or is_residue(rel)
      if not drop and f.endswith(".pyi") and defs:
        text = path.read_text(encoding="utf-8", errors="replace")
        drop = any(p.search(text) for p in defs)
      if drop:
        path.unlink()
        removed.append(rel)
  if git_commit:
    fresh_git(root)
  return sorted(removed)


def _rm(path: pathlib.Path) -> None:
  if path.is_symlink() or not path.is_dir():
    path.unlink()
  else:
    shutil.rmtree(path)


def fresh_git(root: str | os.PathLike) -> None:
  """`git init` + one commit of everything: the agent can diff its work, and finds no history."""
  for cmd in (("init", "-q"), ("add", "-A", "-f", "."), ("commit", "-q", "--allow-empty", "-m", "task")):
    subprocess.run([*_GIT, *cmd], cwd=root, check=True, capture_output=True)


# ---- leak scan ---------------------------------------------------------------------------------------


def _norm(line: str) -> str:
  return line.strip()


def _tokens(text: str) -> set[str]:
  """Identifiers and string-constant contents of `text` (tolerant of fragments that do not tokenize)."""
  out: set[str] = set()
  try:
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if tok.type == tokenize.NAME:
        out.add(tok.string)
      elif tok.type == tokenize.STRING:
        try:
          value = ast.literal_eval(tok.string)
        except (ValueError, SyntaxError):
          continue
        if isinstance(value, str):
          out.add(value)
  except (tokenize.TokenError, IndentationError, SyntaxError):
    out |= set(re.findall(r"[A-Za-z_]\w+", text))
  return out


def needles(deleted_sources: Iterable[str], kept_sources: Iterable[str] = ()) -> tuple[list[str], list[str]]:
  """(distinctive lines, distinctive tokens) of the deleted code, relative to the kept code."""
  kept_texts = list(kept_sources)
  kept_lines = {_norm(ln) for t in kept_texts for ln in t.splitlines()}
  kept_blob = "\n".join(kept_texts)
  lines, tokens = set(), set()
  for src in deleted_sources:
    for ln in src.splitlines():
      n = _norm(ln)
      if len(n) < MIN_LINE_CHARS or n.lower() in _COMMON_LINES or n.startswith(("#", '"""', "'''")):
        continue
      if n in kept_lines or re.fullmatch(r"[\W_]*(\w+[\W_]*){0,2}", n):  # punctuation + ≤2 words: common
        continue
      lines.add(n)
    for tok in _tokens(src):
      if len(tok) >= MIN_TOKEN_CHARS and "\n" not in tok and tok not in kept_blob:
        tokens.add(tok)
  return sorted(lines), sorted(tokens)


def _walk_files(root: pathlib.Path) -> Iterable[pathlib.Path]:
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames.sort()
    for f in sorted(filenames):
      p = pathlib.Path(dirpath, f)
      if p.is_file() and not p.is_symlink():
        yield p


def leak_scan(
  visible_dir: str | os.PathLike,
  deleted_sources: list[str],
  *,
  kept_sources: Iterable[str] = (),
  extra_dirs: Sequence[str | os.PathLike] = (),
  min_hits: int = 2,
) -> list[str]:
  """`path:line` of each distinctive piece of deleted code found in `visible_dir` (lines and tokens) or
  `extra_dirs` (e.g. the venv; lines only — token matches there would mostly be coincidences).

  A file counts only when it holds at least `min(min_hits, #needles)` distinct needles: a real copy or
  bytecode holds most of them, a coincidental idiom one. `kept_sources` (the agent-visible code after the
  deletion) defines what is *not* distinctive.
  """
  lines, tokens = needles(deleted_sources, kept_sources)
  hits: list[str] = []
  targets = [(pathlib.Path(visible_dir), lines + tokens)] + [(pathlib.Path(d), lines) for d in extra_dirs]
  for root, wanted in targets:
    if not wanted:
      continue
    need = min(min_hits, len(wanted))
    encoded = [(w, w.encode()) for w in wanted]
    for path in _walk_files(root):
      try:
        data = path.read_bytes()
      except OSError:
        continue
      found = [data.count(b"\n", 0, i) + 1 for _, b in encoded if (i := data.find(b)) >= 0]
      if len(found) >= need:
        hits += [f"{path}:{n}" for n in sorted(set(found))]
  return hits
