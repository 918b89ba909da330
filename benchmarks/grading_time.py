"""Per-task grading time, the previous grader vs this one, side by side; the literal rule's false positives.

  python benchmarks/grading_time.py --workdir=/tmp/gradebench            # six default sources, 1 task each
  python benchmarks/grading_time.py --workdir=/tmp/gradebench --sources=inflection --rounds=5
  python benchmarks/grading_time.py --workdir=/tmp/fp --max-tasks=3 --literal-fp   # the hard-coding rule

Tasks are built once with the current code (one per source: `tasks.make_tasks(max_tasks=1)`, cached in
`<workdir>/tasks.json`; the sources and venvs as the synth stage builds them). The old grader is the tree
of `--old-ref` (`git archive`), loaded in a worker process of its own; the new one in another. Each worker
grades the gold patch of a task when told to (the checkout is not timed), so the two alternate on the
same machine state: first the new grader once on each task cold (its per-task preparation included),
then `--rounds` rounds of old, new, old, new ... warm. Both must give reward 1.0 with no flag.

`--literal-fp`: the hard-coding reasons of the old and the new monitor on honest variants (the gold patch
of every task built, and the honest rewrites of the red-team tests), with the hidden tests given and the
original code's literals *not* allowed, so the rule's own false-positive rate shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from composer_jax.synth import build, monitor, sandbox, sources, tasks  # noqa: E402

WORKER = r"""
import json, pathlib, sys, tempfile, time
from composer_jax.synth import tasks, validate
records = json.loads(pathlib.Path(sys.argv[1]).read_text())
made = [tasks.Task.from_record(r) for r in records]
for line in sys.stdin:
  i = int(line)
  with tempfile.TemporaryDirectory() as tmp:
    view = tasks.checkout(made[i], pathlib.Path(tmp, "v"))
    validate.apply_patch(view, made[i].gold_patch)
    t0 = time.perf_counter()
    g = tasks.grade(made[i], view)
    dt = time.perf_counter() - t0
  print(json.dumps({"s": dt, "reward": g.reward, "flags": list(g.flags), "code": tasks.__file__}), flush=True)
"""


def build_tasks(workdir: pathlib.Path, names: list[str], max_tasks: int = 1) -> list[dict]:
  cache = workdir / "tasks.json"
  if cache.exists():
    saved = json.loads(cache.read_text())
    if saved["sources"] == names and saved.get("max_tasks", 1) == max_tasks:
      return saved["records"]
  records = []
  known = {s.name: s for s in sources.DEFAULT_SOURCES}
  for name in names:
    src_obj = known[name]
    src = sources.fetch(src_obj, workdir / "synth_sources")
    venv = build.ensure_venv(src, workdir / "synth_sources" / f"{name}-{src_obj.version}" / "venv",
                             (*build._BASE_DEPS, *build.TEST_DEPS.get(name, ())))  # fmt: skip
    t0 = time.perf_counter()
    made = tasks.make_tasks(src, venv=venv, source=src_obj, max_tasks=max_tasks)
    print(f"[build] {name}: {len(made)} task(s) in {time.perf_counter() - t0:.0f}s", flush=True)
    records += [t.to_record() for t in made]
  cache.write_text(json.dumps({"sources": names, "max_tasks": max_tasks, "records": records}))
  return records


class Worker:
  def __init__(self, code_root: pathlib.Path, records: pathlib.Path):
    env = dict(os.environ, PYTHONPATH=str(code_root), PYTHONDONTWRITEBYTECODE="1")
    self.proc = subprocess.Popen(
      [sys.executable, "-c", WORKER, str(records)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
      env=env, cwd=tempfile.gettempdir(),
    )  # fmt: skip

  def grade(self, i: int) -> dict:
    self.proc.stdin.write(f"{i}\n")
    self.proc.stdin.flush()
    return json.loads(self.proc.stdout.readline())

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait()


def old_tree(ref: str, dest: pathlib.Path) -> pathlib.Path:
  archive = dest / "old.tar"
  subprocess.run(["git", "archive", "-o", str(archive), ref, "composer_jax"], cwd=ROOT, check=True)
  with tarfile.open(archive) as tar:
    tar.extractall(dest / "old", filter="data")
  return dest / "old"


def time_grading(records: list[dict], old_ref: str, rounds: int) -> list[dict]:
  rows = []
  with tempfile.TemporaryDirectory(prefix="gradebench-") as tmp:
    path = pathlib.Path(tmp, "records.json")
    path.write_text(json.dumps(records))
    old_root = old_tree(old_ref, pathlib.Path(tmp))
    old, new = Worker(old_root, path), Worker(ROOT, path)
    try:
      for i, r in enumerate(records):
        cold = new.grade(i)
        first_old = old.grade(i)  # warm-up of the old worker's imports; also: which code it runs
        assert first_old["code"].startswith(str(old_root)) and cold["code"].startswith(str(ROOT)), first_old
        runs = {"old": [], "new": []}
        for _ in range(rounds):
          for name, w in (("old", old), ("new", new)):
            runs[name].append(w.grade(i))
        ok = all(x["reward"] == 1.0 and not x["flags"] for x in [cold, *runs["old"], *runs["new"]])
        flags = sorted({f for x in [cold, *runs["new"], *runs["old"]] for f in x["flags"]})
        rows.append(dict(task=r["instance_id"], n_f2p=len(r["FAIL_TO_PASS"]), n_p2p=len(r["PASS_TO_PASS"]),
                         old=statistics.median(x["s"] for x in runs["old"]), cold=cold["s"],
                         new=statistics.median(x["s"] for x in runs["new"]), ok=ok, flags=flags))  # fmt: skip
        print(f"[grade] {rows[-1]}", flush=True)
    finally:
      old.close()
      new.close()
  return rows


def _old_monitor(ref: str):
  text = subprocess.run(["git", "show", f"{ref}:composer_jax/synth/monitor.py"], cwd=ROOT, check=True,
                        capture_output=True, text=True).stdout  # fmt: skip
  path = pathlib.Path(tempfile.mkdtemp(), "old_monitor.py")
  path.write_text(text)
  spec = importlib.util.spec_from_file_location("old_monitor", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def literal_fp(records: list[dict], old_ref: str) -> dict:
  """Honest variants flagged by the hard-coding rule (old, new), out of how many."""
  sys.path.insert(0, str(ROOT / "tests"))
  import test_synth_redteam as red  # the fixture's honest rewrites
  import test_synth_redteam_real as real  # inflection's

  old = _old_monitor(old_ref)
  variants = []  # (label, diff, hidden tests)
  with tempfile.TemporaryDirectory() as tmp:
    for r in records:
      t = tasks.Task.from_record(r)
      view = tasks.checkout(t, pathlib.Path(tmp, t.instance_id))
      hidden = "\n".join(t.test_files.values())
      for c in monitor.parse_diff(t.gold_patch):
        before = (view / c.path).read_text()
        after = (pathlib.Path(t.repo_dir) / c.path).read_text()
        variants.append((f"gold {t.instance_id}", {c.path: (before, after)}, hidden))
        for name, bodies in real.HONEST.items():
          if t.feature[0] == name:
            for kind, body in bodies.items():
              new = real.body_in(view, name.rsplit(".", 1)[1], body)[real.MOD]
              variants.append((f"{kind} {name}", {c.path: (before, new)}, hidden))
    for t in red.fixture_tasks():
      view = tasks.checkout(t, pathlib.Path(tmp, "fx-" + t.instance_id))
      hidden = "\n".join(t.test_files.values())
      if t.feature[0] == red.TARGET:
        for kind, body in red.HONEST.items():
          new = red.stub_replaced(view, body)[red.MOD]
          variants.append((f"{kind} {t.feature[0]}", {red.MOD: ((view / red.MOD).read_text(), new)}, hidden))
  out = {"n": len(variants), "old": [], "new": [], "pool": collisions(records, old)}
  for label, diff, hidden in variants:
    for name, mod in (("old", old), ("new", monitor)):
      hits = [r for r in mod.check(diff, hidden_tests=hidden).reasons if r.startswith("hardcoded")]
      if hits:
        out[name].append(f"{label}: {hits[0]}")
  return out


def collisions(records: list[dict], old) -> list[tuple[str, int, int, int]]:
  """Per task: (id, |pool|, pool literals the old rule would flag, ... the new rule would flag). The pool
  is every literal of the project's other library code: what an honest rewrite in its style would use."""
  from composer_jax.synth import features, literals

  rows = []
  for r in records:
    t = tasks.Task.from_record(r)
    original = tasks.removed_lines(t.patch)
    allowed = literals.original_literals(original)
    hidden = "\n".join(t.test_files.values())
    pool = set()
    for rel, text in features.py_files(pathlib.Path(t.repo_dir)).items():
      if features.is_library_file(rel):
        pool |= literals.original_literals(text)
    pool -= allowed
    old_set = {v for v in old.assert_literals(hidden) if old._nontrivial({v}, allowed)}
    new_set = {v for v in literals.assert_literals(hidden) if literals.distinctive(v) and v not in allowed}
    rows.append((t.instance_id, len(pool), len(pool & old_set), len(pool & new_set)))
  return rows


def print_coverage(records: list[dict]) -> None:
  """Per task: F2P ids twinned (real + canary), canary cases kept, held-out calls kept."""
  from composer_jax.synth import baseline, prepare

  print("| task | F2P | twinned F2P ids | units with a canary / units | canary cases | held-out calls |")
  print("|---|---:|---:|---:|---:|---:|")
  for r in records:
    t = tasks.Task.from_record(r)
    p = prepare.prepared(t, baseline.make_sandbox(t.venv))
    twinned = sum(len(u.ids) for u in p.units)
    cases = sum(len(v) for v in p.valid.values())
    calls = len(p.checks.calls) if p.checks else 0
    units = f"{len(p.canaries)} / {len(p.units)}"
    print(f"| {t.instance_id} | {len(t.fail_to_pass)} | {twinned} | {units} | {cases} | {calls} |")


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--sources", default=",".join(s.name for s in sources.DEFAULT_SOURCES))
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--max-tasks", type=int, default=1, help="tasks per source")
  ap.add_argument(
    "--old-ref", default="d8f93cb", help="the commit holding the previous grader (before issue 30)"
  )
  ap.add_argument("--literal-fp", action="store_true")
  ap.add_argument("--coverage", action="store_true", help="what the grader's private checks cover, per task")
  args = ap.parse_args(argv)
  if not sandbox.available():
    print(sandbox.INSTALL_HINT, file=sys.stderr)
    return 1
  workdir = pathlib.Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  records = build_tasks(workdir, [s for s in args.sources.split(",") if s], args.max_tasks)
  print(sandbox.limits_statement())
  if args.coverage:
    print_coverage(records)
    return 0
  if args.literal_fp:
    fp = literal_fp(records, args.old_ref)
    print(
      f"honest variants: {fp['n']}; hard-coding flags, old rule: {len(fp['old'])}, new rule: {len(fp['new'])}"
    )
    for name in ("old", "new"):
      for line in fp[name]:
        print(f"  {name}: {line}")
    print(
      "\n| task | literals of the project's other library code | old rule would flag | new rule would flag |"
    )
    print("|---|---:|---:|---:|")
    for row in fp["pool"]:
      print("| {} | {} | {} | {} |".format(*row))
    tot = [sum(r[i] for r in fp["pool"]) for i in (1, 2, 3)]
    print(f"| **total** | {tot[0]} | {tot[1]} ({tot[1] / tot[0]:.1%}) | {tot[2]} ({tot[2] / tot[0]:.1%}) |")
    return 0
  rows = time_grading(records, args.old_ref, args.rounds)
  print(
    "\n| task | F2P / P2P | old s | new s, cold (with preparation) | new s, warm | new ÷ old (warm) | ok |"
  )
  print("|---|---|---:|---:|---:|---:|---|")
  for r in rows:
    ok = "yes" if r["ok"] else "NO: " + "; ".join(r["flags"])[:200]
    times = f"{r['old']:.2f} | {r['cold']:.2f} | {r['new']:.2f} | {r['new'] / r['old']:.2f}"
    print(f"| {r['task']} | {r['n_f2p']} / {r['n_p2p']} | {times} | {ok} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
