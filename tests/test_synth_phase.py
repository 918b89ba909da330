"""Red-team, issue 30: a run cannot tell which run of the grade it is, and knowing it would not help.

Observables a run has of its phase (suite, twins, held-out driver): its argv, environment (also as it
started, `/proc/self/environ`), open fds, working directory, uid, limits, hostname, the grader's files,
the modules loaded before its code and the tree's layout. They are the same in every run
(`test_every_run_looks_the_same`). What differs is the work (which tests are collected) and how long a
run waited at its gate, in an order drawn per grade. So a forger that picks the runs it forges in by any
observable (`PHASE_RULES`) meets canaries in every run it forges: a canary whose altered value no code
computes is a flag even when its real twin ran unforged elsewhere.
"""

import dataclasses
import json
import random

import pytest
from test_synth_redteam import INIT, TARGET, fixture_tasks, prepend

from composer_jax.synth import baseline, canary, grading, prepare, records, sandbox, tasks

pytestmark = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap/prlimit not installed")
FINGERPRINT = r"""
import fcntl as _f, json as _j, os as _o, resource as _r, socket as _so, sys as _s
def _fp():
  fds = {}
  for n in sorted(_o.listdir("/proc/self/fd"), key=int):
    try:
      fds[n] = [_o.readlink(f"/proc/self/fd/{n}").split("[")[0], _f.fcntl(int(n), _f.F_GETFL) & 3]
    except OSError:
      pass
  tree = sorted(
    _o.path.join(d, x)
    for d, ds, fs in _o.walk(".")
    for x in ds + [f for f in fs if not (d.endswith("tests") and f.startswith("test_"))]
  )
  limits = [_r.getrlimit(k) for k in (_r.RLIMIT_NOFILE, _r.RLIMIT_NPROC, _r.RLIMIT_AS, _r.RLIMIT_CPU)]
  preloaded = sorted(m for m in _s.modules if m.split(".")[0] in ("pytest", "_pytest", "pluggy"))
  return dict(
    argv=_s.argv, orig_argv=_s.orig_argv, environ=sorted(_o.environ.items()), fds=fds,
    start_environ=open("/proc/self/environ").read(), cwd=_o.getcwd(), host=_so.gethostname(),
    ids=[_o.getpid(), _o.getppid()], limits=limits, tree=tree,  # the uid: drawn at random per run
    grader=sorted(_o.listdir("/.grader")), pytest_modules=preloaded,
  )
_o.write(3, ("FINGERPRINT " + _j.dumps(_fp()) + "\n").encode())
"""
# The forger: rewrites every report the runner sends to "passed", but only in the runs it picks by one
# observable of its phase (`{rule}`: true in the runs to forge). The target itself stays a stub.
FORGER = """
import os as _o, re as _re, sys as _s, time as _t
_C = getattr(_s.modules.get("__main__"), "Channel", None)


def _pick():
  return {rule}


if _C is not None:
  _emit = _C.emit

  def _forged(self, **r):
    if r.get("t") == "rep" and _pick():
      r["outcome"] = "passed"
    _emit(self, **r)

  _C.emit = _forged
"""
_WAITED = (
  "_t.clock_gettime(_t.CLOCK_BOOTTIME) - int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])"
  " / _o.sysconf('SC_CLK_TCK')"
)
PHASE_RULES = {
  # the suite run holds the hidden file and collects the visible tests
  "suite_by_hidden_file": "_o.path.exists('tests/test_totals.py')",
  "suite_by_visible_tests": "any(m.endswith('test_clamp') for m in list(_s.modules))",
  # a twin run collects only generated modules
  "twins_by_generated_modules": (
    "not any(m.endswith('test_clamp') for m in list(_s.modules)) and "
    "any(_re.fullmatch(r'test_[0-9a-f]{12}', m.rsplit('.', 1)[-1]) for m in list(_s.modules))"
  ),
  # the first run of a grade waited at no gate
  "first_by_gate_wait": f"{_WAITED} < 1.0",
  "later_by_gate_wait": f"{_WAITED} >= 1.0",
}


@pytest.fixture(scope="module")
def task():
  return next(t for t in fixture_tasks() if t.feature[0] == TARGET)


def _grade_with(task, tmp_path, monkeypatch, code: str) -> tuple[records.Grade, list[tuple[str, str]]]:
  """Grade the stub with `code` prepended to the package's __init__; (grade, [(role, raw channel)])."""
  prepare.prepared(task, baseline.make_sandbox(task.venv))
  seen, real_run = [], grading._run

  def keep(box, venv, job, gate=None):
    out = real_run(box, venv, job, gate)
    seen.append((job.role, out[0].channel.decode(errors="replace")))
    return out

  monkeypatch.setattr(grading, "_run", keep)
  view = tasks.checkout(task, tmp_path / "agent")
  for rel, text in prepend(view, INIT, code).items():
    (view / rel).write_text(text)
  return tasks.grade(task, view), seen


def test_every_run_looks_the_same(task, tmp_path, monkeypatch):
  g, seen = _grade_with(task, tmp_path, monkeypatch, FINGERPRINT)
  prints = {}
  for role, channel in seen:
    lines = [x for x in channel.splitlines() if x.startswith("FINGERPRINT ")]
    assert len(lines) == 1, (role, channel[-500:])
    prints[role] = json.loads(lines[0].split(" ", 1)[1])
  assert {"suite", "heldout"} <= set(prints) and any(r.startswith("twins") for r in prints), prints.keys()
  first = next(iter(prints.values()))
  for role, fp in prints.items():
    for key in first:
      assert fp[key] == first[key], (role, key, fp[key], first[key])
  assert first["fds"]["3"] == ["pipe:", 1] and "COMPOSER" not in first["start_environ"], first["fds"]
  assert not any("memfd" in link for link, _ in first["fds"].values())
  assert any("pipe: " in f for f in g.flags)  # the probe's own lines are not records: flagged, as ever


def test_the_order_of_runs_is_drawn_per_grade(task):
  prep = prepare.prepared(task, baseline.make_sandbox(task.venv))
  orders = {
    tuple(j.role for j in grading.jobs(task, prep, prep.base.run, random.Random(s))) for s in range(20)
  }
  assert len(orders) > 1 and all(len(set(o)) == len(o) for o in orders), orders


def test_every_run_that_reports_results_holds_a_canary(task):
  prep = prepare.prepared(task, baseline.make_sandbox(task.venv))
  assert prep.movable and all(c.distinct for c in prep.canaries.values()), prep.notes
  for s in range(10):
    for job in grading.jobs(task, prep, prep.base.run, random.Random(s)):
      if job.role != "heldout":
        kinds = {ident[1] for ident in job.expected.values() if ident is not None}
        assert "canary" in kinds, (job.role, job.expected)
        assert not any(t in job.files for t in task.hidden_tests if job.role != "suite")


@pytest.mark.parametrize("rule", sorted(PHASE_RULES))
def test_forging_in_the_runs_a_phase_observable_picks(task, tmp_path, monkeypatch, rule):
  g, _ = _grade_with(task, tmp_path, monkeypatch, FORGER.format(rule=PHASE_RULES[rule]))
  assert g.reward == 0.0 or g.flags, g
  if g.reward or any(o for o in g.passed if o in task.fail_to_pass):
    assert any(f.startswith("canary:") for f in g.flags), g.flags


def test_a_distinct_canary_passing_alone_is_a_flag(task):
  """A run that forges its reports while its units' real twins run unforged elsewhere (the pair never
  passes together): its canaries, whose altered values no code computes, pass alone."""
  prep = prepare.prepared(task, baseline.make_sandbox(task.venv))
  key = next(iter(prep.valid))
  idx = next(iter(prep.valid[key]))
  verdict = grading._Verdict(canaries=[(key, idx)], reals={(key, idx): baseline.FAILED})
  flags = grading._check_flags(task, prep, verdict)
  assert any("no code computes" in f for f in flags), flags
  negated = {key: canary.Canary(prep.canaries[key].fn, (), "negated assertion")}
  flags = grading._check_flags(task, dataclasses.replace(prep, canaries=negated), verdict)
  assert not any(f.startswith("canary:") for f in flags), flags  # a wrong answer may pass a negation
