"""Stage `pretrain`: next-token training of the model on the stdlib corpus, resuming from its checkpoints.

  <workdir>/tfds (the corpus, built once), checkpoints/ (orbax), metrics/ (JSONL, TensorBoard),
  pretrain.json (the summary)

A changed config continues in place (`resume_on_change`): the checkpointer restores what it can (e.g.
more steps) and refuses the rest, naming the differing field.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any

import jax
from absl import logging

from composer_jax import backend, configs, optim, sharding
from composer_jax.configs import Config
from composer_jax.model import config as model_config
from composer_jax.stages import outputs
from composer_jax.stages.record import Interrupted, Stage


def run(config: Config, workdir: str) -> dict[str, Any]:
  """Trains `config.train.schedule.steps` steps (resuming from the newest checkpoint); returns the summary."""
  from composer_jax import train
  from composer_jax.data import corpus, packing, tokenizer  # tfds: imported only by the stages that read data
  from composer_jax.train import batch as batch_lib
  from composer_jax.train import loop, metrics
  from composer_jax.train import pretrain as pt
  from composer_jax.train import step as step_lib

  cfg, tcfg, d = config.model, config.train, config.data
  ocfg = configs.pretrain_optimizer(config)
  meshes = sharding.make_meshes(config)
  logging.info("[pretrain] meshes: %s", sharding.describe(meshes))
  splits = corpus.build_corpus(str(pathlib.Path(workdir, "tfds")), src_dir=d.src_dir, max_files=d.max_files)
  tok = tokenizer.load(d.tokenizer)

  tx = optim.build_optimizer(cfg, ocfg, meshes)
  abstract = train.state.abstract_state(cfg, tx, meshes)
  # How to compute, not what: free to change on resume (and the balance switch absent from older records).
  model_record = {k: v for k, v in configs.plain(cfg).items() if k != "context_load_balance"}
  record = configs.record(
    model=model_record | {"remat": "none"},
    # Its warm-up (train.schedule.warmup_steps, resolved) is part of it, the horizon is not: steps may grow.
    optim=configs.identity(ocfg),
    data={k: v for k, v in configs.plain(d).items() if k != "prefetch"},  # prefetching: how, not what
    batch=dict(batch_size=tcfg.batch_size, seq_len=tcfg.seq_len),
    seed=config.seed,
  )
  shape = dict(batch_size=tcfg.batch_size, seq_len=tcfg.seq_len)
  rows = batch_lib.local_rows((tcfg.batch_size, tcfg.seq_len), meshes)  # this host packs only its rows
  eval_iter = corpus.batches(
    splits["validation"], tok, **shape, seed=0, shuffle=False, num_epochs=1, rows=rows.ids
  )
  eval_batches = pt.fixed_batches(eval_iter, tcfg.eval_batches, meshes, rows)
  shardings = train.state.state_shardings(abstract)
  train_step = step_lib.make_step(
    step_lib.next_token_loss(cfg, meshes), tx, cfg, schedule=optim.lr_schedule(ocfg), meshes=meshes,
    state_sharding=shardings, batch_sharding=_batch_sharding(tcfg, meshes),
    router_bias_rate=tcfg.router_bias_rate, qk_clip_tau=ocfg.qk_clip_tau, grad_accum=tcfg.grad_accum,
  )  # fmt: skip
  eval_step = pt.make_eval_step(cfg, shardings.params, meshes)
  n_active = pt.active_params(cfg)
  logging.info("[pretrain] %s active params/token, %dx%d tokens/step", f"{n_active:,}", *shape.values())
  notes = {"total_steps": ocfg.total_steps}
  ckpt_dir, metrics_dir = pathlib.Path(workdir, "checkpoints"), pathlib.Path(workdir, "metrics")
  with outputs.opened(ckpt_dir, record, tcfg.schedule.keep_checkpoints, metrics_dir, notes) as out:

    def fresh():  # init_from's weights are read only when there is no checkpoint to resume
      return train.create_state(cfg, tx, jax.random.key(config.seed), meshes, initial_params(config, meshes))

    state, data_state = outputs.start(out, "pretrain", ocfg, abstract, fresh)
    train_iter = corpus.batches(
      splits["train"], tok, **shape, seed=config.seed, rows=rows.ids, prefetch=d.prefetch
    )
    if data_state is not None:
      train_iter.set_state(data_state)
    hooks = pt.hooks(
      train_iter, eval_step, eval_batches, meshes=meshes, peak_flops=tcfg.peak_flops,
      flops_per_token=metrics.flops_per_token(n_active), rows=rows,
      # Each process knows its rows' state: gathered, so the checkpoint restores on any process count.
      save=lambda st, data_state, final: out.ckpt.save(st, packing.global_state(data_state), force=final),
      check=out.check, writer=out.writer,
    )  # fmt: skip
    with contextlib.closing(train_iter):  # stops the prefetching thread however the fit ends
      state, result = loop.fit(state, train_step, tcfg.schedule, hooks, name="pretrain")
  if result.interrupted:
    raise Interrupted(f"pretrain stopped at step {result.steps} and saved its checkpoint")
  summary = _summary(result)
  summary["checkpoints"] = out.ckpt.all_steps()
  pathlib.Path(workdir, "pretrain.json").write_text(json.dumps(summary, indent=1))
  logging.info("[pretrain] %s", _line(summary))
  return summary


def _batch_sharding(tcfg: configs.TrainConfig, meshes: sharding.Meshes) -> Any:
  """The packed batch's shardings (a fixed layout for the step, and for its micro-batches)."""
  import numpy as np

  from composer_jax.train import batch as batch_lib

  rows = np.zeros((tcfg.batch_size, tcfg.seq_len), np.int32)
  return batch_lib.shardings(batch_lib.TokenBatch(rows, rows, rows), meshes)


def _summary(r: Any) -> dict:
  """The run's losses (this run's steps: after a resume, from the resumed step on) and throughput."""
  s = r.summary("loss", "validation_loss")
  tokens = sum(h["tokens"] for h in r.history)
  return {
    **{
      k: s[k] for k in ("start_step", "steps", "interrupted", "skipped_steps", "seconds", "seconds_per_step")
    },
    "first_train_loss": s["first_loss"],
    "last_train_loss": s["last_loss"],
    "first_validation_loss": s["first_validation_loss"],
    "last_validation_loss": s["last_validation_loss"],
    "train_losses": [h["loss"] for h in r.history],
    "validation_losses": [(e["step"], e["validation_loss"]) for e in r.evals],
    "tokens_per_s": tokens / max(r.seconds, 1e-9),
  }


def initial_params(config: Config, meshes: sharding.Meshes | None) -> Any:
  """The `init_from` checkpoint's weights on `meshes` (None: a fresh init); called only when there is
  no checkpoint of this run to resume (`outputs.start`)."""
  if not config.init_from:
    return None
  from composer_jax import model

  logging.info("[pretrain] starting from the Hugging Face checkpoint %s", config.init_from)
  return model.load_hf_checkpoint(config.init_from, config.model, meshes)


def _f(x: float | None, digits: int = 4) -> str:
  return "n/a" if x is None else f"{x:.{digits}f}"


def _line(s: dict) -> str:
  return (
    f"steps {s['start_step']}→{s['steps']}, train loss {_f(s['first_train_loss'])} → "
    f"{_f(s['last_train_loss'])}, validation {_f(s['first_validation_loss'])} → "
    f"{_f(s['last_validation_loss'])}, {s['tokens_per_s']:,.0f} tok/s, {s['seconds']:.0f} s"
  )


def _summarize(s: dict, w: pathlib.Path) -> dict:
  keys = ("start_step", "steps", "first_train_loss", "last_train_loss", "first_validation_loss")
  keys += ("last_validation_loss", "tokens_per_s", "skipped_steps")
  return {k: s.get(k) for k in keys} | dict(
    checkpoints=str(w / "checkpoints"), metrics=str(w / "metrics" / "metrics.jsonl")
  )


def _lines(r: dict) -> list[str]:
  return [
    f"  steps {r['start_step']}->{r['steps']}: train loss {_f(r['first_train_loss'], 3)} -> "
    f"{_f(r['last_train_loss'], 3)}, validation {_f(r['first_validation_loss'], 3)} -> "
    f"{_f(r['last_validation_loss'], 3)}",
    f"  checkpoints {r['checkpoints']}, metrics {r['metrics']}",
  ]


def _check(config: Config) -> None:
  from composer_jax.data import corpus, tokenizer

  t = config.train
  configs.check_meshes(config)
  configs.check_batch("train.batch_size / train.seq_len", t.batch_size, t.seq_len, config, t.grad_accum)
  if t.grad_accum < 1:
    raise configs.ConfigError(f"train.grad_accum must be >= 1, got {t.grad_accum}")
  context = config.mesh.dense[-1]
  if config.model.context_load_balance and context > 1:
    impl = backend.attention_impl(config.model.attention_impl)
    try:
      model_config.check_context_balance(impl, context, t.seq_len, "train.seq_len")
    except ValueError as e:
      raise configs.ConfigError(str(e)) from None
  name = config.data.tokenizer
  path = pathlib.Path(name)
  if name not in ("byte", "bpe") and not path.is_file() and not tokenizer.checkpoint_files(path):
    raise configs.ConfigError(
      f"data.tokenizer {name!r}: use 'byte', 'bpe', a tokenizers json file or a directory with "
      f"tokenizer.json or {tokenizer.TIKTOKEN_FILE}"
    )
  try:
    vocab = tokenizer.load(name).vocab_size
  except (ValueError, OSError) as e:
    raise configs.ConfigError(f"data.tokenizer {name!r}: {e}") from None
  if vocab > config.model.vocab_size:
    raise configs.ConfigError(
      f"tokenizer {name!r} has {vocab} ids but model.vocab_size is {config.model.vocab_size}; "
      "raise --config.model.vocab_size or pick a smaller tokenizer"
    )
  corpus.check_splits(config.data.src_dir, config.data.max_files)


STAGE = Stage(
  name="pretrain",
  run=run,
  check=_check,
  doc="next-token training on the stdlib corpus, sharded Muon + AdamW, checkpoints and metrics",
  depends=("seed", "model", "train", "optim", "data", "init_from"),
  ignores=("data.prefetch",),  # how batches are prepared, not which
  outputs=("checkpoints", "metrics", "pretrain.json"),
  summarize=_summarize,
  lines=_lines,
  resume_on_change=True,
)
