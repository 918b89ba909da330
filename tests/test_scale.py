"""Full-scale variants and the multi-process path, without the devices.

The real variants' meshes are built as `AbstractMesh`es (64 and 1024 devices that don't exist) and
their parameters as `jax.eval_shape` shapes: every dimension a rule shards must split evenly (the
sharding tables otherwise replicate it silently) and the batches must split over the meshes. (What
each device holds and sends: `composer_jax/plan.py`.) The multi-process pieces (global batches,
process-0 metrics) are checked on one process, where they must change nothing; the slow test runs a
real two-process CPU job (`run.py` with `jax.distributed`) against a one-process one.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from composer_jax import configs, model, sharding
from composer_jax.train import metrics
from composer_jax.train.batch import TokenBatch, place

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_EXPERIMENT = _ROOT / "experiments" / "composer25.py"
DEVICES = {"tiny": 8, "moonlight_16b": 64, "kimi_k25_1t": 1024}  # as the variants' docstring states


def _experiment():
  spec = importlib.util.spec_from_file_location("composer25", _EXPERIMENT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _axis_size(mesh, axis) -> int:
  return math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))


def _layout(config):
  """(abstract meshes, [(path, shape, logical axes, NamedSharding)] of every parameter)."""
  cfg = configs.from_config(config).model
  meshes = sharding.abstract_meshes(config.mesh.dense, config.mesh.expert)
  abstract = model.abstract_params(cfg)
  axes = jax.tree_util.tree_leaves_with_path(model.logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  leaves = []
  for (path, names), p in zip(axes, jax.tree.leaves(abstract), strict=True):
    s = sharding.param_sharding(names, meshes, p.shape)
    leaves.append((jax.tree_util.keystr(path, simple=True, separator="/"), p.shape, names, s))
  return meshes, leaves


def _problems(config) -> list[str]:
  """What would not split evenly: parameters the tables want sharded, batches, expert tokens."""
  meshes, leaves = _layout(config)
  out = []
  for name, mesh in (("dense", meshes.dense), ("expert", meshes.expert)):
    if mesh.size != DEVICES[config.variant]:
      out.append(f"{name} mesh {dict(mesh.shape)} has {mesh.size} devices, not {DEVICES[config.variant]}")
  for path, shape, names, s in leaves:
    rules = sharding.EXPERT_PARAM_RULES if sharding.is_expert_param(names) else sharding.DENSE_PARAM_RULES
    wanted = [rules.get(n) if n is not None else None for n in names]
    got = list(s.spec) + [None] * (len(shape) - len(s.spec))
    for dim, axis in enumerate(wanted):
      if axis in got[:dim] + got[dim + 1 :]:
        continue  # another dim of this array holds the mesh axis (o_proj: heads before embed)
      if axis is not None and (got[dim] != axis or shape[dim] % _axis_size(s.mesh, axis)):
        out.append(f"{path} {shape} dim {dim} ({names[dim]}) does not split over {axis}")
  data = sharding.DENSE_ACTIVATION_RULES
  tokens = sharding.EXPERT_ACTIVATION_RULES["tokens"]
  t, d = config.train, config.demo
  for what, rows, cols in (
    ("train", t.batch_size // t.grad_accum, t.seq_len),
    ("demo", d.batch, d.prompt_len),
  ):
    if rows % _axis_size(meshes.dense, data["batch"]) or cols % _axis_size(meshes.dense, data["seq"]):
      out.append(f"{what} micro-batch {rows}x{cols} does not split over {dict(meshes.dense.shape)}")
    if rows * cols % _axis_size(meshes.expert, tokens):  # else the MoE falls back from expert parallelism
      out.append(
        f"{what} tokens {rows * cols} do not split over the {meshes.expert.size} expert-mesh devices"
      )
  if t.batch_size % t.grad_accum:
    out.append(f"train batch {t.batch_size} is not a multiple of grad_accum {t.grad_accum}")
  if config.model.n_experts % meshes.expert.shape["expert"]:
    out.append(f"{config.model.n_experts} experts do not split over expert={meshes.expert.shape['expert']}")
  return out


@pytest.mark.parametrize("variant", list(DEVICES))
def test_variant_meshes_split_every_parameter_and_batch(variant):
  assert _problems(_experiment().get_config(variant)) == []


def test_the_check_catches_a_mesh_that_does_not_divide():
  config = _experiment().get_config("kimi_k25_1t")
  config.mesh.expert = (256, 4)  # 384 experts over 256
  config.model.d_model = 7000  # over fsdp=16 (7168 splits over any power of two up to 1024)
  config.train.batch_size = 128  # over replica·fsdp = 256
  problems = _problems(config)
  assert any("experts do not split over expert=256" in p for p in problems), problems
  assert any("w_gate" in p and "(expert)" in p for p in problems), problems
  assert any("embed" in p and "fsdp" in p for p in problems), problems
  assert any(p.startswith("train micro-batch 128x4096") for p in problems), problems
  assert not any("mesh" in p and "devices, not" in p for p in problems), problems


def test_placed_batch_splits_rows_over_replica_fsdp_and_time_over_context(meshes):
  rng = np.random.default_rng(0)
  rows = {k: rng.integers(0, 100, (8, 16)).astype(np.int32) for k in ("tokens", "segment_ids", "positions")}
  got = place(TokenBatch.of(rows), meshes)
  want = jax.device_put(rows["tokens"], sharding.activation_sharding(("batch", "seq"), meshes))
  for k in rows:
    x = getattr(got, k)
    assert x.sharding == want.sharding, k
    np.testing.assert_array_equal(np.asarray(x), rows[k])
    for a, b in zip(x.addressable_shards, want.addressable_shards, strict=True):
      assert a.device == b.device and a.index == b.index, k
  assert got.target_mask is None
  per_row = place(np.arange(8, dtype=np.float32), meshes)  # [B]: rows only; 7 rows: replicated
  assert per_row.sharding.spec == jax.sharding.PartitionSpec(("replica", "fsdp"))
  assert place(np.arange(7), meshes).sharding.spec == jax.sharding.PartitionSpec(None)
  single = place(TokenBatch.of(rows), None)
  np.testing.assert_array_equal(np.asarray(single.tokens), rows["tokens"])


def test_metrics_writer_off_the_first_process_writes_nothing(tmp_path):
  first = metrics.MetricsWriter(tmp_path / "p0")
  first.close()
  assert first.enabled and (tmp_path / "p0" / "metrics.jsonl").exists()  # one process: it is process 0
  writer = metrics.MetricsWriter(tmp_path / "p1", enabled=False)
  writer.write(1, {"loss": 1.0})
  writer.close()
  assert not (tmp_path / "p1").exists()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
  """`run.py` as two CPU processes of 4 devices (jax.distributed over gloo) ≡ one process of 8:
  same losses, one metrics file, one checkpoint. ~10 min on 2 busy cores (two compilations)."""
  steps = 3
  args = [
    sys.executable, str(_ROOT / "run.py"), f"--config={_EXPERIMENT}", "--config.stages=pretrain",
    "--config.model.n_layers=2", f"--config.train.schedule.steps={steps}", "--config.train.seq_len=64",
    f"--config.train.schedule.eval_every={steps}", "--config.train.eval_batches=1",
    "--config.train.schedule.log_every=1", f"--config.train.schedule.checkpoint_every={steps}",
    "--config.data.max_files=40",
  ]  # fmt: skip
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_PLATFORMS"] = "cpu"
  one = subprocess.run([*args, f"--workdir={tmp_path / 'one'}"], env=env, capture_output=True, text=True)
  assert one.returncode == 0, one.stderr[-3000:]
  port = _free_port()
  # An empty compilation cache for both: gloo gives the processes 30 s to meet at each new collective,
  # which one that loads a program from the cache while the other compiles it misses.
  env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    rendezvous = dict(
      JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)
    )
    with open(log, "w") as f:  # files, not pipes: a full pipe would stall one process and the other with it
      procs.append(
        subprocess.Popen([*args, f"--workdir={tmp_path / 'two'}"], env=env | rendezvous, stdout=f, stderr=f)
      )
  for p, log in zip(procs, logs, strict=True):
    assert p.wait(timeout=1800) == 0, log.read_text()[-3000:]
  assert "process 1 of 2: 4 local of 8 cpu devices" in logs[1].read_text()

  def losses(workdir: pathlib.Path) -> np.ndarray:
    rows = metrics.read_jsonl(workdir / "metrics" / "metrics.jsonl")
    return np.array([(r["step"], r.get("loss", 0.0), r.get("validation_loss", 0.0)) for r in rows])

  one_losses, two_losses = losses(tmp_path / "one"), losses(tmp_path / "two")
  assert len(one_losses) == steps + 2  # each step, validation at 0 and at the end
  np.testing.assert_allclose(two_losses, one_losses, rtol=1e-5)
  assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == [str(steps)]
