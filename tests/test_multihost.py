"""Many hosts on one machine (tests/multihost.py: N processes × M CPU devices through jax.distributed):
collectives work, the demo stage runs multi-process with the single-process result, each process packs
only its rows of the global batch, and a SIGTERM to one process stops every process at the same step
with one save."""

import json
import pathlib
import re
import signal
import subprocess
import sys
import time

import multihost
import pytest
import tiny

from composer_jax import pipeline

_EXPERIMENT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "composer25.py"


def test_a_psum_across_2_processes_of_2_devices():
  outs = multihost.run_function("multihost:psum_probe", n_processes=2, devices=2, timeout=240)
  assert [o["process"] for o in outs] == [0, 1]
  assert all(o["processes"] == 2 and o["devices"] == 4 and o["sum"] == 1 + 2 + 3 + 4 for o in outs), outs


def _tiny(stages: str):
  c = tiny.load_script("experiments/composer25.py").get_config("tiny")
  c.stages = stages
  return c


@pytest.mark.slow
def test_the_demo_stage_on_2_processes_of_4_devices_decodes_like_one_process(tmp_path):
  """The tiny variant's demo: decoded tokens sharded over both processes are fetched through
  multihost_utils (np.asarray on them raised), and equal those of the same demo on one process."""
  argv = ["run.py", f"--config={_EXPERIMENT}", "--config.stages=demo", f"--workdir={tmp_path / 'two'}"]
  done = multihost.wait_all(multihost.launch(argv, 2), timeout=500)
  for i, p in enumerate(done):
    assert p.returncode == 0 and "Traceback" not in p.stderr, (i, p.stderr[-3000:])
  two = json.loads((tmp_path / "two" / "demo.json").read_text())
  one = pipeline.run(_tiny("demo"), str(tmp_path / "one"))["demo"]
  assert two["decoded"] == one["decoded"] and two["loss"] == pytest.approx(one["loss"], rel=1e-5)


# The chat stages on a small budget: 4 SFT steps, one gate batch (not required to pass), 2 RL steps.
_CHAT = ["--config.stages=pretrain,sft,gate,rl", "--config.train.schedule.steps=2"]
_CHAT += ["--config.sft.schedule.steps=4", "--config.sft.eval_problems=4", "--config.gate.min_flagged=4"]
_CHAT += [
  "--config.gate.rollouts_per_batch=16",
  "--config.gate.max_batches=1",
  "--config.gate.required=false",
]
_CHAT += ["--config.rl.schedule.steps=2", "--config.rl.problems_per_step=2", "--config.rl.group_size=4"]
_CHAT += ["--config.rl.schedule.eval_every=0", "--config.rl.compare_without_feedback=false"]


@pytest.mark.slow
def test_sft_gate_and_rl_on_2_processes_of_4_devices_equal_one_process(tmp_path):
  """Rollouts, the gate's resamples and the SFT evaluation fetch sampled tokens split over both processes
  (`sharding.host`; `jax.device_get` cannot read another process's shards), every process takes the
  same host-side steps, and the stages' results equal one process's."""
  argv = ["run.py", f"--config={_EXPERIMENT}", f"--workdir={tmp_path / 'two'}", *_CHAT]
  done = multihost.wait_all(multihost.launch(argv, 2), timeout=1500)
  for i, p in enumerate(done):
    assert p.returncode == 0 and "Traceback" not in p.stderr, (i, p.stderr[-3000:])
  one = subprocess.run(
    [sys.executable, *argv[:2], f"--workdir={tmp_path / 'one'}", *_CHAT], cwd=multihost.ROOT,
    capture_output=True, text=True, timeout=1500,
  )  # fmt: skip
  assert one.returncode == 0, one.stderr[-3000:]
  runs = {k: json.loads((tmp_path / k / "summary.json").read_text())["stages"] for k in ("one", "two")}
  for stage, keys in (
    ("sft", ("first_loss", "last_loss", "sampled", "greedy")),
    ("gate", ("flagged", "rollouts")),
  ):
    for key in keys:  # losses: fp32 sums in another order across processes
      assert runs["two"][stage][key] == pytest.approx(runs["one"][stage][key], rel=1e-5), (stage, key, runs)
  rl = {k: [json.loads(x) for x in (tmp_path / k / "rl_metrics" / "metrics.jsonl").open()] for k in runs}
  assert len(rl["one"]) == len(rl["two"]) == 2
  for a, b in zip(rl["one"], rl["two"], strict=True):
    for key in ("reward", "loss", "grad_norm", "invalid_call_rate", "tokens_per_rollout"):
      assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a, b)


@pytest.mark.slow
def test_a_checkpoint_of_2_processes_resumes_on_4_processes_on_another_mesh(tmp_path):
  """Steps 1-4 on 2 processes × 4 devices (meshes (4,1,2)/(8,1)), then steps 5-6 on 4 processes × 2
  devices laid out as (2,2,2)/(4,2): each process restores its own shards of the new layout, and the
  losses of steps 5-6 equal those of one process that trained 1-6 straight."""
  (tmp_path / "src").mkdir()
  corpus = tiny.write_corpus(tmp_path / "src")
  base = ["run.py", "--config=tests/small_experiment.py", f"--config.data.src_dir={corpus}"]
  base += ["--config.train.schedule.checkpoint_every=4", "--config.optim.total_steps=6"]  # one lr schedule
  other_mesh = ["--config.mesh.dense=(2,2,2)", "--config.mesh.expert=(4,2)"]
  runs = [(2, ["--config.train.schedule.steps=4"]), (4, ["--config.train.schedule.steps=6", *other_mesh])]
  for n, extra in runs:
    done = multihost.wait_all(
      multihost.launch([*base, f"--workdir={tmp_path / 'w'}", *extra], n), timeout=900
    )
    for i, p in enumerate(done):
      assert p.returncode == 0 and "Traceback" not in p.stderr, (n, i, p.stderr[-3000:])
  straight = subprocess.run(
    [sys.executable, *base, f"--workdir={tmp_path / 'one'}", "--config.train.schedule.steps=6"],
    cwd=multihost.ROOT, capture_output=True, text=True, timeout=900,
  )  # fmt: skip
  assert straight.returncode == 0, straight.stderr[-3000:]

  def losses(workdir: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (workdir / "metrics" / "metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}

  resumed, one = losses(tmp_path / "w"), losses(tmp_path / "one")
  assert sorted(resumed) == sorted(one) == list(range(1, 7)), (resumed, one)
  for step in (5, 6):
    assert resumed[step] == pytest.approx(one[step], rel=1e-5), (step, resumed, one)


def _pack_corpus(root: pathlib.Path) -> str:
  """64 train files and 3 validation files of 90-450 bytes, each opening with a line naming it."""
  from composer_jax.data import corpus

  want, i = {"train": 64, "validation": 3}, 0
  while any(want.values()):
    name, i = f"mod_{i}.py", i + 1
    if want[corpus.split_of(name)]:
      want[corpus.split_of(name)] -= 1
      body = "".join(f"def f{j}(x):\n  return x * {j}\n\n" for j in range(3 + i * 7 % 13))
      (root / name).write_text(f'"""Module {name}."""\n' + body)
  return str(root)


def test_each_process_packs_only_its_rows_and_the_global_batch_equals_one_process(tmp_path):
  """2 processes × 4 devices (rows over replica 4, time over context 2): each process packs 4 of the 8
  rows (prefetched) and tokenizes only their documents; the placed global batches, the validation
  batches (process 1's rows have no document: it pads to process 0's count), the gathered data state
  and the batch resumed from it equal those of one process packing every row."""
  import numpy as np
  from multihost_probes import PACK_SHAPE

  from composer_jax.data import corpus, tokenizer
  from composer_jax.train import pretrain as pt

  (tmp_path / "src").mkdir()
  src, data_dir, n, n_eval = _pack_corpus(tmp_path / "src"), str(tmp_path / "tfds"), 3, 2
  outs = multihost.run_function(
    "multihost_probes:packed_rows", 2, 4, args=(data_dir, src, n, n_eval), timeout=300
  )
  splits = corpus.build_corpus(data_dir, src_dir=src, verbose=False)  # the one the processes built
  byte = tokenizer.ByteTokenizer()
  one = corpus.batches(splits["train"], byte, **PACK_SHAPE, seed=0)
  want = [next(one) for _ in range(n)]
  want_state, want_after = one.get_state(), next(one)
  valid = corpus.batches(splits["validation"], byte, **PACK_SHAPE, seed=0, shuffle=False, num_epochs=1)
  want_evals = [vars(b) for b in pt.fixed_batches(valid, n_eval, None)]
  assert sorted(outs[0]["rows"] + outs[1]["rows"]) == list(range(8)), [o["rows"] for o in outs]
  docs = corpus.documents(splits["train"], seed=0)
  order = {docs[i].split("\n")[0]: i for i in range(len(docs))}  # first line -> place in epoch 0
  keys = ("tokens", "segment_ids", "positions")
  for o in outs:
    assert o["local"] == [4] * n and o["state"] == want_state, o["process"]
    assert o["tokenized"] and {order[t] % 8 for t in o["tokenized"]} <= set(o["rows"]), o
    for got, ref in zip(
      [*o["batches"], o["after"], *o["evals"]], [*want, want_after, *want_evals], strict=True
    ):
      for k in keys:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(ref[k]), err_msg=f"{o['process']} {k}")


def _wait_for(path: pathlib.Path, pattern: str, timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if path.exists() and re.search(pattern, path.read_text()):
      return
    time.sleep(0.2)
  raise TimeoutError(f"{pattern!r} not in {path} after {timeout}s:\n{path.read_text()[-3000:]}")


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_the_same_step_with_one_save(tmp_path):
  """Process 1 of 2 gets SIGTERM mid-run: both stop before the same step, save it once together (each
  process's checksums in the one step directory) and end in the resume line; before, process 1 stopped
  and waited in its save while process 0 waited in the next step's collectives (a hang)."""
  import tiny

  (tmp_path / "src").mkdir()
  corpus = tiny.write_corpus(tmp_path / "src")
  (tmp_path / "logs").mkdir()
  argv = ["run.py", "--config=tests/small_experiment.py", f"--workdir={tmp_path / 'w'}"]
  argv += [f"--config.data.src_dir={corpus}", "--config.train.schedule.steps=200"]
  argv += ["--config.train.schedule.checkpoint_every=0"]
  procs = multihost.launch(argv, 2, logs=tmp_path / "logs")
  try:
    _wait_for(tmp_path / "logs" / "process_0.log", r"\[pretrain\] step 2/200", timeout=400)
    procs[1].send_signal(signal.SIGTERM)
    for p in procs:
      p.wait(timeout=240)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  logs = [(tmp_path / "logs" / f"process_{i}.log").read_text() for i in range(2)]
  stopped = []
  for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
    last = log.strip().splitlines()[-1]
    assert p.returncode == 130 and "Traceback" not in log, (i, log[-3000:])
    stopped.append(int(re.search(r"pretrain stopped at step (\d+)", last).group(1)))
  assert stopped[0] == stopped[1] and 2 <= stopped[0] < 200, stopped
  steps = sorted(d.name for d in (tmp_path / "w" / "checkpoints").iterdir())
  assert steps == [str(stopped[0])], steps  # one save, at the agreed step
  step_dir = tmp_path / "w" / "checkpoints" / steps[0]
  assert {p.name for p in step_dir.glob("checksums.process_*.json")} == {
    "checksums.process_0.json",
    "checksums.process_1.json",
  }


def test_a_shard_corrupted_on_one_process_sets_the_step_aside_on_all(tmp_path):
  """Process 1's file of step 2 is damaged: each process hashes only its own files (none reads the
  other's), the verdicts are combined, and both set step 2 aside and restore step 1."""
  outs = multihost.run_function(
    "multihost_probes:checkpoint_verdicts", 2, 2, args=(str(tmp_path / "ckpt"), 1), timeout=300
  )
  for k, out in enumerate(outs):
    assert out["step"] == 1 and out["total"] == 1024.0 and out["set_aside"] == ["2"], (k, out)
    others = [h for h in out["hashed"] if "ocdbt.process_" in h and f"ocdbt.process_{k}" not in h]
    assert out["hashed"] and not others, (k, out["hashed"])


def test_a_busy_workdir_stops_every_process(tmp_path):
  """Process 0 cannot take the lock (this live test process holds it): all processes stop, none goes on."""
  import os
  import socket

  from composer_jax import lock

  holder = dict(pid=os.getpid(), host=socket.gethostname(), since=0)
  (tmp_path / lock.NAME).write_text(json.dumps(holder))
  outs = multihost.run_function("multihost_probes:workdir_lock", 2, 1, args=(str(tmp_path),), timeout=240)
  assert f"in use by pid {os.getpid()}" in outs[0] and "process 0 could not take" in outs[1], outs
  free = multihost.run_function("multihost_probes:workdir_lock", 2, 1, args=(str(tmp_path / "free"),))
  assert free == ["held", "held"] and not (tmp_path / "free" / lock.NAME).exists()


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
