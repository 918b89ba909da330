"""Runs a user can trust, tried as a user would: `run.py` in a subprocess, signalled at random moments,
extended, starved of disk; each must end in one clear line and a state that resumes to the same result.

The run is tests/small_experiment.py (a two-layer model, 8 steps, checkpoints every 2) on a fake corpus.
"""

import json
import os
import pathlib
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tiny

from composer_jax.synth import sandbox
from composer_jax.train import metrics

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CONFIG = "--config=tests/small_experiment.py"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> str:
  return tiny.write_corpus(tmp_path_factory.mktemp("src"))


def _cmd(workdir: pathlib.Path, corpus_dir: str, *extra: str) -> list[str]:
  return [
    sys.executable,
    "run.py",
    _CONFIG,
    f"--workdir={workdir}",
    f"--config.data.src_dir={corpus_dir}",
    *extra,
  ]


def _env() -> dict:
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _run(workdir, corpus_dir, *extra, timeout=600) -> subprocess.CompletedProcess:
  return subprocess.run(
    _cmd(workdir, corpus_dir, *extra), cwd=_ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
  )


def _params(workdir: pathlib.Path, step: int):
  return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")["params"]


def _assert_same_params(a, b):
  import jax

  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def straight(corpus_dir, tmp_path_factory):
  """The uninterrupted run: (workdir, seconds)."""
  workdir = tmp_path_factory.mktemp("straight")
  t0 = time.perf_counter()
  p = _run(workdir, corpus_dir)
  assert p.returncode == 0, p.stderr[-3000:]
  return workdir, time.perf_counter() - t0


def _spawn(workdir, corpus_dir) -> subprocess.Popen:
  """run.py on the small experiment in the background, its output captured."""
  return subprocess.Popen(
    _cmd(workdir, corpus_dir),
    cwd=_ROOT,
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _interrupted(workdir, corpus_dir, delay: float, signum: int) -> subprocess.CompletedProcess:
  proc = _spawn(workdir, corpus_dir)
  time.sleep(delay)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=600)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _check_interrupt_output(p: subprocess.CompletedProcess) -> None:
  """Exit 130 with a last line that says how to resume, or 0 when the run had already finished; never a
  traceback."""
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  if p.returncode == 0:
    return
  last = p.stderr.strip().splitlines()[-1]
  assert p.returncode == 130 and last.startswith("run.py: interrupted") and "rerun" in last, p.stderr[-2000:]


def _signal_at_random_points_then_finish(straight, corpus_dir, tmp_path, n: int, seed: int) -> list[str]:
  """n runs each signalled (SIGINT or SIGTERM) at a random moment of a fresh or resumed run, then one to
  the end: the final parameters equal the uninterrupted run's bit for bit."""
  ref_dir, seconds = straight
  rng = random.Random(seed)
  outcomes = []
  for _ in range(n):
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    p = _interrupted(tmp_path, corpus_dir, rng.uniform(0.5, seconds), signum)
    _check_interrupt_output(p)
    outcomes.append(f"{signal.Signals(signum).name}:{p.returncode}")
  p = _run(tmp_path, corpus_dir)
  assert p.returncode == 0, p.stderr[-3000:]
  summary = json.loads((tmp_path / "stages" / "pretrain.json").read_text())["summary"]
  assert summary["steps"] == 8 and summary["skipped_steps"] == 0
  _assert_same_params(_params(tmp_path, 8), _params(ref_dir, 8))
  steps = [
    r["step"]
    for r in map(json.loads, (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines())
    if "loss" in r
  ]
  assert steps == list(range(1, 9))  # every step once, however often the run was cut
  return outcomes


def test_signals_at_random_points_end_cleanly_and_resume_exactly(straight, corpus_dir, tmp_path):
  _signal_at_random_points_then_finish(straight, corpus_dir, tmp_path, n=3, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_signals_at_random_points_many_times(straight, corpus_dir, tmp_path, seed):
  _signal_at_random_points_then_finish(straight, corpus_dir, tmp_path, n=6, seed=100 + seed)


def test_raising_steps_trains_on_and_a_refused_change_damages_nothing(straight, corpus_dir, tmp_path):
  first = _run(tmp_path, corpus_dir, "--config.train.schedule.steps=4")
  assert first.returncode == 0, first.stderr[-3000:]
  marker = json.loads((tmp_path / "stages" / "pretrain.json").read_text())
  more = _run(tmp_path, corpus_dir, "--config.train.schedule.steps=6")
  assert more.returncode == 0, more.stderr[-3000:]
  assert "continuing in place" in more.stderr and "re-derived over 6 steps, not 4" in more.stderr
  extended = json.loads((tmp_path / "stages" / "pretrain.json").read_text())["summary"]
  assert (extended["start_step"], extended["steps"]) == (4, 6)
  # The summary covers the steps this run trained (5 and 6); the metrics file has every step.
  logged = {
    r["step"]: r["loss"] for r in metrics.read_history(tmp_path / "metrics" / "metrics.jsonl", "loss")
  }
  assert sorted(logged) == [1, 2, 3, 4, 5, 6] and logged[1] == marker["summary"]["first_train_loss"]
  assert (extended["first_train_loss"], extended["last_train_loss"]) == (logged[5], logged[6])

  refused = _run(tmp_path, corpus_dir, "--config.train.schedule.steps=6", "--config.optim.learning_rate=0.5")
  last = refused.stderr.strip().splitlines()[-1]
  assert refused.returncode == 2 and "optim.learning_rate: checkpoint 0.01, now 0.5" in last, refused.stderr[
    -2000:
  ]
  again = _run(
    tmp_path, corpus_dir, "--config.train.schedule.steps=6"
  )  # the refused try left the marker alone
  assert again.returncode == 0 and "with this config: skipped" in again.stderr
  assert json.loads((tmp_path / "stages" / "pretrain.json").read_text())["summary"] == extended


def _on_a_full_disk(
  tmp_path, corpus_dir, kib: int, *extra: str, where: str = "checkpoints", fill: dict | None = None
) -> tuple[subprocess.CompletedProcess, str]:
  """run.py with `<tmp_path>/w/<where>` on a `kib` KiB tmpfs (bubblewrap mount namespace): (the run,
  `ls -AR` of the full disk when it ended). The run must end in one line naming the full disk. With
  `fill` (environment variables), tests/full_disk_run.py instead: run.py on a disk filled at a set moment."""
  if not sandbox.available():
    pytest.skip("bubblewrap not installed (the full disk is a size-capped tmpfs in a mount namespace)")
  small = tmp_path / "small"
  small.mkdir()
  (tmp_path / "w").mkdir()
  os.symlink(small, tmp_path / "w" / where)
  listing = tmp_path / "left_on_the_full_disk.txt"
  cmd = _cmd(tmp_path / "w", corpus_dir, *extra)
  if fill is not None:
    cmd[1] = "tests/full_disk_run.py"
  inner = " ".join(map(shlex.quote, cmd))
  script = f"{inner}; rc=$?; ls -AR {shlex.quote(str(small))} > {shlex.quote(str(listing))}; exit $rc"
  wrap = ["bwrap", "--dev-bind", "/", "/", "--size", str(kib * 1024), "--tmpfs", str(small), "--", "sh", "-c"]
  env = {**_env(), **(fill or {})}
  p = subprocess.run(wrap + [script], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
  last = p.stderr.strip().splitlines()[-1]
  assert p.returncode == 1 and last.startswith("run.py: ") and "No space left on device" in last, p.stderr[
    -3000:
  ]
  assert "Traceback" not in p.stderr
  return p, listing.read_text()


def test_a_full_disk_stops_the_run_at_once_and_leaves_no_partial_checkpoint(straight, corpus_dir, tmp_path):
  """The first save fails with ENOSPC; the run stops with one line, no `*.orbax-checkpoint-tmp*` is left,
  and with room again the same command finishes. There, the partial checkpoint a crash (SIGKILL, power
  loss) would leave is waiting in the checkpoint directory: the rerun removes it, in one line naming it."""
  p, listing = _on_a_full_disk(tmp_path, corpus_dir, 64)
  assert "saving a checkpoint" in p.stderr.strip().splitlines()[-1]
  records = [json.loads(r) for r in (tmp_path / "w" / "metrics" / "metrics.jsonl").read_text().splitlines()]
  assert max(r["step"] for r in records) <= 4  # stopped at once, not after the remaining steps
  assert "orbax-checkpoint-tmp" not in listing  # what the full disk held when the run ended
  os.unlink(tmp_path / "w" / "checkpoints")
  stale = tmp_path / "w" / "checkpoints" / "2.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"
  stale.mkdir(parents=True)
  (stale / "_METADATA").write_text("{")  # cut short
  ok = _run(tmp_path / "w", corpus_dir)
  assert ok.returncode == 0, ok.stderr[-3000:]
  removed = [line for line in ok.stderr.splitlines() if "orbax-checkpoint-tmp" in line]
  assert len(removed) == 1 and "removed 2.orbax-checkpoint-tmp" in removed[0], ok.stderr[-3000:]
  assert not list((tmp_path / "w" / "checkpoints").glob("*orbax-checkpoint-tmp*"))
  _assert_same_params(_params(tmp_path / "w", 8), _params(straight[0], 8))


def _listed(listing: str) -> dict[str, list[str]]:
  """`ls -AR` output as {directory: its entries}."""
  out = {}
  for block in listing.strip().split("\n\n"):
    head, _, body = block.partition("\n")
    out[head.rstrip(":")] = body.split()
  return out


def test_a_full_final_save_is_one_line_and_keeps_the_last_checkpoint(corpus_dir, tmp_path):
  """Checkpoints at steps 4 and 8 on a 16 MB disk that fills up at a set moment, the same on every run
  (tests/full_disk_run.py): step 4's save is held just before it commits (data written; checksums and
  rename to `4` not yet) until the final save, of step 8, has started and filled the disk but for 64 KB,
  room to finish step 4, never to write step 8 (a checkpoint here takes 0.7-3 MB: its OCDBT files vary
  with timing). So the final save starts while step 4's is in flight, waits for it, and fails.

  The one allowed outcome: a last line naming the full disk and `kept: [4]`, no traceback; left on the
  disk: step 4, complete (its checksums written, renamed from its temporary name), the filler, and no
  temporary directory of either save."""
  fill = {"FULL_DISK_AT": "8", "HOLD_SAVE": "4"}
  every = "--config.train.schedule.checkpoint_every=4"
  p, listing = _on_a_full_disk(tmp_path, corpus_dir, 16384, every, fill=fill)
  last = p.stderr.strip().splitlines()[-1]
  assert "saving a checkpoint" in last and "kept: [4];" in last, p.stderr[-3000:]
  dirs = _listed(listing)
  top = dirs[str(tmp_path / "small")]
  assert sorted(top) == ["4", "disk_filler"] and "orbax-checkpoint-tmp" not in listing, listing
  assert {"checksums.process_0.json", "commit_success.txt", "state", "meta"} <= set(
    dirs[str(tmp_path / "small" / "4")]
  )


def test_a_full_disk_while_preparing_the_data_is_one_line(corpus_dir, tmp_path):
  """The tokenized corpus (tfds, under the workdir) does not fit: one line, not the writer's traceback."""
  p, _ = _on_a_full_disk(tmp_path, corpus_dir, 64, where="tfds")
  assert "what finished and the checkpoints saved before are kept" in p.stderr.strip().splitlines()[-1]


def test_rl_alone_after_a_failed_gate_stops_in_one_line_naming_it(corpus_dir, tmp_path):
  """`--config.stages=rl` on a workdir whose gate failed on the current SFT checkpoint (markers as the
  stages leave them): one line naming the failed gates and the flag that goes on; nothing of rl runs."""
  (tmp_path / "stages").mkdir()
  sft = dict(stage="sft", run="r1", fingerprint="f", finished="then", seconds=1.0, config={}, summary={})
  gate = dict(stage="gate", run="r2", fingerprint="g", finished="then", seconds=1.0, config={})
  gate["config"]["upstream.sft"] = dict(fingerprint="f", run="r1")
  gate["summary"] = dict(
    passed=False, gates={"G1": {"pass": False, "why": "-"}, "G2": {"pass": True, "why": "-"}}
  )
  for name, marker in (("sft", sft), ("gate", gate)):
    (tmp_path / "stages" / f"{name}.json").write_text(json.dumps(marker))
  p = _run(tmp_path, corpus_dir, "--config.stages=rl")
  last = p.stderr.strip().splitlines()[-1]
  assert p.returncode == 1 and "stage gate FAILED (G1)" in last and "gate.required=False" in last, p.stderr
  assert "Traceback" not in p.stderr and not (tmp_path / "rl").exists()


def test_a_second_run_on_a_workdir_in_use_stops_at_once_naming_the_holder(corpus_dir, tmp_path):
  """Two runs on one workdir: the second stops in one line naming the first's pid and host, and leaves
  the first alone (it stops cleanly on SIGTERM and releases the lock)."""
  first = _spawn(tmp_path, corpus_dir)
  deadline = time.monotonic() + 300
  while not (tmp_path / ".lock").exists() and first.poll() is None and time.monotonic() < deadline:
    time.sleep(0.2)
  second = _run(tmp_path, corpus_dir)
  first.send_signal(signal.SIGTERM)
  _, err = first.communicate(timeout=600)
  last = second.stderr.strip().splitlines()[-1]
  assert second.returncode == 2 and f"in use by pid {first.pid} on host {socket.gethostname()}" in last, (
    second.stderr[-2000:]
  )
  assert "Traceback" not in second.stderr
  assert first.returncode in (0, 130) and "Traceback" not in err and not (tmp_path / ".lock").exists()


def test_bad_workdir_and_config_conflicts_are_one_line(corpus_dir, tmp_path):
  (tmp_path / "a_file").write_text("")
  cases = [
    ([f"--workdir={tmp_path / 'a_file'}"], "is not a writable directory"),
    (["--config.mesh.expert=(4,1)"], "mesh.dense (4, 1, 2) has 8 devices but mesh.expert (4, 1) has 4"),
    (["--config.train.batch_size=6"], "must be divisible by replica·fsdp = 4"),
    (["--config.data.tokenizer=bpe"], "has 4096 ids but model.vocab_size is 272"),
    (["--config.stages=pretrain,rl", "--config.rl.objective=ppo"], "rl.objective 'ppo'"),
    (["--config.train.schedule.steps=-5"], "train.schedule.steps=-5 must be > 0"),
    (["--config.optim.learning_rate=nan"], "optim.learning_rate=nan must be a finite number"),
  ]
  for extra, message in cases:
    workdir = [] if extra[0].startswith("--workdir") else [f"--workdir={tmp_path / 'w'}"]
    p = subprocess.run(
      [sys.executable, "run.py", _CONFIG, f"--config.data.src_dir={corpus_dir}", *workdir, *extra],
      cwd=_ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in p.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert p.returncode == 2 and message in lines[-1] and "Traceback" not in p.stderr, (
      extra,
      p.stderr[-2000:],
    )
  small = tmp_path / "tiny_src"
  small.mkdir()
  (small / "one.py").write_text("x = 1\n")
  p = _run(tmp_path / "w2", str(small))
  assert p.returncode == 2 and "split got none" in p.stderr.strip().splitlines()[-1]
  shutil.rmtree(tmp_path / "w2", ignore_errors=True)


def test_one_device(corpus_dir, tmp_path):
  """docs/pretraining.md's single-device flags: both meshes of size 1 (run.py then makes one CPU device)."""
  one = ["--config.mesh.dense=(1,1,1)", "--config.mesh.expert=(1,1)", "--config.train.schedule.steps=2"]
  p = _run(tmp_path, corpus_dir, *one)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "1 local of 1 cpu devices" in p.stderr
  assert json.loads((tmp_path / "stages" / "pretrain.json").read_text())["summary"]["steps"] == 2
