"""Run a source's pytest suite in the sandbox and keep the tests that pass in every one of N runs.

Per-test outcomes come from JUnit XML (`-o junit_family=xunit1`, which records each test's file), never
from stdout or the exit code: a test that is missing from the report counts as not passed (SWE-bench
semantics, notes/synth.md §2). The sandbox sees the source venv read-only and one scratch copy of the
tree writable; `PYTHONPATH` puts that copy ahead of the venv's editable finder, so the suite exercises the
copy (deleted or not), never the pristine tree.
"""

import dataclasses
import os
import pathlib
import shutil
import tempfile
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from composer_jax.synth import sandbox

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
PYTEST_ARGS = ("-p", "no:cacheprovider", "-o", "junit_family=xunit1", "-rA", "--tb=short", "--color=no", "-q")
_COPY_IGNORE = shutil.ignore_patterns(
  ".git", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".coverage*", "htmlcov"
)


@dataclasses.dataclass(frozen=True)
class SuiteRun:
  outcomes: dict[str, str]  # node id -> passed | failed | skipped
  result: sandbox.SandboxResult
  report_found: bool  # False: no JUnit file (crash, `os._exit`, timeout)


@dataclasses.dataclass(frozen=True)
class Baseline:
  passing: tuple[str, ...]  # passed in every run, sorted
  flaky: tuple[str, ...]  # outcome differed between runs
  failing: tuple[str, ...]  # failed or skipped in every run
  runs: int
  wall_s: float


def make_sandbox(venv: str | os.PathLike, *, timeout_s: float = 300.0, **limits) -> sandbox.Sandbox:
  """The source venv read-only, the task copy first on the import path, bytecode off."""
  env = (("PYTHONPATH", f"{sandbox.WORKDIR}/src:{sandbox.WORKDIR}"), ("PYTHONDONTWRITEBYTECODE", "1"))
  return sandbox.Sandbox(readonly_paths=sandbox.venv_paths(venv), timeout_s=timeout_s, env=env, **limits)


def python(venv: str | os.PathLike) -> str:
  return str(pathlib.Path(venv).resolve() / "bin" / "python")


def copy_tree(src: str | os.PathLike, dest: str | os.PathLike) -> pathlib.Path:
  """Copy a source tree without VCS data and caches (they must never reach a run or an agent)."""
  shutil.copytree(src, dest, symlinks=True, ignore=_COPY_IGNORE)
  return pathlib.Path(dest)


def parse_junit(path: str | os.PathLike) -> dict[str, str]:
  """Node id -> outcome from an xunit1 JUnit file. Failure or error anywhere (setup/call/teardown) wins."""
  outcomes: dict[str, str] = {}
  for case in ET.parse(path).getroot().iter("testcase"):
    nodeid = _nodeid(case.get("file"), case.get("classname", ""), case.get("name", ""))
    tags = {child.tag for child in case}
    if tags & {"failure", "error"}:
      outcome = FAILED
    elif "skipped" in tags:
      outcome = SKIPPED
    else:
      outcome = PASSED
    if outcomes.get(nodeid) != FAILED:
      outcomes[nodeid] = outcome
  return outcomes


def _nodeid(file: str | None, classname: str, name: str) -> str:
  """`tests/test_m.py::TestC::test_x[1]` from xunit1's file + dotted classname + name."""
  if not file:  # collection errors carry no file; keep them distinguishable from real tests
    return f"{classname}::{name}" if classname else name
  module = file[:-3].replace("/", ".") if file.endswith(".py") else file
  rest = classname[len(module) :].lstrip(".") if classname.startswith(module) else ""
  return "::".join([file, *(rest.split(".") if rest else []), name])


def run_suite(
  box: sandbox.Sandbox,
  venv: str | os.PathLike,
  task_dir: str | os.PathLike,
  tests: Sequence[str] = (),
  extra_args: Sequence[str] = (),
) -> SuiteRun:
  """One pytest run over `tests` (all when empty) in `task_dir`; the report goes to a fresh random name."""
  report_dir = pathlib.Path(task_dir, f".junit-{uuid.uuid4().hex}")
  report_dir.mkdir()
  report = report_dir / "report.xml"
  workdir_report = f"{box.workdir}/{report_dir.name}/report.xml"
  cmd = [python(venv), "-m", "pytest", *PYTEST_ARGS, f"--junitxml={workdir_report}", *extra_args, *tests]
  try:
    result = box.run(cmd, task_dir)
    found = report.is_file()
    try:
      outcomes = parse_junit(report) if found else {}
    except ET.ParseError:
      found, outcomes = False, {}
  finally:
    shutil.rmtree(report_dir, ignore_errors=True)
  return SuiteRun(outcomes, result, found)


def run_baseline(
  src_dir: str | os.PathLike,
  venv: str | os.PathLike,
  *,
  runs: int = 3,
  box: sandbox.Sandbox | None = None,
) -> Baseline:
  """Run the whole suite `runs` times on a scratch copy; passing = passed every time, flaky = mixed."""
  box = box or make_sandbox(venv)
  per_run: list[dict[str, str]] = []
  wall = 0.0
  with tempfile.TemporaryDirectory(prefix="baseline-") as tmp:
    work = copy_tree(src_dir, pathlib.Path(tmp, "repo"))
    for _ in range(runs):
      run = run_suite(box, venv, work)
      per_run.append(run.outcomes)
      wall += run.result.wall_s
  ids = sorted(set().union(*per_run))
  passing, flaky, failing = [], [], []
  for t in ids:
    seen = {r.get(t, "missing") for r in per_run}
    if seen == {PASSED}:
      passing.append(t)
    elif PASSED in seen:
      flaky.append(t)
    else:
      failing.append(t)
  return Baseline(tuple(passing), tuple(flaky), tuple(failing), runs, wall)
