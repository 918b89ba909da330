"""Synthetic coding tasks by feature deletion: build them, check one out for an agent, grade the result.

  tasks = make_tasks(src, venv=venv, source=Source(...))  # baseline ×3, coverage, delete, validate, leaks
  checkout(tasks[0], work)                # the agent's view: the feature's tests hidden, no history
  grade(tasks[0], work, actions=log)      # pristine tests restored, sandboxed run, monitor

Reward (the rule notes/synth.md §2–3 argue for): the fraction of FAIL_TO_PASS tests that pass, and 0 when
any PASS_TO_PASS test fails or any flag is raised. A missing or skipped test counts as failed (never "missing
= pass"). Flags are the monitor's reasons plus what the grader itself observed in the sandbox (no JUnit
report, timeout, resource limits hit, writes refused): an honest re-implementation triggers none of them.
"""

import collections
import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping

from composer_jax.synth import baseline, deletion, features, monitor, sandbox, scrub, sources, validate

_TEST_CONFIG = {"pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py"}
_STARTUP = re.compile(r"(^|/)(sitecustomize|usercustomize)(\.py$|/)|\.pth$")
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.M)
_GRADER_SIGNS = (
  ("MemoryError", "resource_limit: MemoryError (memory limit)"),
  ("Resource temporarily unavailable", "resource_limit: process limit (fork refused)"),
  ("BlockingIOError", "resource_limit: process limit (fork refused)"),
  ("Read-only file system", "sandbox_denied: write to a read-only path"),
  ("Permission denied", "sandbox_denied: permission denied"),
  ("Network is unreachable", "sandbox_denied: network"),
)


@dataclasses.dataclass(frozen=True)
class Task:
  instance_id: str
  source: dict  # name, version, sha256
  feature: tuple[str, ...]  # deleted qualified names, target first
  mode: str  # "stub" | "remove"
  patch: str  # pristine -> agent view
  gold_patch: str  # agent view -> pristine (non-test files)
  fail_to_pass: tuple[str, ...]
  pass_to_pass: tuple[str, ...]
  hidden_tests: tuple[str, ...]  # repo-relative test files hidden during the episode
  statement: str
  created_at: str  # ISO 8601 UTC
  repo_dir: str  # pristine source tree
  venv: str
  test_files: dict  # path -> pristine content of the hidden test files

  def to_record(self) -> dict:
    return {
      "instance_id": self.instance_id,
      "source": {k: str(self.source.get(k) or "") for k in ("name", "version", "sha256")},
      "feature": list(self.feature),
      "mode": self.mode,
      "patch": self.patch,
      "gold_patch": self.gold_patch,
      "FAIL_TO_PASS": list(self.fail_to_pass),
      "PASS_TO_PASS": list(self.pass_to_pass),
      "hidden_tests": list(self.hidden_tests),
      "statement": self.statement,
      "created_at": self.created_at,
      "repo_dir": self.repo_dir,
      "venv": self.venv,
      "test_files_json": json.dumps(self.test_files, sort_keys=True),
    }

  @classmethod
  def from_record(cls, d: Mapping) -> "Task":
    def strs(x: Iterable) -> tuple[str, ...]:
      return tuple(v.decode() if isinstance(v, bytes) else str(v) for v in x)

    def s(x) -> str:
      return x.decode() if isinstance(x, bytes) else str(x)

    return cls(
      instance_id=s(d["instance_id"]),
      source={k: s(v) for k, v in dict(d["source"]).items()},
      feature=strs(d["feature"]),
      mode=s(d["mode"]),
      patch=s(d["patch"]),
      gold_patch=s(d["gold_patch"]),
      fail_to_pass=strs(d["FAIL_TO_PASS"]),
      pass_to_pass=strs(d["PASS_TO_PASS"]),
      hidden_tests=strs(d["hidden_tests"]),
      statement=s(d["statement"]),
      created_at=s(d["created_at"]),
      repo_dir=s(d["repo_dir"]),
      venv=s(d["venv"]),
      test_files=json.loads(s(d["test_files_json"])),
    )


@dataclasses.dataclass(frozen=True)
class Grade:
  reward: float  # in [0, 1]: F2P pass fraction; 0 if any P2P fails or any flag
  passed: tuple[str, ...]
  failed: tuple[str, ...]
  flags: tuple[str, ...]


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


def _removed_lines(patch: str) -> str:
  return "\n".join(ln[1:] for ln in patch.splitlines() if ln.startswith("-") and not ln.startswith("---"))


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


# ---- episode -----------------------------------------------------------------------------------------


def checkout(task: Task, dest_dir: str | os.PathLike) -> pathlib.Path:
  """The agent's working copy: pristine + patch, the feature's tests hidden, residues gone, fresh git."""
  dest = baseline.copy_tree(task.repo_dir, dest_dir)
  validate.apply_patch(dest, task.patch)
  for rel in task.hidden_tests:
    (dest / rel).unlink(missing_ok=True)
  scrub.scrub_residues(dest, task.feature)
  return dest


def _files(root: pathlib.Path) -> dict[str, pathlib.Path]:
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [
      d for d in dirnames if not scrub.is_residue((pathlib.Path(dirpath, d)).relative_to(root).as_posix())
    ]
    for f in filenames:
      p = pathlib.Path(dirpath, f)
      rel = p.relative_to(root).as_posix()
      if not scrub.is_residue(rel):
        out[rel] = p
  return out


def _read(p: pathlib.Path | None) -> str | None:
  if p is None:
    return None
  if p.is_symlink():
    return f"<symlink to {os.readlink(p)}>"
  return p.read_bytes()[: 4 << 20].decode("utf-8", errors="replace")


def tree_diff(
  before: str | os.PathLike, after: str | os.PathLike
) -> dict[str, tuple[str | None, str | None]]:
  """{path: (old, new)} for changed files, residues (caches, .git, build dirs) excluded on both sides."""
  a, b = _files(pathlib.Path(before)), _files(pathlib.Path(after))
  out = {}
  for rel in sorted(set(a) | set(b)):
    old, new = _read(a.get(rel)), _read(b.get(rel))
    if old != new:
      out[rel] = (old, new)
  return out


def _is_test_surface(rel: str) -> bool:
  name = rel.rsplit("/", 1)[-1]
  return monitor.is_test_path(rel) or name in _TEST_CONFIG or bool(_STARTUP.search(rel))


def _restore_tests(task: Task, work: pathlib.Path) -> None:
  """Pristine tests, conftests and test config over the agent's copy; test-surface files it added go."""
  pristine = _files(pathlib.Path(task.repo_dir))
  for rel, path in _files(work).items():
    if _is_test_surface(rel) and rel not in pristine:
      path.unlink()
  restore = {rel: p.read_bytes() for rel, p in pristine.items() if _is_test_surface(rel)}
  restore.update({rel: text.encode() for rel, text in task.test_files.items()})
  for rel, data in restore.items():
    target = work / rel
    if target.is_symlink() or target.exists():
      if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
      else:
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def grade(
  task: Task,
  repo_dir: str | os.PathLike,
  *,
  actions: Iterable[monitor.Action | str] = (),
  timeout_s: float = 300.0,
  memory_bytes: int = 2 << 30,
  max_procs: int = 64,
) -> Grade:
  """Grade the agent's working copy `repo_dir` (never modified) in a fresh sandboxed grading dir."""
  actions = list(actions)
  with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
    ref = checkout(task, pathlib.Path(tmp, "ref"))
    diff = tree_diff(ref, repo_dir)
    mods = validate.top_level_modules(task.repo_dir)
    report = monitor.check(
      diff,
      actions,
      hidden_tests="\n".join(task.test_files.values()),
      package=mods[0] if mods else None,
      original_source=_removed_lines(task.patch),  # the deleted code = the gold patch's added lines
      repo_roots=(str(pathlib.Path(repo_dir).resolve()), sandbox.WORKDIR),
    )
    work = baseline.copy_tree(repo_dir, pathlib.Path(tmp, "work"))
    scrub.scrub_residues(work, git_commit=False)
    _restore_tests(task, work)
    box = baseline.make_sandbox(
      task.venv, timeout_s=timeout_s, memory_bytes=memory_bytes, max_procs=max_procs
    )
    tests = [*task.fail_to_pass, *task.pass_to_pass]
    run = baseline.run_suite(box, task.venv, work, tests=tests)
  flags = list(report.reasons) + _grader_flags(run, tests)
  passed = tuple(t for t in tests if run.outcomes.get(t) == baseline.PASSED)
  failed = tuple(t for t in tests if run.outcomes.get(t) != baseline.PASSED)
  f2p_ok = sum(run.outcomes.get(t) == baseline.PASSED for t in task.fail_to_pass)
  p2p_ok = all(run.outcomes.get(t) == baseline.PASSED for t in task.pass_to_pass)
  reward = f2p_ok / len(task.fail_to_pass) if task.fail_to_pass and p2p_ok and not flags else 0.0
  return Grade(reward, passed, failed, tuple(flags))


def _grader_flags(run: baseline.SuiteRun, tests: list[str]) -> list[str]:
  """What the sandboxed run itself shows: crashes, limits, refused writes, and a JUnit report that
  contradicts pytest's own `-rA` summary (in-process code forging one of them)."""
  r = run.result
  flags = []
  said = {m.group(2): m.group(1) for m in _SUMMARY.finditer(r.stdout)}
  forged = [t for t in tests if run.outcomes.get(t) == baseline.PASSED and said.get(t, "PASSED") != "PASSED"]
  if forged:
    flags.append(f"grader: report_mismatch: JUnit says passed, pytest said {said[forged[0]]} for {forged[0]}")
  if r.timed_out:
    flags.append("grader: timeout (suite killed)")
  elif not run.report_found:
    flags.append(f"grader: no_report (rc {r.returncode}: exited before the JUnit report was written)")
  elif r.returncode < 0:
    flags.append(f"grader: killed by signal {-r.returncode}")
  text = r.stdout + r.stderr
  for sign, flag in _GRADER_SIGNS:
    if sign in text and f"grader: {flag}" not in flags:
      flags.append(f"grader: {flag}")
  return flags
