"""Grader-side holes found as root (issue 14), one test each: none of them reproduces.

The old grader followed a `tests/` symlink out of the task (deleting and writing host files), read a
report file the sandbox had swapped for a symlink, blocked on a FIFO, read a 1 GiB sparse file whole, let
eight children burn many times the CPU limit, gave `/task` and `/tmp` unbounded space, allowed user
namespaces, and counted a test missing from pytest's summary as passed. The sandbox-level bounds (tree
CPU with and without a cgroup, tmpfs caps, user namespaces) are in test_synth_sandbox.py.
"""

import os
import pathlib
import shutil
import time
import tracemalloc

import pytest
from test_synth_redteam import TARGET, assert_caught, fixture_tasks, stub_replaced

from composer_jax.synth import sandbox, snapshot, tasks

pytestmark = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap/prlimit not installed")


@pytest.fixture(scope="module")
def task():
  return next(t for t in fixture_tasks() if t.feature[0] == TARGET)


@pytest.fixture
def view(task, tmp_path):
  return tasks.checkout(task, tmp_path / "agent")


def write(view: pathlib.Path, files: dict) -> None:
  for rel, text in files.items():
    (view / rel).write_text(text)


def test_tests_symlink_leads_nowhere(task, view, tmp_path):
  host = tmp_path / "host"
  host.mkdir()
  (host / "keep.txt").write_text("host data")
  shutil.rmtree(view / "tests")
  (view / "tests").symlink_to(host)
  g = tasks.grade(task, view)
  assert_caught(g, "refused symlink: tests")
  assert (
    sorted(p.name for p in host.iterdir()) == ["keep.txt"] and (host / "keep.txt").read_text() == "host data"
  )


def test_report_files_are_never_read(task, view):
  # Results come through a pipe: report files swapped for symlinks (to a device that never ends, to a
  # forged report) are never opened by the grader, which returns promptly.
  forged = '<testsuite><testcase classname="tests.test_totals" name="test_running_totals"/></testsuite>'
  code = (
    "import os as _o\n"
    "for _n in ('report.xml', 'junit.xml', '.junit-0/report.xml'):\n"
    "  _o.makedirs(_o.path.dirname(_n) or '.', exist_ok=True)\n"
    "  _o.symlink('/dev/zero', _n)\n"
    f"open('forged.xml', 'w').write({forged!r})\n"
  )
  write(view, {"featpkg/__init__.py": code + (view / "featpkg/__init__.py").read_text()})
  t0 = time.perf_counter()
  g = tasks.grade(task, view)
  assert time.perf_counter() - t0 < 60
  assert_caught(g)
  assert set(task.fail_to_pass) <= set(g.failed)


def test_fifo_does_not_block_grading(task, view):
  os.mkfifo(view / "featpkg" / "helpers.py")
  t0 = time.perf_counter()
  g = tasks.grade(task, view)
  assert time.perf_counter() - t0 < 60
  assert_caught(g, "refused fifo: featpkg/helpers.py")


def test_sparse_gigabyte_is_not_read(task, view):
  with open(view / "featpkg" / "cache.bin", "wb") as f:
    f.truncate(1 << 30)
  tracemalloc.start()
  try:
    t0 = time.perf_counter()
    g = tasks.grade(task, view)
    elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert elapsed < 60 and peak < 64 << 20, (elapsed, peak)
  assert_caught(g, "refused oversize")


def test_process_tree_cpu_bounded(task, view):
  # Eight busy children: the tree is killed at its CPU budget (2 s), long before the wall-clock limit.
  body = (
    "import os\nfor _ in range(8):\n  if os.fork() == 0:\n    while True:\n      pass\nwhile True:\n  pass"
  )
  write(view, stub_replaced(view, body))
  t0 = time.perf_counter()
  g = tasks.grade(task, view, timeout_s=60, cpu_s=2)
  assert time.perf_counter() - t0 < 30
  assert_caught(g, "grader: resource_limit: cpu")


def test_disk_filling_stops_at_the_tmpfs_cap(task, view):
  body = "for i in range(3):\n  open(f'/tmp/fill{i}', 'wb').write(b'x' * (200 << 20))\nreturn []"
  write(view, stub_replaced(view, body))  # 600 MB in files under the per-file limit
  g = tasks.grade(task, view)
  assert_caught(g, "resource_limit: disk")


def test_missing_test_counts_as_failed(task, view):
  # Tests that vanish from the results (no report, no collection error) fail, and are flagged.
  code = (
    "import inspect as _i, _pytest.runner as _r\n_orig = _r.runtestprotocol\n\n\n"
    "def _proto(item, log=True, nextitem=None):\n"
    "  if 'running_totals' in _i.getsource(item.obj):\n    return []\n"
    "  return _orig(item, log=log, nextitem=nextitem)\n\n\n_r.runtestprotocol = _proto\n"
  )
  write(view, {"featpkg/__init__.py": code + (view / "featpkg/__init__.py").read_text()})
  g = tasks.grade(task, view)
  assert_caught(g, "tests missing from the results")
  assert set(task.fail_to_pass) <= set(g.failed)


def test_snapshot_reads_only_regular_files(tmp_path):
  (tmp_path / "a.py").write_text("x = 1\n")
  (tmp_path / "d").mkdir()
  (tmp_path / "d/link.py").symlink_to("/etc/passwd")
  os.link(tmp_path / "a.py", tmp_path / "d/hard.py")
  os.mkfifo(tmp_path / "d/pipe")
  (tmp_path / ".git").mkdir()
  (tmp_path / ".git/HEAD").write_text("ref")
  snap = snapshot.take(tmp_path, max_file_bytes=4)
  assert snap.files == {}  # a.py is 6 bytes > 4, and hard-linked
  assert snap.refused == {
    "a.py": "hard link",
    "d/hard.py": "hard link",
    "d/link.py": "symlink -> /etc/passwd",
    "d/pipe": "fifo",
  }
  (tmp_path / "d/hard.py").unlink()
  snap = snapshot.take(tmp_path)
  assert snap.files == {"a.py": b"x = 1\n"} and snapshot.changed_since(tmp_path, snap) == []
  (tmp_path / "a.py").write_text("x = 2\n")
  assert snapshot.changed_since(tmp_path, snap) == ["a.py"]
