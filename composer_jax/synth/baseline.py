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


def parse_junit(path: str | os.PathLike, root: str | os.PathLike | None = None) -> dict[str, str]:
  """Node id -> outcome from an xunit1 JUnit file. Failure or error anywhere (setup/call/teardown) wins.

  `root`: the directory pytest ran in, to place tests whose function is defined in another file."""
  outcomes: dict[str, str] = {}
  for case in ET.parse(path).getroot().iter("testcase"):
    nodeid = _nodeid(case.get("file"), case.get("classname", ""), case.get("name", ""), root)
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


def _nodeid(file: str | None, classname: str, name: str, root: str | os.PathLike | None = None) -> str:
  """`tests/test_m.py::TestC::test_x[1]` from xunit1's file + dotted classname + name.

  xunit1's `file` is where the test *function* is defined: for a method inherited from a mixin in another
  module (cachetools' `tests/__init__.py` CacheTestMixin) it is not the collecting module, and every
  subclass's test would collapse into one id that pytest cannot select. Then the collecting module is the
  longest dotted prefix of `classname` that is a `.py` file under `root` (without `root`: the parts before
  the first capitalised one).
  """
  if not file:  # collection errors carry no file; keep them distinguishable from real tests
    return f"{classname}::{name}" if classname else name
  module = file[:-3].replace("/", ".") if file.endswith(".py") else file
  if classname == module or classname.startswith(module + "."):
    rest = classname[len(module) :].lstrip(".")
    return "::".join([file, *(rest.split(".") if rest else []), name])
  parts = classname.split(".") if classname else []
  k = None
  if root is not None:
    k = next(
      (i for i in range(len(parts), 0, -1) if pathlib.Path(root, *parts[:i]).with_suffix(".py").is_file()),
      None,
    )
  if k is None:
    k = next((i for i, p in enumerate(parts) if p[:1].isupper()), None)
  if not k:
    return "::".join([file, name])
  return "::".join(["/".join(parts[:k]) + ".py", *parts[k:], name])


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
      outcomes = parse_junit(report, task_dir) if found else {}
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
