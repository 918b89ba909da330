"""SWE-bench-style validation of one deletion (the checks SWE-smith and FeatureBench run on a candidate).

On a scratch copy with the deletion applied: the package imports and the suite collects; the suite's
JUnit outcomes against the baseline give FAIL_TO_PASS (passed before, not now: failed, skipped or missing)
and PASS_TO_PASS (passed both); both must be non-empty. Then the gold patch is applied to that copy and
every F2P and P2P test must pass. The empty patch is the deleted state itself, whose F2P all fail by
construction, so the nop gate holds whenever F2P is non-empty. Rejection reasons are short stable strings
so a `Counter` of them is a yield report.
"""

import dataclasses
import os
import pathlib
import tempfile

from composer_jax.synth import baseline, deletion, features, sandbox, sources


@dataclasses.dataclass(frozen=True)
class Validation:
  ok: bool
  reason: str  # "" when ok
  fail_to_pass: tuple[str, ...] = ()
  pass_to_pass: tuple[str, ...] = ()
  detail: str = ""


def top_level_modules(src_dir: str | os.PathLike) -> list[str]:
  """Importable top-level names of the library (flat or src layout), sorted."""
  src_dir = pathlib.Path(src_dir)
  root = src_dir / "src" if (src_dir / "src").is_dir() else src_dir
  names = []
  for p in sorted(root.iterdir()):
    rel = p.relative_to(src_dir).as_posix()
    if p.is_dir() and (p / "__init__.py").is_file() and features.is_library_file(f"{rel}/__init__.py"):
      names.append(p.name)
    elif p.is_file() and features.is_library_file(rel) and p.stem.isidentifier():
      names.append(p.stem)
  return names


def write_files(root: str | os.PathLike, files: dict[str, str]) -> None:
  for rel, text in files.items():
    path = pathlib.Path(root, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def apply_patch(root: str | os.PathLike, patch: str) -> None:
  """`git apply` a unified diff (paths a/ b/) to a plain directory; raises on a non-applying hunk."""
  if not patch:
    return
  cmd = ["git", "apply", "--whitespace=nowarn", "-p1", "-"]
  sources.run_checked(cmd, "git apply (the patch does not apply)", ValueError, input=patch, cwd=root)


def validate(
  src_dir: str | os.PathLike,
  venv: str | os.PathLike,
  deleted: deletion.Deletion,
  base: baseline.Baseline,
  *,
  box: sandbox.Sandbox | None = None,
  check_gold: bool = True,
) -> Validation:
  """Run the gates in order of cost; the first failing one names the rejection.

  `check_gold=False` skips the gold run here, for callers that grade the gold patch through the full
  grading path instead (`tasks.make_tasks` does: checkout, hidden tests restored, monitor).
  """
  if deleted.collection_breaks:
    return Validation(False, "collection_breaks", detail=", ".join(deleted.collection_breaks))
  box = box or baseline.make_sandbox(venv)
  py = baseline.python(venv)
  with tempfile.TemporaryDirectory(prefix="validate-") as tmp:
    work = baseline.copy_tree(src_dir, pathlib.Path(tmp, "repo"))
    write_files(work, deleted.files)
    mods = top_level_modules(work)
    if mods:
      r = box.run([py, "-c", "import " + ", ".join(mods)], work)
      if r.returncode != 0:
        return Validation(False, "import_breaks", detail=(r.stderr or r.stdout)[-500:])
    after = baseline.run_suite(box, venv, work)
    if after.result.timed_out:
      return Validation(False, "timeout")
    out = after.result.stdout
    if after.result.returncode in (2, 3, 4) or after.collect_errors or not after.report_found:
      return Validation(False, "collection_breaks", detail=", ".join(after.collect_errors) + out[-500:])
    f2p = tuple(t for t in base.passing if after.outcomes.get(t) != baseline.PASSED)
    p2p = tuple(t for t in base.passing if after.outcomes.get(t) == baseline.PASSED)
    if not f2p:
      return Validation(False, "no_f2p", (), p2p)
    if not p2p:
      return Validation(False, "no_p2p", f2p, ())
    if not check_gold:
      return Validation(True, "", f2p, p2p)
    try:
      apply_patch(work, deleted.gold_patch)
    except ValueError as err:
      return Validation(False, "gold_fails", f2p, p2p, detail=str(err))
    gold = baseline.run_suite(box, venv, work, tests=[*f2p, *p2p])
    bad = [t for t in (*f2p, *p2p) if gold.outcomes.get(t) != baseline.PASSED]
    if bad:
      return Validation(False, "gold_fails", f2p, p2p, detail=", ".join(bad[:5]))
  return Validation(True, "", f2p, p2p)
