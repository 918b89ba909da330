"""The `synth` stage end to end on the fixture repository: progress lines, summary counts, a readable
dataset, `synth.json`; unknown source names are refused with the known ones listed."""

import importlib.util
import json
import logging
import pathlib

import pytest
from test_synth_tasks import FEATURES, fixture_env

from composer_jax.synth import build, sandbox

_EXPERIMENT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "composer25.py"
pytestmark = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap/prlimit not installed")


def _config(**synth):
  spec = importlib.util.spec_from_file_location("composer25", _EXPERIMENT)
  exp = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(exp)
  c = exp.get_config("tiny")
  c.stages = "synth"
  c.synth.update(synth)
  return c


def test_synth_stage_on_local_fixture(tmp_path, monkeypatch, caplog):
  from composer_jax import pipeline
  from composer_jax.synth import dataset

  src, venv = fixture_env()
  # Reuse the fixture's venv (built offline once per machine) instead of pip-installing a new one.
  monkeypatch.setattr(build, "ensure_venv", lambda *_: venv)
  config = _config(sources="", local_dir=str(src), max_tasks_per_source=2, runs=2)
  caplog.set_level(logging.INFO)
  summary = pipeline.run(config, str(tmp_path))["synth"]

  (row,) = summary["sources"]
  assert row["name"] == "src" and not row["error"], row
  assert row["valid"] == 2 == summary["total_valid"]
  assert row["candidates"] == 2 + sum(row["rejected"].values()) and row["total_candidates"] >= 4
  assert row["yield_"] == row["valid"] / row["candidates"] and row["tasks_per_minute"] > 0
  assert "| src 0 |" in summary["table"] and "| **total** |" in summary["table"]
  out = caplog.text
  assert out.count("[synth] src ") >= row["candidates"] and ": valid " in out and ", eta " in out

  records = dataset.read_tasks(tmp_path / "synth_tasks")
  assert len(records) == 2 and {r["feature"][0] for r in records} <= FEATURES
  assert all(r["instance_id"].startswith("src-0__featdel__featpkg.") for r in records)
  assert json.loads((tmp_path / "synth.json").read_text())["total_valid"] == 2


def test_unknown_source_name():
  with pytest.raises(
    ValueError, match=r"unknown synth source\(s\) \['nope'\]; known sources: toolz, boltons"
  ):
    build.resolve_sources("toolz, nope")
  assert [s.name for s in build.resolve_sources("inflection,toolz")] == ["inflection", "toolz"]
  with pytest.raises(ValueError, match="no synth sources"):
    build.resolve_sources("")


def test_unknown_source_name_in_stage(tmp_path):
  from composer_jax import pipeline

  with pytest.raises(ValueError, match="known sources: toolz, boltons, cachetools, tabulate, humanize"):
    pipeline.run(_config(sources="toolz,numpy"), str(tmp_path))
  assert not (tmp_path / "synth_sources").exists()


def test_interrupt_writes_tasks_built_so_far(tmp_path, monkeypatch):
  src, venv = fixture_env()
  monkeypatch.setattr(build, "ensure_venv", lambda *_: venv)
  real = build.tasks.make_tasks

  def make_then_interrupt(*args, on_task, **kw):
    def once(task):
      on_task(task)
      raise KeyboardInterrupt

    return real(*args, on_task=once, **kw)

  monkeypatch.setattr(build.tasks, "make_tasks", make_then_interrupt)
  with pytest.raises(KeyboardInterrupt):
    build.build([src], tmp_path, max_tasks_per_source=3, runs=2, log=lambda _: None)
  summary = json.loads((tmp_path / "synth.json").read_text())
  assert summary["interrupted"] and summary["total_valid"] == 1 and summary["dataset"]


def test_runner_ids_of_inherited_tests(tmp_path):
  # cachetools: test methods live in a mixin in tests/__init__.py, collected by tests/test_lru.py etc.
  # The runner reports pytest's own node ids: the collecting module and class, never the mixin's file.
  import sys

  from composer_jax.synth import baseline

  (tmp_path / "tests").mkdir()
  (tmp_path / "tests/__init__.py").write_text("class Mixin:\n  def test_pop(self):\n    assert True\n")
  (tmp_path / "tests/test_lru.py").write_text(
    "import unittest\nfrom . import Mixin\n\n\nclass LRUCacheTest(Mixin, unittest.TestCase):\n"
    "  def test_x(self):\n    assert False\n"
  )
  run = baseline.run_suite(baseline.make_sandbox(sys.prefix, timeout_s=60), sys.prefix, tmp_path)
  assert run.report_found and run.outcomes == {
    "tests/test_lru.py::LRUCacheTest::test_pop": baseline.PASSED,
    "tests/test_lru.py::LRUCacheTest::test_x": baseline.FAILED,
  }, run.result.stdout
