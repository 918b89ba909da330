"""Run a source's pytest suite in the sandbox and keep the tests that pass in every one of N runs.

Per-test outcomes come from the grader's runner (`runner.py`), which reports pytest's own node ids and
phase outcomes through a pipe held by this process: never from stdout, the exit code or a report file in
the task dir. A test missing from the reports counts as not passed (SWE-bench semantics). The sandbox
sees the source venv read-only and one scratch copy of the tree; the runner appends the copy's import
roots to `sys.path` (after the stdlib and site-packages, where the venv's editable finder points at a path
the sandbox does not contain), so the suite exercises the copy, never the pristine tree.
"""

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Sequence

from composer_jax.synth import pipe, sandbox

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
PYTEST_ARGS = ("-p", "no:cacheprovider", "--tb=short", "--color=no", "-q")  # the coverage run's
RUNNER = pathlib.Path(__file__).with_name("runner.py")
CODEC = RUNNER.with_name("codec.py")  # the runner loads it from its own directory
GRADER_DIR = "/.grader"
_COPY_IGNORE = shutil.ignore_patterns(
  ".git", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".coverage*", "htmlcov"
)


@dataclasses.dataclass(frozen=True)
class SuiteRun:
  outcomes: dict[str, str]  # node id -> passed | failed | skipped
  result: sandbox.SandboxResult
  report_found: bool  # False: the runner never reported its end (crash, `os._exit`, timeout)
  collect_errors: tuple[str, ...] = ()


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


def runner_cmd(venv: str | os.PathLike) -> list[str]:
  """The grader's runner under the venv's interpreter, isolated (`-I`) and without bytecode (`-B`); its
  spec comes through an fd it closes before any code under test runs (no file says which run it is)."""
  return [python(venv), "-I", "-B", f"{GRADER_DIR}/runner.py"]


@functools.cache
def venv_plugins(venv: str) -> tuple[str, ...]:
  """Modules of the pytest plugins installed in the venv (`pytest11` entry points), for explicit `-p`."""
  found = []
  for ep in pathlib.Path(venv).glob("lib/python*/site-packages/*.dist-info/entry_points.txt"):
    section = ""
    for line in ep.read_text(encoding="utf-8", errors="replace").splitlines():
      line = line.strip()
      if line.startswith("["):
        section = line.strip("[]").strip()
      elif section == "pytest11" and "=" in line:
        found.append(line.split("=", 1)[1].split(":")[0].strip())
  return tuple(sorted(set(found)))


def parse_channel(data: bytes) -> list[dict]:
  """The runner's valid records (pipe.py); anything else, e.g. bytes the code under test wrote, dropped."""
  return pipe.parse(data).records


def outcomes(records: Sequence[dict]) -> dict[str, str]:
  """Node id -> passed | failed | skipped from the phase reports; a failure in any phase wins."""
  out: dict[str, str] = {}
  for r in records:
    if r.get("t") != "rep" or not isinstance(r.get("id"), str):
      continue
    nodeid, outcome = r["id"], r.get("outcome")
    if outcome == "failed":
      out[nodeid] = FAILED
    elif outcome == "skipped" and out.get(nodeid) != FAILED:
      out[nodeid] = SKIPPED
    elif outcome == "passed" and r.get("when") == "call" and nodeid not in out:
      out[nodeid] = PASSED
  return out


def run_runner(
  box: sandbox.Sandbox,
  venv: str | os.PathLike,
  task_dir: str | os.PathLike,
  spec: dict,
  records: bool = True,
  **overrides,
) -> tuple[sandbox.SandboxResult, list[dict] | None]:
  """One run of `runner.py` with `spec` (roots and plugins filled in); (result, channel records)."""
  spec = {"roots": [f"{box.workdir}/src", box.workdir], "plugins": list(venv_plugins(str(venv))), **spec}
  binds = {str(RUNNER): f"{GRADER_DIR}/runner.py", str(CODEC): f"{GRADER_DIR}/codec.py"}
  inputs = json.dumps(spec).encode()
  result = box.run(runner_cmd(venv), task_dir, binds=binds, channel=True, inputs=inputs, **overrides)
  return result, parse_channel(result.channel) if records else None


def run_suite(
  box: sandbox.Sandbox,
  venv: str | os.PathLike,
  task_dir: str | os.PathLike,
  tests: Sequence[str] = (),
  extra_args: Sequence[str] = (),
) -> SuiteRun:
  """One pytest run over `tests` (all when empty) in `task_dir`; outcomes from the runner's channel."""
  result, records = run_runner(box, venv, task_dir, {"mode": "pytest", "args": [*extra_args, *tests]})
  errors = tuple(r["id"] for r in records if r["t"] == "cerr" and isinstance(r.get("id"), str))
  found = any(r["t"] == "end" for r in records)
  return SuiteRun(outcomes(records), result, found, errors)


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
