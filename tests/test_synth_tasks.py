"""Feature-deletion tasks end to end on a small fixture repository: build, validate, check out, grade.

The fixture package has four tested functions (one with a private helper), one function run at import
time, a flaky test and a test module that imports a function by name (so deleting that function outright
breaks collection). Its editable venv is built once per machine (offline: the local wheel index, setuptools
from the venv) and reused across test modules and runs.
"""

import collections
import fcntl
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from composer_jax.synth import baseline, deletion, features, sandbox, scrub, sources, tasks, validate

pytestmark = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap/prlimit not installed")

FIXTURE = {
  "pyproject.toml": """
    [build-system]
    requires = ["setuptools>=64"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "featpkg"
    version = "0.1"

    [tool.setuptools]
    packages = ["featpkg"]
  """,
  "featpkg/__init__.py": """
    from featpkg.mathx import clamp_between, running_totals
    from featpkg.text import count_vowels, slugify_words
  """,
  "featpkg/text.py": '''
    """Text helpers."""

    VOWELS = "aeiou"


    def make_vowel_table(extra=""):
      """Vowel lookup table (built at import time)."""
      table = set(VOWELS + extra)
      return frozenset(table)


    VOWEL_TABLE = make_vowel_table()


    def slugify_words(text, sep="-"):
      """Lower-case alphanumeric words of `text` joined by `sep`."""
      pieces = _split_alnum_chunks(text)
      return sep.join(piece.lower() for piece in pieces)


    def _split_alnum_chunks(text):
      chunks, current_chunk = [], ""
      for character in text:
        if character.isalnum():
          current_chunk += character
        elif current_chunk:
          chunks.append(current_chunk)
          current_chunk = ""
      if current_chunk:
        chunks.append(current_chunk)
      return chunks


    def count_vowels(text):
      """Number of vowels in `text`."""
      return sum(1 for letter in text.lower() if letter in VOWEL_TABLE)
  ''',
  "featpkg/mathx.py": '''
    """Number helpers."""


    def clamp_between(value, low, high):
      """`value` limited to [low, high]."""
      if value < low:
        return low
      if value > high:
        return high
      return value


    def running_totals(values):
      """Prefix sums of `values`."""
      accumulated_total = 0
      prefix_sums = []
      for item in values:
        accumulated_total += item
        prefix_sums.append(accumulated_total)
      return prefix_sums
  ''',
  "tests/test_slugify.py": """
    import featpkg


    def test_slugify_basic():
      assert featpkg.slugify_words("Hello, World!") == "hello-world"


    def test_slugify_sep():
      assert featpkg.slugify_words("a b  c", sep="_") == "a_b_c"
  """,
  "tests/test_vowels.py": """
    import featpkg


    def test_count_vowels():
      assert featpkg.count_vowels("Education") == 5
  """,
  "tests/test_clamp.py": """
    from featpkg.mathx import clamp_between


    def test_clamp():
      assert [clamp_between(v, 0, 10) for v in (-5, 5, 50)] == [0, 5, 10]
  """,
  "tests/test_totals.py": """
    import featpkg


    def test_running_totals():
      assert featpkg.running_totals([1, 2, 3, 4]) == [1, 3, 6, 10]


    def test_running_totals_empty():
      assert featpkg.running_totals([]) == []
  """,
  "tests/test_flaky.py": """
    import pathlib


    def test_flaky():
      state = pathlib.Path(__file__).with_name("flaky_state")
      n = int(state.read_text()) + 1 if state.exists() else 1
      state.write_text(str(n))
      assert n % 2 == 1
  """,
}
FEATURES = {
  "featpkg.text.slugify_words",
  "featpkg.text.count_vowels",
  "featpkg.mathx.clamp_between",
  "featpkg.mathx.running_totals",
}


def write_fixture(root: pathlib.Path) -> pathlib.Path:
  for rel, text in FIXTURE.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
  return root


def fixture_env() -> tuple[pathlib.Path, pathlib.Path]:
  """(source dir, venv) of the fixture, built once per content hash under the system temp dir."""
  key = hashlib.sha256(json.dumps([FIXTURE, sys.version], sort_keys=True).encode()).hexdigest()[:12]
  root = pathlib.Path(tempfile.gettempdir(), "composer_jax_synth_fixture", key)
  root.mkdir(parents=True, exist_ok=True)
  src, venv = root / "src", root / "venv"
  with open(root / ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (root / "ready").exists():
      for p in (src, venv):
        shutil.rmtree(p, ignore_errors=True)
      write_fixture(src)
      # Offline-friendly: a setuptools new enough for PEP 660 editables without `wheel`, no isolation.
      sources.make_venv(
        src, venv, extras=("pytest", "coverage", "setuptools>=70.1"), pip_args=("--no-build-isolation",)
      )
      (root / "ready").write_text("ok")
  return src, venv


@pytest.fixture(scope="module")
def built():
  src, venv = fixture_env()
  rejections, info, seen = collections.Counter(), {}, []
  made = tasks.make_tasks(
    src,
    venv=venv,
    source={"name": "featpkg", "version": "0.1", "sha256": ""},
    rejections=rejections,
    info=info,
    progress=lambda i, n, name, status: seen.append((name, status)),
  )
  return dict(src=src, venv=venv, tasks=made, rejections=rejections, info=info, seen=seen)


def by_feature(made, name):
  return next(t for t in made if t.feature[0] == name)


def test_tasks_generated_and_validated(built):
  made = built["tasks"]
  assert {t.feature[0] for t in made} == FEATURES, built["seen"]
  slug = by_feature(made, "featpkg.text.slugify_words")
  assert slug.feature == ("featpkg.text.slugify_words", "featpkg.text._split_alnum_chunks")
  assert slug.fail_to_pass == (
    "tests/test_slugify.py::test_slugify_basic",
    "tests/test_slugify.py::test_slugify_sep",
  )
  assert "tests/test_totals.py::test_running_totals" in slug.pass_to_pass
  assert slug.hidden_tests == ("tests/test_slugify.py",)
  assert slug.test_files["tests/test_slugify.py"] == (built["src"] / "tests/test_slugify.py").read_text()
  assert 'def slugify_words(text, sep="-"):' in slug.statement and "raise NotImplementedError" in slug.patch
  for t in made:
    assert t.fail_to_pass and t.pass_to_pass and not set(t.fail_to_pass) & set(t.pass_to_pass)
    assert "tests/test_flaky.py::test_flaky" not in t.fail_to_pass + t.pass_to_pass
    assert t.created_at.endswith("+00:00") and t.mode == "stub"
  # Run at import time: never a candidate even though every test exercises it.
  assert not any("make_vowel_table" in n for t in made for n in t.feature)


def test_flaky_dropped_by_baseline(built):
  info = built["info"]
  assert info["flaky"] == ("tests/test_flaky.py::test_flaky",)
  assert "tests/test_flaky.py::test_flaky" not in info["passing"] and len(info["passing"]) == 6


def test_record_roundtrip(built):
  t = built["tasks"][0]
  rec = t.to_record()
  assert set(rec) == {
    "instance_id", "source", "feature", "mode", "patch", "gold_patch", "FAIL_TO_PASS", "PASS_TO_PASS",
    "hidden_tests", "statement", "created_at", "repo_dir", "venv", "test_files_json",
  }  # fmt: skip
  assert set(rec["source"]) == {"name", "version", "sha256"} and isinstance(rec["test_files_json"], str)
  assert tasks.Task.from_record(json.loads(json.dumps(rec))) == t


def test_checkout_hides_tests_and_history(built, tmp_path):
  t = by_feature(built["tasks"], "featpkg.mathx.running_totals")
  view = tasks.checkout(t, tmp_path / "view")
  assert not (view / "tests/test_totals.py").exists() and (view / "tests/test_slugify.py").exists()
  assert "raise NotImplementedError" in (view / "featpkg/mathx.py").read_text()
  log = subprocess.run(["git", "log", "--all", "--oneline"], cwd=view, capture_output=True, text=True)
  assert len(log.stdout.splitlines()) == 1
  assert not list(view.rglob("__pycache__")) and not list(view.rglob("*.pyc"))


def _solve_with_gold(task, dest):
  view = tasks.checkout(task, dest)
  validate.apply_patch(view, task.gold_patch)
  return view


def test_gold_patch_scores_one(built, tmp_path):
  for t in built["tasks"]:
    g = tasks.grade(t, _solve_with_gold(t, tmp_path / t.feature[0]))
    assert g.reward == 1.0 and not g.flags and not g.failed, (t.feature, g)


def test_untouched_checkout_scores_zero(built, tmp_path):
  t = by_feature(built["tasks"], "featpkg.text.slugify_words")
  g = tasks.grade(t, tasks.checkout(t, tmp_path / "view"))
  assert g.reward == 0.0 and set(t.fail_to_pass) <= set(g.failed) and not g.flags


def test_partial_solution_partial_reward(built, tmp_path):
  t = by_feature(built["tasks"], "featpkg.text.slugify_words")
  view = tasks.checkout(t, tmp_path / "view")
  mod = view / "featpkg/text.py"
  text = mod.read_text()
  j = text.index("raise NotImplementedError", text.index("def slugify_words"))
  mod.write_text(
    text[:j] + "return sep.join(text.lower().split())" + text[j + len("raise NotImplementedError") :]
  )
  g = tasks.grade(t, view)
  assert g.reward == 0.5 and "tests/test_slugify.py::test_slugify_sep" in g.passed and not g.flags, g


def test_collection_breaking_deletion_rejected(built):
  d = deletion.delete_feature(built["src"], "featpkg.mathx.clamp_between", "remove")
  base = baseline.Baseline(built["info"]["passing"], (), (), 1, 0.0)
  v = validate.validate(built["src"], built["venv"], d, base)
  assert (v.ok, v.reason) == (False, "collection_breaks") and "tests/test_clamp.py" in v.detail
  assert tasks.rejection_key("featpkg/x.py:3 uses a.b at import time") == "deletion_rejected:import_time_use"


def test_import_breaking_deletion_rejected(built, tmp_path):
  # A package that no longer imports is rejected before the suite runs.
  src = baseline.copy_tree(built["src"], tmp_path / "src")
  (src / "tests/test_flaky.py").unlink()
  broken = {"featpkg/__init__.py": "raise ImportError('gone')\n"}
  d = deletion.Deletion(feature=["x"], mode="stub", patch="", gold_patch="", files=broken)
  v = validate.validate(src, built["venv"], d, baseline.Baseline(built["info"]["passing"], (), (), 1, 0.0))
  assert (v.ok, v.reason) == (False, "import_breaks")


def test_untested_change_rejected_no_f2p(built):
  text = (built["src"] / "featpkg/mathx.py").read_text() + "\n# nothing tested changes\n"
  d = deletion.Deletion(feature=["x"], mode="stub", patch="", gold_patch="", files={"featpkg/mathx.py": text})
  v = validate.validate(
    built["src"], built["venv"], d, baseline.Baseline(built["info"]["passing"], (), (), 1, 0.0)
  )
  assert (v.ok, v.reason) == (False, "no_f2p") and len(v.pass_to_pass) == 6


def test_features_from_coverage(built):
  ctx = features.contexts_by_line(built["src"], built["venv"])
  found = {f.qualname: f for f in features.select(built["src"], ctx)}
  assert set(found) == FEATURES
  assert found["featpkg.text.slugify_words"].helpers == ("_split_alnum_chunks",)
  tests = found["featpkg.mathx.running_totals"].tests  # module names as pytest imported them
  assert [t.rsplit(".", 2)[-2:] for t in tests] == [
    ["test_totals", "test_running_totals"],
    ["test_totals", "test_running_totals_empty"],
  ]


def test_scrub_and_leak_scan(built, tmp_path):
  t = by_feature(built["tasks"], "featpkg.mathx.running_totals")
  view = tasks.checkout(t, tmp_path / "view")
  kept = [p.read_text() for p in view.rglob("*.py")]
  deleted = [tasks._removed_lines(t.patch)]
  assert scrub.leak_scan(view, deleted, kept_sources=kept, extra_dirs=[built["venv"]]) == []
  # Plant residues: bytecode of the pristine module, a build/lib copy, a mypy cache, a stub, a pytest cache.
  pyc = view / "featpkg/__pycache__/mathx.cpython-311.pyc"
  pyc.parent.mkdir()
  subprocess.run(
    [
      sys.executable,
      "-c",
      f"import py_compile; py_compile.compile({str(built['src'] / 'featpkg/mathx.py')!r}, {str(pyc)!r})",
    ],
    check=True,
  )
  (view / "build/lib/featpkg").mkdir(parents=True)
  shutil.copy(built["src"] / "featpkg/mathx.py", view / "build/lib/featpkg/mathx.py")
  (view / ".mypy_cache").mkdir()
  (view / ".mypy_cache/mathx.data.json").write_text('{"running_totals": "accumulated_total"}')
  (view / "featpkg/mathx.pyi").write_text("def running_totals(values: list[int]) -> list[int]: ...\n")
  (view / ".pytest_cache/v/cache").mkdir(parents=True)
  hits = scrub.leak_scan(view, deleted, kept_sources=kept)
  assert any("mathx.cpython-311.pyc" in h for h in hits) and any("build/lib" in h for h in hits)
  removed = scrub.scrub_residues(view, t.feature)
  assert {"build", ".mypy_cache", ".pytest_cache", "featpkg/__pycache__", "featpkg/mathx.pyi"} <= set(removed)
  assert scrub.leak_scan(view, deleted, kept_sources=kept) == []
  assert (view / ".git").is_dir() and (view / "featpkg/mathx.py").exists()


def test_make_tasks_max_and_remove_mode(built):
  rejections = collections.Counter()
  made = tasks.make_tasks(
    built["src"], venv=built["venv"], mode="remove", max_tasks=1, rejections=rejections, runs=2
  )
  assert len(made) == 1 and made[0].mode == "remove" and "def " in tasks._removed_lines(made[0].patch)
  assert all(r == "collection_breaks" or r.startswith(("deletion_rejected:", "no_")) for r in rejections)


def test_validate_gold_gate(built):
  base = baseline.Baseline(built["info"]["passing"], (), (), 1, 0.0)
  d = deletion.delete_feature(built["src"], "featpkg.mathx.running_totals", "stub")
  v = validate.validate(built["src"], built["venv"], d, base)
  assert v.ok and v.fail_to_pass == (
    "tests/test_totals.py::test_running_totals",
    "tests/test_totals.py::test_running_totals_empty",
  )
  no_gold = deletion.Deletion(feature=d.feature, mode="stub", patch=d.patch, gold_patch="", files=d.files)
  assert validate.validate(built["src"], built["venv"], no_gold, base).reason == "gold_fails"
