"""Per-task preparation of the grader's private checks, once per task and process (cached in memory).

On the original code (the task's pristine library, its hidden tests in place), one sandboxed pytest run
executes the FAIL_TO_PASS tests with the argument recorder on, next to a generated module holding each
twinnable test twice (real and canary, canary.py): real twins must pass there (else the test is run from
its original file at grading), canary cases must fail (only those are kept). One driver run then computes
the original outputs of the recorded calls, twice each (heldout.py). Nothing of this reaches the agent:
the checkout never contains it, and grading runs carry only what a single process needs.
"""

import collections
import dataclasses
import hashlib
import json
import pathlib
import random
import tempfile
import threading

from composer_jax.synth import baseline, canary, heldout, records, runtree, sandbox, snapshot, strip

_CACHE: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()
_CACHE_SIZE = 64


@dataclasses.dataclass(frozen=True)
class Prepared:
  base: runtree.Base
  units: tuple  # canary.Unit whose real twin passes on the original code
  other: tuple  # F2P ids run from their original file (not twinnable, or the twin failed)
  canaries: dict  # unit key -> canary.Canary with at least one valid case
  valid: dict  # unit key -> frozenset of parametrisation keys whose canary fails on the original
  checks: heldout.Checks | None
  notes: tuple
  # The grader's own identities of the twin cases: (unit key, kind) -> {"[params]": parametrisation
  # key} as the original run collected them, and the `extra_key`s of tests a generated module collects
  # besides its twins (e.g. inherited from an imported mixin): expected, never counted.
  cases: dict = dataclasses.field(default_factory=dict)
  extras: frozenset = frozenset()
  # The suite run's hidden files (strip.py): without the defs of the `movable` units (keys), whose canaries
  # may then run in the suite run; checked at preparation to leave the suite's tests passing.
  suite_texts: dict = dataclasses.field(default_factory=dict)
  movable: frozenset = frozenset()


def run_tree(
  box: sandbox.Sandbox, venv: str, files: dict[str, bytes], spec: dict, records: bool = True, **kw
):
  """One runner process over a fresh grader-written tree, copied into the sandbox's tmpfs; (result, its
  records, or None with `records=False`: the caller validates the pipe itself)."""
  with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
    root = pathlib.Path(tmp, "tree")
    snapshot.write_tree(root, files)
    size = sum(len(v) for v in files.values())
    return baseline.run_runner(
      box, venv, root, spec, copy_in=True, task_bytes=max(256 << 20, 4 * size), records=records, **kw
    )


def target(task: records.Task, base: runtree.Base) -> tuple[str, str] | None:
  """(module, qualname) of the task's target function, from the files of the run tree."""
  parts = task.feature[0].split(".")
  for i in range(len(parts) - 1, 0, -1):
    path = "/".join(parts[:i])
    for root in base.roots:
      prefix = f"{root}/" if root else ""
      if f"{prefix}{path}.py" in base.run or f"{prefix}{path}/__init__.py" in base.run:
        return ".".join(parts[:i]), ".".join(parts[i:])
  return None


def idx_key(idx) -> tuple:
  return tuple(tuple(p) for p in idx) if isinstance(idx, list) else ()


def twin_files(files: dict[str, bytes], twins: list, texts: dict[str, str], rng: random.Random):
  """`files` plus one generated module per hidden file with its `twins`; (files, {module: names})."""
  out, names = dict(files), {}
  by_file = collections.defaultdict(list)
  for t in twins:
    by_file[t.unit.file].append(t)
  for rel, group in sorted(by_file.items()):
    src, mapping = canary.generate(texts[rel], group, rng)
    gen = canary.module_name(rel)
    out[gen] = src.encode()
    names[gen] = mapping
  return out, names


def twin_results(recs: list[dict], names: dict) -> dict:
  """{(unit key, kind): {parametrisation key: (outcome, "[params]")}} of one run on the original code (its
  reported indices are trusted here only: the code is the original)."""
  outcomes = baseline.outcomes(recs)
  out = collections.defaultdict(dict)
  for r in recs:
    if r.get("t") != "item" or not isinstance(r.get("id"), str):
      continue
    file, cls, func, params = canary.split_id(r["id"])
    twin = names.get(file, {}).get((cls, func))
    if twin is not None:
      out[(twin.unit.key, twin.kind)][idx_key(r.get("idx"))] = (outcomes.get(r["id"], "missing"), params)
  return out


def extra_key(nodeid: str, names: dict) -> tuple | None:
  """(hidden file, original class, function + params) of a test a generated module collects besides its
  twins (e.g. inherited from an imported mixin, also by a twin's renamed class), None for anything else."""
  gen = nodeid.partition("::")[0]
  mapping = names.get(gen)
  if not mapping:
    return None
  _, cls, func, params = canary.split_id(nodeid)
  if (cls, func) in mapping:
    return None
  renamed = {c: t.unit.cls for (c, _), t in mapping.items() if c}
  return (next(iter(mapping.values())).unit.file, renamed.get(cls, cls), func + params)


def extra_ids(recs: list[dict], names: dict) -> frozenset:
  """`extra_key`s of the items of one run on the original code."""
  keys = (extra_key(r["id"], names) for r in recs if r.get("t") == "item")
  return frozenset(k for k in keys if k is not None)


def prepared(task: records.Task, box: sandbox.Sandbox) -> Prepared:
  blob = json.dumps([task.instance_id, task.repo_dir, task.patch, task.test_files, task.fail_to_pass])
  key = hashlib.sha256(blob.encode()).hexdigest()
  with _LOCK:
    if key in _CACHE:
      _CACHE.move_to_end(key)
      return _CACHE[key]
  p = _prepare(task, box)
  with _LOCK:
    _CACHE[key] = p
    while len(_CACHE) > _CACHE_SIZE:
      _CACHE.popitem(last=False)
  return p


def _prepare(task: records.Task, box: sandbox.Sandbox) -> Prepared:
  base = runtree.make_base(task)
  units, other = canary.units(task.fail_to_pass, task.test_files)
  rng = random.Random(int(hashlib.sha256(task.instance_id.encode()).hexdigest()[:16], 16))
  made = {u.key: _or_none(canary.make_canary, u, task.test_files[u.file], rng) for u in units}
  twins = [canary.Twin(u, "real", canary.def_of(u, task.test_files[u.file])) for u in units]
  twins += [canary.Twin(u, "canary", c.fn, c.extra) for u in units if (c := made[u.key]) is not None]
  trouble = ""
  try:
    files, names = twin_files(base.pristine, twins, task.test_files, rng)
  except (SyntaxError, ValueError, TypeError, AttributeError, RecursionError) as err:  # ast cannot redo it
    files, names, trouble = dict(base.pristine), {}, f"; twins not generated ({type(err).__name__}: {err})"
  spec = {"mode": "pytest", "args": [*task.fail_to_pass, *sorted(names)], "packages": list(base.packages)}
  tgt = target(task, base)
  if tgt is not None:
    spec["record"] = {"module": tgt[0], "qualname": tgt[1], "tests": list(task.fail_to_pass)}
  _, recs = run_tree(box, task.venv, files, spec)
  results = twin_results(recs, names)
  kept, valid, canaries = [], {}, {}
  for u in units:
    reals = results.get((u.key, "real"), {})
    real_ids = {f"{u.key}{params}": outcome for outcome, params in reals.values()}
    if any(real_ids.get(i) != baseline.PASSED for i in u.ids):
      other += list(u.ids)
      continue
    kept.append(u)
    failing = frozenset(k for k, (o, _) in results.get((u.key, "canary"), {}).items() if o != baseline.PASSED)
    if failing:
      valid[u.key], canaries[u.key] = failing, made[u.key]
  cases = {
    (u.key, kind): {params: idx for idx, (_, params) in results.get((u.key, kind), {}).items()}
    for u in kept
    for kind in ("real", "canary")
    if kind == "real" or u.key in canaries
  }
  checks = _checks(task, box, base, tgt, recs)
  suite_texts, movable = _suite_texts(task, box, base, kept, other)
  notes = (f"{len(kept)} twinned tests ({len(canaries)} with canaries), {len(other)} F2P ids run as they are"
           f"{trouble}",
           f"{len(checks.calls) if checks else 0} held-out calls "
           f"({sum(checks.generated) if checks else 0} on generated inputs)",
           f"{len(movable)} twinned tests taken out of the suite run's hidden files")  # fmt: skip
  extras = extra_ids(recs, names)
  return Prepared(
    base, tuple(kept), tuple(other), canaries, valid, checks, notes, cases, extras, suite_texts, movable
  )


def _suite_texts(task, box, base, kept, other) -> tuple[dict, frozenset]:
  """The hidden files for the suite run with the twinned tests' defs taken out (strip.py), kept only if
  the suite's own tests still pass with them on the original code (else the files as they are)."""
  suite_ids = [*task.pass_to_pass, *other]
  keep = {canary.split_id(i)[2] for i in suite_ids}
  texts, movable = {}, set()
  for rel in task.hidden_tests:
    text = task.test_files.get(rel)
    if text is not None:
      texts[rel], gone = strip.strip_units(text, [u for u in kept if u.file == rel], keep)
      movable |= {u.key for u in gone}
  if not movable:
    return {}, frozenset()
  if suite_ids:
    files = base.pristine | {rel: text.encode() for rel, text in texts.items()}
    _, recs = run_tree(box, task.venv, files, {"mode": "pytest", "args": suite_ids})
    got = baseline.outcomes(recs)
    if any(got.get(i) != baseline.PASSED for i in suite_ids):
      return {}, frozenset()
  return texts, frozenset(movable)


def _or_none(fn, *args):
  """A canary when one can be made; odd test code (that ast cannot redo) gets none, not a crash."""
  try:
    return fn(*args)
  except (SyntaxError, ValueError, TypeError, AttributeError, RecursionError):
    return None


def _checks(task, box, base, tgt, recs) -> heldout.Checks | None:
  """Recorded calls (the tests' own inputs) and generated variants of them, kept where the original's
  output is plain (or an exception) and the same twice."""
  if tgt is None:
    return None
  calls, tests = heldout.select_calls(recs, task.fail_to_pass)
  if not calls:
    return None
  rng = random.Random(int(hashlib.sha256(task.instance_id.encode()).hexdigest()[16:32], 16))
  gen_calls, gen_tests = heldout.variants(calls, tests, rng)
  is_method = "." in tgt[1] and all(_is_obj(c["pos"][0]) for c in calls if c["pos"])
  spec = {"mode": "call", "module": tgt[0], "qualname": tgt[1], "calls": [*calls, *gen_calls], "repeat": 2}
  spec |= {"packages": list(base.packages), "self_state": is_method}
  _, out = run_tree(box, task.venv, runtree.without_hidden(base.pristine, task.hidden_tests), spec)
  generated = (False,) * len(calls) + (True,) * len(gen_calls)
  keep = heldout.expected_from(
    out, (*calls, *gen_calls), tuple(zip((*tests, *gen_tests), generated, strict=True)), 2
  )
  calls, pairs, expected = keep
  if not calls:
    return None
  tests, generated = tuple(t for t, _ in pairs), tuple(g for _, g in pairs)
  return heldout.Checks(tgt[0], tgt[1], calls, tests, expected, generated, is_method)


def _is_obj(v) -> bool:
  return isinstance(v, list) and len(v) == 5 and v[0] == "obj"
