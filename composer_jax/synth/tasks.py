"""Synthetic coding tasks by feature deletion: build them, check one out for an agent, grade the result.

  tasks = make_tasks(src, venv=venv, source=Source(...))  # baseline ×3, coverage, delete, validate, leaks
  checkout(tasks[0], work)                # the agent's view: the feature's tests hidden, no history
  grade(tasks[0], work, actions=log)      # grading.py: snapshot, pristine run trees, twins, held-out

Reward (the SWE-bench rule, hardened against hacks): the fraction of FAIL_TO_PASS tests that pass, and 0 when
any PASS_TO_PASS test fails or any flag is raised. A missing or skipped test counts as failed (never "missing
= pass"). How grading keeps the reward out of the graded code's reach is in grading.py; the records are in
records.py, the checkout in runtree.py. An honest re-implementation raises no flag.
"""

import collections
import datetime
import hashlib
import os
import pathlib
import tempfile
from collections.abc import Callable, Mapping

from composer_jax.synth import baseline, deletion, features, scrub, sources, validate
from composer_jax.synth.grading import grade
from composer_jax.synth.records import Grade, Task, removed_lines
from composer_jax.synth.runtree import checkout

__all__ = ["Grade", "Task", "checkout", "grade", "make_tasks", "rejection_key"]
_removed_lines = removed_lines  # the name tests and older callers use


# ---- building ----------------------------------------------------------------------------------------


def rejection_key(message: str) -> str:
  """A short stable reason for a DeletionRejected message (which carries paths and line numbers)."""
  keys = (
    ("at import time", "import_time_use"),
    ("in the class body", "class_body_use"),
    ("shares a line", "shared_line"),
    ("is defined", "multiple_definitions"),
    ("nested", "nested"),
    ("no longer parses", "no_parse"),
    ("overlapping", "overlapping_edits"),
    ("no top-level definition", "not_found"),
    ("no module file", "not_found"),
  )
  return "deletion_rejected:" + next((k for s, k in keys if s in message), "other")


def _source_dict(source, src_dir: pathlib.Path) -> dict:
  if source is None:
    return {"name": src_dir.name, "version": "0", "sha256": ""}
  if isinstance(source, sources.Source):
    return {"name": source.name, "version": source.version, "sha256": source.sha256 or ""}
  return {k: str(dict(source).get(k) or "") for k in ("name", "version", "sha256")}


def _visible_texts(root: pathlib.Path) -> list[str]:
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d != ".git"]
    for f in filenames:
      p = pathlib.Path(dirpath, f)
      if not scrub.is_residue(p.relative_to(root).as_posix()) and p.is_file():
        out.append(p.read_text(encoding="utf-8", errors="replace"))
  return out


def make_tasks(
  source_dir: str | os.PathLike,
  *,
  mode: str = "stub",
  max_tasks: int | None = None,
  venv: str | os.PathLike | None = None,
  source: sources.Source | Mapping | None = None,
  progress: Callable[[int, int, str, str], None] | None = None,
  rejections: collections.Counter | None = None,
  runs: int = 3,
  pip_args: tuple[str, ...] = (),
  max_test_fraction: float = 0.5,
  timeout_s: float = 300.0,
  info: dict | None = None,
  on_task: Callable[[Task], None] | None = None,
) -> list[Task]:
  """Baseline ×`runs` → coverage candidates → for each (file, line order): delete → validate → leak scan
  → gold patch graded through `grade` (must score 1.0 with no flag).

  Rejection reasons: `deletion_rejected:<why>`, `collection_breaks`, `import_breaks`, `timeout`, `no_f2p`,
  `no_p2p`, `leak`, `gold_fails`, `gold_flagged` (the monitor flags the original code, so it would flag
  an honest solution too).

  `venv`: the source's venv (`sources.make_venv`); None builds one next to `source_dir` (`<dir>.venv`).
  `progress(i, n, name, status)` is called per candidate with "ok" or the rejection reason; `rejections`
  counts reasons; `info` (if given) receives the baseline (passing / flaky counts and ids); `on_task(task)`
  sees each valid task as soon as it is built (so a caller interrupted mid-source keeps it).
  """
  src = pathlib.Path(source_dir).resolve()
  if venv is None:
    venv = src.with_name(src.name + ".venv")
    if not (venv / "bin" / "python").exists():
      sources.make_venv(src, venv, extras=("pytest", "coverage"), pip_args=pip_args)
  venv = pathlib.Path(venv).resolve()
  rejections = rejections if rejections is not None else collections.Counter()
  meta = _source_dict(source, src)
  box = baseline.make_sandbox(venv, timeout_s=timeout_s)
  base = baseline.run_baseline(src, venv, runs=runs, box=box)
  if info is not None:
    info.update(passing=base.passing, flaky=base.flaky, failing=base.failing, runs=base.runs)
  cands = features.find_features(src, venv, box=box, pip_args=pip_args, max_test_fraction=max_test_fraction)
  created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  tasks: list[Task] = []
  for i, feat in enumerate(cands):
    if max_tasks is not None and len(tasks) >= max_tasks:
      break
    task, reason = _build_one(src, venv, feat, mode, base, box, meta, created)
    if task is None:
      rejections[reason] += 1
    else:
      tasks.append(task)
      if on_task is not None:
        on_task(task)
    if progress is not None:
      progress(i, len(cands), feat.qualname, "ok" if task else reason)
  return tasks


def _build_one(src, venv, feat, mode, base, box, meta, created) -> tuple[Task | None, str]:
  try:
    deleted = deletion.delete_feature(src, feat.qualname, mode)
  except deletion.DeletionRejected as err:
    return None, rejection_key(str(err))
  v = validate.validate(src, venv, deleted, base, box=box, check_gold=False)
  if not v.ok:
    return None, v.reason
  hidden = sorted({t.split("::")[0] for t in v.fail_to_pass if (src / t.split("::")[0]).is_file()})
  pristine = (src / feat.rel).read_text(encoding="utf-8")
  digest = hashlib.sha256(deleted.patch.encode()).hexdigest()[:6]
  task = Task(
    instance_id=f"{meta['name']}-{meta['version']}__featdel__{feat.qualname}__{mode}__{digest}",
    source=meta,
    feature=tuple(deleted.feature),
    mode=mode,
    patch=deleted.patch,
    gold_patch=deleted.gold_patch,
    fail_to_pass=v.fail_to_pass,
    pass_to_pass=v.pass_to_pass,
    hidden_tests=tuple(hidden),
    statement=deletion.statement(pristine, feat.inner, feat.rel, mode),
    created_at=created,
    repo_dir=str(src),
    venv=str(venv),
    test_files={h: (src / h).read_text(encoding="utf-8") for h in hidden},
  )
  with tempfile.TemporaryDirectory(prefix="leak-") as tmp:
    view = checkout(task, pathlib.Path(tmp, "repo"))
    hits = scrub.leak_scan(
      view, [_removed_lines(task.patch)], kept_sources=_visible_texts(view), extra_dirs=[venv]
    )
    if hits:
      return None, "leak"
    # Oracle through the real grading path: the original code must score 1 and raise no monitor flag
    # (a flag on the original would zero honest solutions too).
    validate.apply_patch(view, task.gold_patch)
    g = grade(task, view, timeout_s=box.timeout_s)
  if g.flags:
    return None, "gold_flagged"
  if g.reward != 1.0:
    return None, "gold_fails"
  return task, "ok"
