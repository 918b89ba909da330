"""Stage `sft`: the pretrained model warmed up on tool-use demonstrations, on the same two meshes.

  <workdir>/sft (checkpoints), sft_metrics/ (JSONL), sft.json (losses, where the weights came from,
  evaluation on fresh problems)

Starts from the newest pretrain checkpoint (or `init_from`'s weights; `sft.init="random"`: a fresh init),
and says which, with the first batch's loss under those weights next to a random init's. Resumes mid-run
from its own newest checkpoint: the batch of step s is a pure function of (seed, s).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
from absl import logging

from composer_jax import configs, optim, sharding
from composer_jax.configs import Config
from composer_jax.data import tokenizer as tokenizers
from composer_jax.stages import outputs, weights
from composer_jax.stages.record import Interrupted, Stage

# What the sampled evaluation after SFT depends on, besides the SFT run itself.
_ROLLOUT_FIELDS = ("env", "stale", "ledger", "temperature", "top_k", "max_turns", "max_turn_tokens")
_ROLLOUT_FIELDS += ("cache_len",)
INITS = ("pretrain", "random")


def sft_optimizer(config: Config) -> configs.OptimizerConfig:
  s = config.sft
  return configs.stage_optimizer(config.optim, s.schedule, lr=s.lr, min_lr_ratio=0.1)


def run(config: Config, workdir: str) -> dict[str, Any]:
  """SFT on the env's demonstrations; resumes from `<workdir>/sft`; evaluates on fresh problems."""
  from composer_jax import train
  from composer_jax.rl import chat, rollout, sft
  from composer_jax.rl.envs import factories
  from composer_jax.train import loop
  from composer_jax.train import step as step_lib

  cfg, scfg = config.model, config.sft
  meshes = sharding.make_meshes(config)
  ocfg = sft_optimizer(config)
  tx = optim.build_optimizer(cfg, ocfg, meshes)
  tok = chat.tokenizer(config.data.tokenizer)
  demos = factories.demonstrations(config.rl, scfg, config.seed, tok)
  record = configs.record(
    model=cfg, optim=configs.identity(ocfg), sft=configs.identity(scfg), seed=config.seed
  )
  metrics_dir, notes = pathlib.Path(workdir, "sft_metrics"), {"total_steps": ocfg.total_steps}
  keep = scfg.schedule.keep_checkpoints
  with outputs.opened(pathlib.Path(workdir, "sft"), record, keep, metrics_dir, notes) as out:
    random_init = lambda: train.create_state(cfg, tx, jax.random.key(config.seed), meshes)  # noqa: E731
    state, resumed = outputs.start(out, "sft", ocfg, train.state.abstract_state(cfg, tx, meshes), random_init)
    start: dict[str, Any] = {"init": f"resumed at step {int(state.step)}"}
    if resumed is None:  # weights from upstream; the random init's loss on the first batch for comparison
      state, start = _fresh_state(config, workdir, state, tx, demos, meshes, tok.pad_id)
    logging.info(
      "[sft] %s params on %s; %d steps x %d rows", f"{sum(x.size for x in jax.tree.leaves(state.params)):,}",
      sharding.describe(meshes), scfg.schedule.steps, scfg.batch_size,
    )  # fmt: skip
    rows = sft.make_batch(demos, scfg, config.seed, 1, tok.pad_id)
    step = step_lib.make_step(
      step_lib.next_token_loss(cfg, meshes), tx, cfg, schedule=optim.lr_schedule(ocfg), meshes=meshes,
      state_sharding=train.state.state_shardings(state), batch_sharding=_shardings(rows, meshes),
      router_bias_rate=scfg.router_bias_rate,
    )  # fmt: skip
    hooks = sft.hooks(
      demos, scfg, seed=config.seed, meshes=meshes, pad_id=tok.pad_id, save=out.save, check=out.check,
      writer=out.writer,
    )  # fmt: skip
    state, result = loop.fit(state, step, scfg.schedule, hooks, name="sft")
  if result.interrupted:
    raise Interrupted(f"sft stopped at step {result.steps} and saved its checkpoint")
  s = result.summary("loss")
  summary = {k: s[k] for k in ("start_step", "steps", "first_loss", "last_loss", "seconds")} | start
  for name, temp in (("sampled", config.rl.temperature), ("greedy", 0.0)) if scfg.eval_problems else ():
    ev = rollout.evaluate(
      state.params, cfg, config.rl, tok, meshes=meshes, n=scfg.eval_problems, temperature=temp
    )
    summary[f"eval_{name}"] = ev
    logging.info(
      "[sft] eval (%s, %d problems): pass %.2f invalid-call rate %.3f turns %.2f",
      name, scfg.eval_problems, ev["pass_rate"], ev["invalid_call_rate"], ev["turns_per_rollout"],
    )  # fmt: skip
  summary["checkpoints"] = str(pathlib.Path(workdir, "sft"))
  pathlib.Path(workdir, "sft.json").write_text(json.dumps(summary, indent=1))
  return summary


def _shardings(batch: Any, meshes: sharding.Meshes) -> Any:
  from composer_jax.train import batch as batch_lib

  return batch_lib.shardings(batch, meshes)


def _fresh_state(
  config: Config, workdir: str, state: Any, tx: Any, demos: list, meshes: sharding.Meshes, pad_id: int
) -> tuple[Any, dict]:
  """The state SFT starts from (the upstream weights, a fresh optimizer state) and where they came from,
  with the first batch's loss under them and under the random init `state` holds."""
  from composer_jax import train
  from composer_jax.rl import sft
  from composer_jax.train import batch as batch_lib
  from composer_jax.train.step import forward_nll

  if config.sft.init == "random":
    params, source = state.params, "a random init (sft.init=random)"
  else:
    params, source = weights.starting_params(config, workdir, "pretrain", meshes)
  batch = batch_lib.place(sft.make_batch(demos, config.sft, config.seed, 1, pad_id), meshes)
  loss = jax.jit(lambda p, b: forward_nll(p, config.model, b, meshes)[:2])

  def mean(p):
    total, count = loss(p, batch)
    return float(total) / max(float(count), 1.0)

  start = {"init": source, "start_loss": mean(params), "random_init_loss": mean(state.params)}
  logging.info(
    "[sft] weights from %s: first batch loss %.4f (a random init: %.4f)",
    source, start["start_loss"], start["random_init_loss"],
  )  # fmt: skip
  if params is state.params:
    return state, start
  return train.create_state(config.model, tx, jax.random.key(config.seed), meshes, params=params), start


def _f(x: float | None, fmt: str = ".3f") -> str:
  return "n/a" if x is None else format(x, fmt)


def _summarize(s: dict, w: pathlib.Path) -> dict:
  out = {k: s.get(k) for k in ("start_step", "steps", "first_loss", "last_loss", "init", "start_loss")}
  out["random_init_loss"] = s.get("random_init_loss")
  for name in ("sampled", "greedy"):
    ev = s.get(f"eval_{name}") or {}
    out[name] = {k: ev.get(k) for k in ("pass_rate", "invalid_call_rate", "turns_per_rollout")}
  return out | dict(checkpoints=str(w / "sft"), metrics=str(w / "sft_metrics" / "metrics.jsonl"))


def _lines(r: dict) -> list[str]:
  s, g = r["sampled"], r["greedy"]
  start = f"  from {r.get('init')}"
  if r.get("start_loss") is not None:
    start += f": first batch loss {_f(r['start_loss'])} (a random init: {_f(r.get('random_init_loss'))})"
  return [
    start,
    f"  steps {r.get('start_step')}->{r['steps']}: loss {_f(r['first_loss'])} -> {_f(r['last_loss'])}; "
    f"sampled pass {_f(s['pass_rate'], '.2f')} invalid-call rate {_f(s['invalid_call_rate'])}; "
    f"greedy pass {_f(g['pass_rate'], '.2f')} invalid {_f(g['invalid_call_rate'])}",
    f"  checkpoints {r['checkpoints']}, metrics {r['metrics']}",
  ]


def check_chat(config: Config) -> None:
  """The meshes fit, and the tokenizer has the turn format's tokens and fits the model's vocabulary (the
  check of every stage that trains or samples chat turns)."""
  from composer_jax.rl import chat

  configs.check_meshes(config)
  name = config.data.tokenizer
  try:
    if os.path.isdir(name) and tokenizers.checkpoint_files(name) == tokenizers.TIKTOKEN_FILE:
      missing = tokenizers.load(name).missing(chat.CHAT_TOKENS)
      if missing:  # chat.tokenizer's refusal, with where a tiktoken checkpoint names its special tokens
        raise ValueError(
          f"the tokenizer of {name} has no {', '.join(missing)} token: the sft/gate/rl turn format needs "
          f"each as a token of its own (name them in its tokenizer_config.json's added_tokens_decoder, at "
          f"unnamed <|reserved_token_N|> ids: their embedding rows exist)"
        )
    tok = chat.tokenizer(name)
  except (ValueError, OSError) as e:
    raise configs.ConfigError(f"data.tokenizer: {e}") from None
  if tok.vocab_size > config.model.vocab_size:
    raise configs.ConfigError(
      f"data.tokenizer has {tok.vocab_size} ids but model.vocab_size is {config.model.vocab_size}: "
      "raise --config.model.vocab_size (or use the checkpoint's own tokenizer)"
    )


def _check(config: Config) -> None:
  check_chat(config)
  s = config.sft
  if s.init not in INITS:
    raise configs.ConfigError(f"sft.init {s.init!r}: known {', '.join(INITS)}")
  configs.check_batch("sft.batch_size", s.batch_size, 32, config)  # rows padded to a multiple of 32


def _upstream(config: Config) -> tuple[str, ...]:
  return ("pretrain",) if config.sft.init == "pretrain" and not config.init_from else ()


STAGE = Stage(
  name="sft",
  run=run,
  check=_check,
  doc="SFT of the pretrained model on tool-use demonstrations (both meshes)",
  depends=("seed", "model", "optim", "sft", "data.tokenizer", "init_from")
  + tuple(f"rl.{k}" for k in _ROLLOUT_FIELDS),
  extends=configs.cadence_paths("sft"),
  outputs=("sft", "sft_metrics", "sft.json"),
  upstream=_upstream,
  summarize=_summarize,
  lines=_lines,
)
