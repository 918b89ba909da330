"""What the runner refuses or stops before doing damage: unusable numbers in the config, a stage that
needs a gate that failed, a second run on a locked workdir; and `--config.force` applying once."""

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys

import pytest
from test_pipeline import _config, fake_stages, logs  # noqa: F401 (fixtures)

from composer_jax import checks, configs, lock, pipeline, report, stages


@pytest.mark.parametrize(
  "key, value, says",
  [
    ("train.schedule.steps", -5, "train.schedule.steps=-5 must be > 0"),
    ("sft.schedule.steps", -1, "sft.schedule.steps=-1 must be > 0"),
    ("rl.schedule.steps", 0, "rl.schedule.steps=0 must be > 0"),
    ("train.schedule.eval_every", -1, "train.schedule.eval_every=-1 must be >= 0"),
    ("rl.schedule.warmup_steps", -2, "rl.schedule.warmup_steps=-2 must be >= 0"),
    ("optim.learning_rate", float("nan"), "optim.learning_rate=nan must be a finite number"),
    ("sft.lr", float("inf"), "sft.lr=inf must be a finite number"),
    ("rl.lr", -1e-3, "rl.lr=-0.001 must be >= 0"),
    ("gate.g5_share", (0.1, float("nan")), "gate.g5_share[1]=nan must be a finite number"),
  ],
)
def test_unusable_numbers_are_refused_before_any_work(tmp_path, fake_stages, key, value, says):  # noqa: F811
  c = _config("demo,sft")
  *sections, field = key.split(".")
  node = c
  for section in sections:
    node = node[section]
  setattr(node, field, value)
  with pytest.raises(configs.ConfigError, match=r"^" + says.replace("[", r"\[").replace("]", r"\]")):
    pipeline.run(c, str(tmp_path))
  assert fake_stages == [] and not (tmp_path / "stages").exists()


def test_numbers_are_checked_by_field_name_wherever_the_field_is():
  """The rules follow field names, not sections: a restructured config keeps its checks."""

  @dataclasses.dataclass(frozen=True)
  class Inner:
    steps: int = 3
    peak_lr: float = 1e-3
    overrides: dict = dataclasses.field(default_factory=lambda: {"scale": 1.0})

  @dataclasses.dataclass(frozen=True)
  class Outer:
    inner: Inner = Inner()

  checks.numbers(Outer())
  for inner, says in (
    (Inner(steps=0), "inner.steps=0 must be > 0"),
    (Inner(peak_lr=-1.0), "inner.peak_lr=-1.0 must be >= 0"),
    (Inner(overrides={"scale": float("-inf")}), "inner.overrides.scale=-inf must be a finite number"),
  ):
    with pytest.raises(configs.ConfigError, match=says):
      checks.numbers(Outer(inner))
  checks.numbers(configs.Config())  # every default passes


def _fake_gate(monkeypatch, calls, passed: bool):
  def gate(config, workdir):
    calls.append("gate")
    verdicts = {"G1": passed, "G2": True, "G3": passed}
    return dict(passed=passed, gates={k: {"pass": ok, "why": "..."} for k, ok in verdicts.items()})

  monkeypatch.setitem(stages.REGISTRY, "gate", dataclasses.replace(stages.REGISTRY["gate"], run=gate))


def test_a_failed_gate_stops_rl_unless_not_required(tmp_path, fake_stages, monkeypatch):  # noqa: F811
  _fake_gate(monkeypatch, fake_stages, passed=False)
  c = _config("sft,gate,rl")
  with pytest.raises(pipeline.GateFailed, match=r"stage gate FAILED \(G1, G3\).*gate.required=False"):
    pipeline.run(c, str(tmp_path))
  assert fake_stages == ["sft", "gate"]
  assert list(json.loads((tmp_path / "summary.json").read_text())["stages"]) == ["sft", "gate"]

  c.stages = "rl"  # rl alone later: the gate's recorded verdict still stops it
  with pytest.raises(pipeline.GateFailed, match=r"stage gate FAILED \(G1, G3\)"):
    pipeline.run(c, str(tmp_path))
  assert fake_stages == ["sft", "gate"]

  c.stages, c.gate.required = "sft,gate,rl", False  # go on: the gate is not rerun for that flag
  pipeline.run(c, str(tmp_path))
  assert fake_stages == ["sft", "gate", "rl"]
  text = report.text(json.loads((tmp_path / "summary.json").read_text()))
  assert "WARNING: stage gate FAILED (G1, G3): rl ran anyway (gate.required=False)" in text

  c.gate.required, c.sft.schedule.steps, c.stages = (
    True,
    7,
    "sft,rl",
  )  # a new SFT checkpoint: old verdict stale
  pipeline.run(c, str(tmp_path))
  assert fake_stages == ["sft", "gate", "rl", "sft", "rl"]


def test_a_passed_gate_lets_rl_run(tmp_path, fake_stages, monkeypatch):  # noqa: F811
  _fake_gate(monkeypatch, fake_stages, passed=True)
  pipeline.run(_config("sft,gate,rl"), str(tmp_path))
  assert fake_stages == ["sft", "gate", "rl"]


def test_force_applies_once_a_rerun_resumes_the_interrupted_forced_stage(
  tmp_path,
  fake_stages,  # noqa: F811
  monkeypatch,
  logs,  # noqa: F811
):
  c = _config("demo")
  pipeline.run(c, str(tmp_path))
  seen = []

  def demo(config, workdir, interrupt):
    out = tmp_path / "demo.json"
    seen.append(out.read_text() if out.exists() else None)
    out.write_text("partial")
    if interrupt:
      raise stages.Interrupted("demo stopped at step 3")
    return {"loss": 1.0, "uniform_loss": 6.9}

  for interrupt in (True, False):
    run = lambda config, workdir, interrupt=interrupt: demo(config, workdir, interrupt)  # noqa: E731
    monkeypatch.setitem(stages.REGISTRY, "demo", dataclasses.replace(stages.REGISTRY["demo"], run=run))
    c.force = "demo"
    try:
      pipeline.run(c, str(tmp_path))
    except stages.Interrupted:
      assert interrupt
  assert seen == [None, "partial"]  # the rerun found what the interrupted forced run had saved
  assert (
    len(list((tmp_path / "stages" / "previous").iterdir())) == 1 and "resuming its forced run" in logs.text
  )
  pipeline.run(c, str(tmp_path))  # finished: the same flag starts it over again
  assert seen == [None, "partial", None]
  assert len(list((tmp_path / "stages" / "previous").iterdir())) == 2


def test_a_dead_runs_lock_is_taken_over_with_a_line(tmp_path, caplog):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (tmp_path / lock.NAME).write_text(json.dumps(dict(pid=dead.pid, host=socket.gethostname(), since=0)))
  caplog.set_level(logging.WARNING)
  with lock.hold(str(tmp_path)):
    mine = json.loads((tmp_path / lock.NAME).read_text())
    assert mine["pid"] == os.getpid()
  assert f"taking over the lock of pid {dead.pid}" in caplog.text and not (tmp_path / lock.NAME).exists()


def test_a_live_lock_refuses_naming_pid_and_host(tmp_path):
  """A live process with a reused pid but another start time is not the holder; the holder itself is."""
  holder = dict(pid=os.getpid(), host=socket.gethostname(), since=0)
  (tmp_path / lock.NAME).write_text(json.dumps(holder | dict(start="1")))  # this pid, started otherwise
  with lock.hold(str(tmp_path)):
    pass
  (tmp_path / lock.NAME).write_text(json.dumps(holder | dict(host="elsewhere")))  # unknowable: assume alive
  with pytest.raises(lock.WorkdirBusy, match=f"in use by pid {os.getpid()} on host elsewhere"):
    lock.acquire(str(tmp_path))
