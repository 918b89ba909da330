"""Sandbox overhead per test-suite run: the same command bare vs in `synth.Sandbox` (goal: <= 10 ms).

  python benchmarks/sandbox_overhead.py                 # N=20 per side, the project venv's python
  python benchmarks/sandbox_overhead.py --n=5 --python=/path/to/venv/bin/python

Two workloads: `python -c pass` (process start only; also without the whole-tree meter, as the coding
env's fixed-command tools run) and `python -m pytest -q -p no:cacheprovider` on a 3-test package written
to a temp dir. Bare runs use the sandbox's own environment (`default_env`) and the
same cwd, so the difference is bwrap + prlimit (+ the chown to a throw-away uid when run as root). Runs
alternate bare/sandbox after one warm-up each, so drift in machine load hits both sides alike; the table
reports medians over N and their difference. Wall time is measured around the whole call on both sides.
Needs bubblewrap (`bash .ci/setup`). Run it on a quiet machine: the overhead is a few ms against noise.

  python benchmarks/sandbox_overhead.py --busy=1,2,0.3 --n=3   # the cgroup CPU quota under a busy loop

`--busy`: a two-process busy loop of 3 s wall in the sandbox with each listed quota (`cgroups.CPU_QUOTA`,
CPUs per tree; 2 = no bound on a 2-core machine); prints the tree's CPU seconds per wall second.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from composer_jax.synth import cgroups, sandbox  # noqa: E402

PACKAGE = {
  "tinypkg/__init__.py": "def add(a, b):\n  return a + b\n\n\ndef words(s):\n  return s.split()\n",
  "tests/test_tinypkg.py": (
    "from tinypkg import add, words\n\n\n"
    "def test_add():\n  assert add(1, 2) == 3\n\n\n"
    "def test_words():\n  assert words('a b') == ['a', 'b']\n\n\n"
    "def test_empty():\n  assert words('') == []\n"
  ),
}


def write_package(root: pathlib.Path) -> None:
  for rel, text in PACKAGE.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


def time_bare(cmd: list[str], task_dir: str, env: dict[str, str]) -> float:
  t0 = time.perf_counter()
  r = subprocess.run(cmd, cwd=task_dir, env=env, stdin=subprocess.DEVNULL, capture_output=True, check=False)
  dt = time.perf_counter() - t0
  if r.returncode != 0:
    raise RuntimeError(
      f"bare {cmd} failed ({r.returncode}): {r.stdout.decode()[-500:]}{r.stderr.decode()[-500:]}"
    )
  return dt


def time_sandboxed(box: sandbox.Sandbox, cmd: list[str], task_dir: str, **kw) -> float:
  t0 = time.perf_counter()
  r = box.run(cmd, task_dir, **kw)
  dt = time.perf_counter() - t0
  if r.returncode != 0 or r.timed_out:
    raise RuntimeError(f"sandboxed {cmd} failed ({r.returncode}): {r.stdout[-500:]}{r.stderr[-500:]}")
  return dt


def measure(
  name: str, cmd: list[str], task_dir: str, box: sandbox.Sandbox, env: dict[str, str], n: int, **kw
) -> dict:
  time_bare(cmd, task_dir, env)  # warm-up: page cache, pyc-free imports
  time_sandboxed(box, cmd, task_dir, **kw)
  bare, boxed = [], []
  for _ in range(n):
    bare.append(time_bare(cmd, task_dir, env))
    boxed.append(time_sandboxed(box, cmd, task_dir, **kw))
  mb, ms = statistics.median(bare) * 1e3, statistics.median(boxed) * 1e3
  return {"workload": name, "n": n, "bare_ms": mb, "sandbox_ms": ms, "overhead_ms": ms - mb}


BUSY = "import os, time\npid = os.fork()\nend = time.monotonic() + 3\nwhile time.monotonic() < end:\n  pass\n"
BUSY += "if pid:\n  os.waitpid(pid, 0)\n"


def busy(box: sandbox.Sandbox, python: str, quotas: list[float], n: int) -> None:
  """CPU seconds per wall second of a two-process busy loop, per quota, alternating quotas n times."""
  print(sandbox.limits_statement())
  print("| quota (CPUs) | runs | CPU s / wall s, each run |")
  print("|---|---|---|")
  seen = {q: [] for q in quotas}
  with tempfile.TemporaryDirectory(prefix="sandbox_busy_") as tmp:
    pathlib.Path(tmp, "busy.py").write_text(BUSY)
    for _ in range(n):
      for q in quotas:
        cgroups.CPU_QUOTA = q
        r = box.run([python, "busy.py"], tmp)
        seen[q].append(r.cpu_s / r.wall_s)
  for q, ratios in seen.items():
    print(f"| {q:g} | {len(ratios)} | {', '.join(f'{x:.2f}' for x in ratios)} |")


def main(argv: list[str] | None = None) -> int:
  default_python = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv/bin/python"
  )
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=int, default=20, help="runs per side per workload")
  ap.add_argument("--python", default=default_python if os.path.exists(default_python) else sys.executable)
  ap.add_argument("--busy", default="", help="comma-separated CPU quotas: measure a busy loop under each")
  args = ap.parse_args(argv)
  if not sandbox.available():
    print(sandbox.INSTALL_HINT, file=sys.stderr)
    return 1
  venv = pathlib.Path(args.python).parent.parent  # <venv>/bin/python; not resolved: keep the venv path
  ro = sandbox.venv_paths(venv)
  box = sandbox.Sandbox(readonly_paths=ro, timeout_s=60)
  env = sandbox.default_env(ro, None)
  if args.busy:
    busy(box, str(pathlib.Path(args.python).resolve()), [float(q) for q in args.busy.split(",")], args.n)
    return 0
  rows = []
  with tempfile.TemporaryDirectory(prefix="sandbox_bench_") as tmp:
    write_package(pathlib.Path(tmp))
    rows.append(measure("python -c pass", [args.python, "-c", "pass"], tmp, box, env, args.n))
    light = "python -c pass, tree_limits=False"
    rows.append(measure(light, [args.python, "-c", "pass"], tmp, box, env, args.n, tree_limits=False))
    pytest_cmd = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    rows.append(measure("pytest, 3 tests", pytest_cmd, tmp, box, env, args.n))
  print(
    f"python: {args.python}; uid {os.geteuid()}; {os.cpu_count()} CPUs; N={args.n} per side, alternating\n"
  )
  print(sandbox.limits_statement() + "\n")
  print("| workload | N | bare median ms | sandbox median ms | overhead ms |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['workload']} | {r['n']} | {r['bare_ms']:.1f} | {r['sandbox_ms']:.1f} | {r['overhead_ms']:+.1f} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
