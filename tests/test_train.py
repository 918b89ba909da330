"""Pretraining: loss algebra, the NaN guard, exact kill-and-resume, checkpoint safety, config errors.

End-to-end runs go through `pipeline.run` with a two-layer model on a fake corpus of a few files.
"""

import dataclasses
import importlib.util
import logging
import os
import pathlib
import shutil
import signal

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tiny
from tiny import TINY

from composer_jax import model, pipeline, train
from composer_jax.train import checkpoint, loop
from composer_jax.train import pretrain as pt
from composer_jax.train.batch import TokenBatch, place
from composer_jax.train.step import forward_nll, make_step, next_token_loss

CFG = dataclasses.replace(TINY, vocab_size=272)  # the byte tokenizer's 267 ids fit
_EXPERIMENT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "composer25.py"


def _experiment():
  spec = importlib.util.spec_from_file_location("composer25", _EXPERIMENT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def src_dir(tmp_path_factory) -> str:
  return tiny.write_corpus(tmp_path_factory.mktemp("src"))


def _config(src_dir: str, steps: int, **optim) -> ml_collections.ConfigDict:
  c = _experiment().get_config("tiny")
  c.stages = "pretrain"
  c.model = ml_collections.ConfigDict(dataclasses.asdict(CFG))
  c.data.src_dir = src_dir
  c.train.update(batch_size=4, seq_len=32, eval_batches=1)
  c.train.schedule.update(steps=steps, warmup_steps=1, log_every=1, eval_every=steps, checkpoint_every=2)
  c.optim.update({"learning_rate": 1e-2, "total_steps": 8, **optim})
  return c


@pytest.fixture(scope="module")
def straight(src_dir, tmp_path_factory):
  """6 steps in one go: (summary, workdir)."""
  workdir = tmp_path_factory.mktemp("straight")
  return pipeline.run(_config(src_dir, 6), str(workdir))["pretrain"], workdir


def test_few_steps_lower_the_loss(straight):
  summary, workdir = straight
  losses = summary["train_losses"]
  assert len(losses) == 6 and summary["skipped_steps"] == 0
  assert losses[-1] < losses[0] - 0.1, losses
  (_, val_first), (last_step, val_last) = summary["validation_losses"]
  assert last_step == 6 and val_last < val_first - 0.1
  lines = train.metrics.read_jsonl(workdir / "metrics" / "metrics.jsonl")
  assert [m["step"] for m in lines if "loss" in m] == list(range(1, 7))
  assert [m["step"] for m in lines if "validation_loss" in m] == [0, 6]
  train_lines = [m for m in lines if "loss" in m]
  assert {"grad_norm", "lr", "tokens", "expert_load_max_over_mean", "overflow", "skipped", "mfu"} <= set(
    train_lines[0]
  )


def _final_params(workdir: pathlib.Path, step: int):
  return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")["params"]


def test_kill_and_resume_is_exact(straight, src_dir, tmp_path):
  full, full_dir = straight
  first = pipeline.run(_config(src_dir, 3), str(tmp_path))["pretrain"]  # "killed" after step 3
  assert first["checkpoints"] == [2, 3]
  shutil.rmtree(tmp_path / "checkpoints" / "3")  # as if killed before the step-3 save: resume from 2
  second = pipeline.run(_config(src_dir, 6), str(tmp_path))["pretrain"]
  assert second["start_step"] == 2
  assert first["train_losses"] == full["train_losses"][:3]
  assert second["train_losses"] == full["train_losses"][2:]  # bit-for-bit
  jax.tree.map(np.testing.assert_array_equal, _final_params(tmp_path, 6), _final_params(full_dir, 6))


def test_incompatible_checkpoint_names_the_field(straight, src_dir):
  _, workdir = straight
  with pytest.raises(checkpoint.CheckpointError, match=r"optim\.learning_rate: checkpoint 0\.01, now 0\.02"):
    pipeline.run(_config(src_dir, 8, learning_rate=2e-2), str(workdir))


def _data_file(step_dir: pathlib.Path) -> pathlib.Path:
  files = [f for f in step_dir.rglob("*") if f.is_file() and "ocdbt.process_0" in str(f)]
  return max(files, key=lambda f: f.stat().st_size)


@pytest.mark.parametrize("damage", ["overwrite_4k", "truncate"])
def test_damaged_checkpoint_is_set_aside_and_the_previous_one_used(
  straight, src_dir, tmp_path, damage, caplog
):
  """4 KB overwritten in a data file, or a file cut short: the newest checkpoint fails its checksums, is
  moved to checkpoints/corrupt/ (kept), and training resumes from the previous one with finite losses."""
  _, workdir = straight
  shutil.copytree(workdir / "checkpoints", tmp_path / "checkpoints")
  f = _data_file(tmp_path / "checkpoints" / "6")
  data = f.read_bytes()
  if damage == "overwrite_4k":
    at = len(data) // 3
    f.write_bytes(data[:at] + bytes(4096) + data[at + 4096 :])
  else:
    f.write_bytes(data[: len(data) // 2])
  caplog.set_level(logging.WARNING)
  summary = pipeline.run(_config(src_dir, 8), str(tmp_path))["pretrain"]
  assert summary["start_step"] == 4 and summary["steps"] == 8 and summary["skipped_steps"] == 0
  assert all(np.isfinite(summary["train_losses"]))
  (aside,) = (tmp_path / "checkpoints" / "corrupt").iterdir()
  assert aside.name.startswith("6-") and ("checksum" in caplog.text or "bytes" in caplog.text)


def test_no_readable_checkpoint_is_a_clear_error_and_all_are_kept(straight, src_dir, tmp_path):
  _, workdir = straight
  shutil.copytree(workdir / "checkpoints", tmp_path / "checkpoints")
  for step in (4, 6):
    f = _data_file(tmp_path / "checkpoints" / str(step))
    f.write_bytes(b"garbage")
  with pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint"):
    pipeline.run(_config(src_dir, 8), str(tmp_path))
  assert sorted(p.name.split("-")[0] for p in (tmp_path / "checkpoints" / "corrupt").iterdir()) == ["4", "6"]


def _packed_batch():
  """One row: a 5-token and a 7-token document, then padding (segment 0)."""
  rng = np.random.default_rng(1)
  doc_a, doc_b = rng.integers(0, 256, 5), rng.integers(0, 256, 7)
  tokens = np.zeros((1, 16), np.int32)
  segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
  tokens[0, :5], segments[0, :5], positions[0, :5] = doc_a, 1, np.arange(5)
  tokens[0, 5:12], segments[0, 5:12], positions[0, 5:12] = doc_b, 2, np.arange(7)
  return {"tokens": tokens, "segment_ids": segments, "positions": positions}, (doc_a, doc_b)


def test_packed_loss_equals_unpacked_documents():
  """Packed mean loss = token-weighted mean over the documents run alone (one per row, from column 0)."""
  params = model.init(CFG, jax.random.key(0))
  batch, docs = _packed_batch()
  nll, count, _ = jax.jit(lambda p, b: forward_nll(p, CFG, b, None))(params, TokenBatch.of(batch))
  packed = nll / count
  tokens = np.zeros((len(docs), 16), np.int32)
  for i, doc in enumerate(docs):
    tokens[i, : len(doc)] = doc
  positions = np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape)
  logits, _ = jax.jit(model.apply, static_argnums=1)(params, CFG, tokens, positions)
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
  nll = [-sum(logp[i, t, doc[t + 1]] for t in range(len(doc) - 1)) for i, doc in enumerate(docs)]
  assert float(count) == 4 + 6
  np.testing.assert_allclose(float(packed), sum(nll) / 10, rtol=1e-5)


def test_nan_guard_keeps_the_state(meshes):
  tx = optax.adamw(1e-2)
  state = train.create_state(CFG, tx, jax.random.key(0), meshes)
  before = jax.device_get(state)
  step = make_step(
    next_token_loss(CFG, meshes), tx, CFG, schedule=optax.constant_schedule(1e-2), meshes=meshes,
    state_sharding=train.state.state_shardings(state), router_bias_rate=1e-3,
  )  # fmt: skip
  batch, _ = _packed_batch()
  batch = {k: np.tile(v[:, :8], (4, 2)) for k, v in batch.items()}
  batch["tokens"][0, 0] = CFG.vocab_size  # out of range: NaN logits inside jit
  state, m = step(state, place(TokenBatch.of(batch), meshes))
  assert int(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
  assert int(state.step) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before.params)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.opt_state), before.opt_state)


def test_unknown_config_key_is_an_error():
  c = _experiment().get_config("tiny")
  c.lock()  # run.py's config flag locks the config: overriding an unknown key fails
  with pytest.raises(AttributeError):
    c.train.stepz = 3
  assert pipeline.parse_stages("demo,pretrain") == ["demo", "pretrain"]
  with pytest.raises(ValueError, match="known stages: demo, pretrain"):
    pipeline.parse_stages("pretrian")


class _Batches:
  """Stands in for the data iterator: counts batches, signals this process while reading `stop_at`."""

  def __init__(self, stop_at: int, signum: int):
    self.index, self.stop_at, self.signum = 0, stop_at, signum

  def __next__(self):
    if self.index + 1 == self.stop_at:
      os.kill(os.getpid(), self.signum)
    self.index += 1
    return {k: np.zeros((1, 2), np.int32) for k in ("tokens", "segment_ids", "positions")}

  def get_state(self):
    return {"index": self.index}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_finishes_the_step_in_flight_then_saves(tmp_path, signum):
  """The loop alone (step functions faked): a signal while batch 4 is read → step 4 finishes, then one
  final save of step 4 with data state 4, metrics of steps 1-4 on disk, and the handlers restored."""

  def train_step(state, batch):
    del batch
    m = dict(loss=1.0, grad_norm=0.0, lr=0.0, tokens=2.0, skipped=0)
    return state.replace(step=state.step + 1), {k: jnp.asarray(v) for k, v in m.items()}

  saves = []
  state = train.TrainState(step=jnp.zeros((), jnp.int32), params={}, opt_state={})
  writer = train.metrics.MetricsWriter(tmp_path)

  def save(s, data_state, force):
    saves.append((int(s.step), data_state, force))

  handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
  hooks = pt.hooks(
    _Batches(stop_at=4, signum=signum), lambda p, b: (jnp.ones(()), jnp.ones(())), [], meshes=None,
    peak_flops=1.0, writer=writer, save=save,
  )  # fmt: skip
  schedule = loop.Schedule(steps=10, log_every=1, eval_every=100, checkpoint_every=2)
  state, result = loop.fit(state, train_step, schedule, hooks, name="pretrain")
  writer.close()
  assert result.interrupted and result.steps == 4 and int(state.step) == 4
  assert saves == [(2, {"index": 2}, False), (4, {"index": 4}, False), (4, {"index": 4}, True)]
  assert [m["step"] for m in train.metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
