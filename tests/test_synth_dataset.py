"""Task records through a TFDS array_record dataset and back, without TensorFlow."""

import json

import pytest

from composer_jax.synth import dataset


def record(i: int, **kw) -> dict:
  r = {
    "instance_id": f"toolz-1.2.0__featdel__itertoolz.f{i}__stub",
    "source": {"name": "toolz", "version": "1.2.0", "sha256": "9667a038e9d6ecba" + "0" * 48},
    "feature": [f"toolz.itertoolz.f{i}", "toolz.itertoolz._helper"],
    "mode": "stub",
    "patch": "--- a/toolz/itertoolz.py\n+++ b/toolz/itertoolz.py\n@@ -1 +1 @@\n-  return 1\n+  raise E\n",
    "gold_patch": "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n\\ No newline at end of file\n",
    "FAIL_TO_PASS": [f"toolz/tests/test_itertoolz.py::test_f{i}"],
    "PASS_TO_PASS": [
      "toolz/tests/test_itertoolz.py::test_other",
      "toolz/tests/test_dicttoolz.py::test_merge",
    ],
    "hidden_tests": [],
    "statement": f"Implement `f{i}`.\n\n```python\ndef f{i}(seq):\n  ...\n```\n",
    "created_at": "2026-12-02T14:30:00Z",
    "repo_dir": "/data/repos/toolz-1.2.0",
    "venv": "/data/venvs/toolz-1.2.0",
    "test_files_json": json.dumps({"toolz/tests/test_itertoolz.py": "def test_f(): ...\n"}),
  }
  r.update(kw)
  return r


RECORDS = [
  record(0),
  record(
    1,
    statement="Unicode: naïve café — 日本語 ✓ and emoji 🐍\r\nwith CRLF and a tab\t.",
    patch="+  s = 'ß→ss'\n" * 50,
    feature=["pkg.mod.g"],
    PASS_TO_PASS=[],
  ),
  record(2, FAIL_TO_PASS=[], PASS_TO_PASS=[], hidden_tests=["def test_hidden():\n  assert True\n"], patch=""),
]


def test_round_trip(tmp_path):
  path = dataset.write_tasks(RECORDS, tmp_path)
  assert path.startswith(str(tmp_path))
  back = dataset.read_tasks(tmp_path)
  assert back == RECORDS
  assert list(back[0]) == list(dataset.SCHEMA)
  assert all(isinstance(x, str) for r in back for k in ("feature", "PASS_TO_PASS") for x in r[k])
  assert back[2]["FAIL_TO_PASS"] == [] and isinstance(back[2]["FAIL_TO_PASS"], list)


def test_missing_key_names_it(tmp_path):
  bad = record(0)
  del bad["gold_patch"]
  with pytest.raises(ValueError, match="missing key 'gold_patch'"):
    dataset.write_tasks([record(1), bad], tmp_path)
  src = record(0)
  del src["source"]["sha256"]
  with pytest.raises(ValueError, match="missing key 'source.sha256'"):
    dataset.write_tasks([src], tmp_path)
  with pytest.raises(ValueError, match="'FAIL_TO_PASS' must be a list of str"):
    dataset.write_tasks([record(0, FAIL_TO_PASS="test_a")], tmp_path)
  with pytest.raises(ValueError, match="duplicate instance_id"):
    dataset.write_tasks([record(0), record(0)], tmp_path)


def test_rewrite_with_different_records_reads_new_ones(tmp_path):
  first = dataset.write_tasks(RECORDS, tmp_path)
  changed = [record(0, statement="A different statement."), record(5)]
  second = dataset.write_tasks(changed, tmp_path)
  assert second != first
  assert dataset.read_tasks(tmp_path) == changed
  # The same records again reuse the prepared copy and switch back.
  assert dataset.write_tasks(RECORDS, tmp_path) == first
  assert dataset.read_tasks(tmp_path) == RECORDS


def test_read_without_write(tmp_path):
  with pytest.raises(FileNotFoundError, match="write_tasks"):
    dataset.read_tasks(tmp_path)
