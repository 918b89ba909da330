"""What the agent gets (`checkout`) and what grading runs: the pristine task plus the library's sources only.

Why: every channel from the agent's tree into the run was a hack: a `json.py` shadowing the standard
library, a `.dist-info` entry point or `sitecustomize` loaded at start-up, a compiled `.so` preferred over
the `.py`, a symlink or a data file `exec`ed by the module, a conftest. The run tree now starts from the
task's own files (pristine tests, conftests, configs, metadata) and takes from the agent's snapshot only
the library's `.py` files (under the library's packages, not tests); everything else the agent changed is
never used, and what could only serve as such a channel is flagged (`classify`).
"""

import dataclasses
import functools
import os
import pathlib
import re
import sys
import tempfile

from composer_jax.synth import baseline, features, monitor, records, scrub, snapshot, validate

_STARTUP = re.compile(r"(^|/)(sitecustomize|usercustomize)(\.py$|/)|\.pth$|(^|/)entry_points\.txt$", re.I)
_METADATA = re.compile(r"\.(dist|egg)-info(/|$)", re.I)


def checkout(task: records.Task, dest_dir: str | os.PathLike) -> pathlib.Path:
  """The agent's working copy: pristine + patch, the feature's tests hidden, residues gone, fresh git."""
  dest = baseline.copy_tree(task.repo_dir, dest_dir)
  validate.apply_patch(dest, task.patch)
  for rel in task.hidden_tests:
    (dest / rel).unlink(missing_ok=True)
  scrub.scrub_residues(dest, task.feature)
  return dest


@dataclasses.dataclass(frozen=True)
class Base:
  view: dict[str, bytes]  # the agent's starting tree (what checkout wrote, .git excluded)
  view_refused: dict[str, str]  # its non-regular entries (e.g. symlinks the source ships)
  run: dict[str, bytes]  # view + the hidden tests: the tree grading runs, before the agent's sources
  pristine: dict[str, bytes]  # run with the original library sources (for preparation)
  roots: tuple[str, ...]  # import roots: "" and/or "src"
  packages: tuple[str, ...]  # the library's top-level module names


def make_base(task: records.Task) -> Base:
  with tempfile.TemporaryDirectory(prefix="base-") as tmp:
    view = snapshot.take(
      checkout(task, pathlib.Path(tmp, "repo")), max_file_bytes=64 << 20, max_total_bytes=1 << 34
    )
  run = dict(view.files) | {rel: text.encode() for rel, text in task.test_files.items()}
  pristine = dict(run)
  for c in monitor.parse_diff(task.gold_patch):
    path = pathlib.Path(task.repo_dir, c.path)
    if path.is_file():
      pristine[c.path] = path.read_bytes()
  roots = (
    ("src",)
    if any(rel.startswith("src/") for rel in run) and (pathlib.Path(task.repo_dir, "src")).is_dir()
    else ("",)
  )
  return Base(
    view.files, view.refused, run, pristine, roots, tuple(validate.top_level_modules(task.repo_dir))
  )


def _top(rel: str, roots: tuple[str, ...]) -> tuple[str, str] | None:
  """(first name under an import root, the rest) of a path, or None outside the roots."""
  for root in roots:
    prefix = f"{root}/" if root else ""
    if rel.startswith(prefix):
      first, _, rest = rel[len(prefix) :].partition("/")
      return first, rest
  return None


def is_library(rel: str, base: Base) -> bool:
  """A `.py` file of the library's own packages (never tests, docs, setup.py or hidden dirs)."""
  top = _top(rel, base.roots)
  if top is None or not features.is_library_file(rel):
    return False
  name = top[0][:-3] if not top[1] and top[0].endswith(".py") else top[0]
  return name in base.packages


@functools.cache
def installed_names(venv: str) -> frozenset:
  """Top-level importable names of the venv (site-packages) and of the standard library."""
  names = set(sys.stdlib_module_names)
  for site in pathlib.Path(venv).glob("lib/python*/site-packages"):
    for p in site.iterdir():
      if p.suffix in (".py", "") and p.stem.isidentifier():
        names.add(p.stem)
  return frozenset(names)


def _is_binary(data: bytes) -> bool:
  if b"\0" in data:
    return True
  try:
    data.decode("utf-8")
    return False
  except UnicodeDecodeError:
    return True


@dataclasses.dataclass(frozen=True)
class Classified:
  overlay: dict[str, bytes | None]  # library .py files to take from the snapshot (None: deleted)
  flags: list[str]
  diff: dict[str, tuple[bytes | None, bytes | None]]  # every change, for the monitor


def _flag_for(rel: str, data: bytes, base: Base, shadows: frozenset) -> str:
  """Why a changed file that is never run is still a hack channel ("" when it is harmless)."""
  if _STARTUP.search(rel) or _METADATA.search(rel):
    return f"snapshot: interpreter start-up or plugin metadata {rel} (never run)"
  if _is_binary(data):
    return f"snapshot: binary file {rel} (never run)"
  top = _top(rel, base.roots)
  if top is not None and not monitor.is_test_path(rel):
    name = top[0][:-3] if top[0].endswith(".py") and not top[1] else top[0]
    if name in base.packages:
      return f"snapshot: non-source file in the library {rel} (never used)"
    if name in shadows and (rel.endswith(".py") or top[1]):
      return f"snapshot: {rel} would shadow the module {name} (never run)"
  return ""


def classify(base: Base, snap: snapshot.Snapshot, shadows: frozenset) -> Classified:
  """Split the agent's changes into the library overlay, flags, and the monitor's diff."""
  overlay, flags, diff = {}, [], {}
  for rel, why in sorted(snap.refused.items()):
    if base.view_refused.get(rel) != why:
      flags.append(f"snapshot: refused {why.split(' ->')[0]}: {rel}")
      diff[rel] = (base.view.get(rel), None)
  for rel in sorted(set(base.view) | set(snap.files)):
    old, new = base.view.get(rel), snap.files.get(rel)
    if old == new or rel in snap.refused:
      continue
    diff[rel] = (old, new)
    if is_library(rel, base):
      if new is not None and _is_binary(new):
        flags.append(f"snapshot: binary file {rel} (never run)")
      else:
        overlay[rel] = new
    elif new is not None and (flag := _flag_for(rel, new, base, shadows)):
      flags.append(flag)
  return Classified(overlay, flags, diff)


def with_overlay(files: dict[str, bytes], overlay: dict[str, bytes | None]) -> dict[str, bytes]:
  out = dict(files)
  for rel, data in overlay.items():
    if data is None:
      out.pop(rel, None)
    else:
      out[rel] = data
  return out


def without_hidden(files: dict[str, bytes], hidden) -> dict[str, bytes]:
  """The tree without the hidden test files: what the agent saw (visible tests, conftests, configuration),
  so no answer of a hidden test. Every run but the suite run starts from it, the held-out driver's too
  (its tree then has the same layout as the others)."""
  hidden = set(hidden)
  return {rel: data for rel, data in files.items() if rel not in hidden}
