"""Stage `sft`: the small one-device RL model (`configs.rl_model`) warmed up on toy tool-use demonstrations.
With `init_from`, the checkpoint's own model and tokenizer (`rl.tokenizer`) instead, from its weights.

  <workdir>/sft (checkpoints), sft_metrics/ (JSONL), sft.json (losses, evaluation on fresh problems)

Resumes mid-run from its newest checkpoint: the batch of step s is a pure function of (seed, s). The
summary's first → last loss comes from the metrics file (every step so far, also after a resume).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
from absl import logging

from composer_jax import configs, optim
from composer_jax.configs import Config
from composer_jax.model.config import ModelConfig
from composer_jax.stages import outputs
from composer_jax.stages.record import Interrupted, Stage

# What the sampled evaluation after SFT depends on, besides the SFT run itself.
_ROLLOUT_FIELDS = ("env", "stale", "temperature", "top_k", "max_turns", "max_turn_tokens", "cache_len")
_ROLLOUT_FIELDS += ("tokenizer",)


def sft_optimizer(config: Config) -> configs.OptimizerConfig:
  s = config.sft
  return configs.stage_optimizer(config.optim, s.steps, lr=s.lr, warmup=s.warmup_steps, min_lr_ratio=0.1)


def run(config: Config, workdir: str) -> dict[str, Any]:
  """SFT on `toy.demonstrations`; resumes from `<workdir>/sft`; evaluates on fresh problems."""
  from composer_jax import train
  from composer_jax.rl import chat, rollout, sft
  from composer_jax.rl.envs import factories

  cfg, scfg = configs.rl_model(config), config.sft
  ocfg = sft_optimizer(config)
  tx = optim.build_optimizer(cfg, ocfg, None)
  state = train.create_state(cfg, tx, jax.random.key(config.seed), None, params=checkpoint_params(config))
  record = configs.record(
    model=cfg, optim=configs.identity(ocfg), sft=configs.identity(scfg), seed=config.seed
  )
  metrics_dir, notes = pathlib.Path(workdir, "sft_metrics"), {"total_steps": ocfg.total_steps}
  with outputs.opened(pathlib.Path(workdir, "sft"), record, scfg.keep_checkpoints, metrics_dir, notes) as out:
    state, _ = outputs.resume(out, state, "sft", ocfg)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    logging.info(
      "[sft] %s params, one device (meshes None), %d steps x %d demos",
      f"{n_params:,}",
      scfg.steps,
      scfg.batch_size,
    )
    demos = factories.demonstrations(config.rl, scfg, config.seed)
    step = sft.make_sft_step(cfg, tx, optim.lr_schedule(ocfg), router_bias_rate=scfg.router_bias_rate)
    state, summary = sft.fit(
      state, step, demos, scfg, seed=config.seed, writer=out.writer, save=out.save, check=out.check,
      pad_id=chat.tokenizer(config.rl.tokenizer).pad_id,
    )  # fmt: skip
  if summary["interrupted"]:
    raise Interrupted(f"sft stopped at step {summary['steps']} and saved its checkpoint")
  summary.pop("losses")
  from composer_jax.train import metrics

  logged = metrics.read_history(metrics_dir / "metrics.jsonl", "loss")
  if logged:  # the whole run's first and last loss, also after a resume
    summary["first_loss"], summary["last_loss"] = logged[0]["loss"], logged[-1]["loss"]
  for name, temp in (("sampled", config.rl.temperature), ("greedy", 0.0)) if scfg.eval_problems else ():
    ev = rollout.evaluate(state.params, cfg, config.rl, n=scfg.eval_problems, temperature=temp)
    summary[f"eval_{name}"] = ev
    logging.info(
      "[sft] eval (%s, %d problems): pass %.2f invalid-call rate %.3f turns %.2f",
      name, scfg.eval_problems, ev["pass_rate"], ev["invalid_call_rate"], ev["turns_per_rollout"],
    )  # fmt: skip
  summary["checkpoints"] = str(pathlib.Path(workdir, "sft"))
  pathlib.Path(workdir, "sft.json").write_text(json.dumps(summary, indent=1))
  return summary


def checkpoint_params(config: Config) -> Any | None:
  """The `init_from` checkpoint's weights on one device (None without `init_from`): what sft starts from,
  and gate and rl when there is no SFT checkpoint."""
  if not config.init_from:
    return None
  from composer_jax import model

  logging.info("[sft] weights from the Hugging Face checkpoint %s", config.init_from)
  return model.load_hf_checkpoint(config.init_from, configs.rl_model(config), None)


def load_params(workdir: str, cfg: ModelConfig) -> Any | None:
  """Params of the newest `<workdir>/sft` checkpoint (None if there is none); its model must be `cfg`."""
  from composer_jax import train
  from composer_jax.train import checkpoint

  d = pathlib.Path(workdir, "sft")
  if not d.exists():
    return None
  probe = checkpoint.Checkpointer(d, {}, keep=100)
  step = probe.latest_step()
  meta = None if step is None else probe.read_meta(step)
  probe.close()
  if meta is None:
    return None
  if meta["config"].get("model") != configs.record(model=cfg)["model"]:
    raise checkpoint.CheckpointError(f"{d}/{step} holds a different model than config.rl.model; rerun sft.")
  ocfg = configs.optimizer_for(configs.from_dict(configs.OptimizerConfig, meta["config"]["optim"]), 2)
  template = train.create_state(cfg, optim.build_optimizer(cfg, ocfg, None), jax.random.key(0), None)
  ck = checkpoint.Checkpointer(d, meta["config"], keep=100)
  try:
    state, _ = ck.restore(template, step)
  finally:
    ck.close()
  return state.params


def _f(x: float | None, fmt: str = ".3f") -> str:
  return "n/a" if x is None else format(x, fmt)


def _summarize(s: dict, w: pathlib.Path) -> dict:
  out = {k: s.get(k) for k in ("steps", "first_loss", "last_loss")}
  for name in ("sampled", "greedy"):
    ev = s.get(f"eval_{name}") or {}
    out[name] = {k: ev.get(k) for k in ("pass_rate", "invalid_call_rate", "turns_per_rollout")}
  return out | dict(checkpoints=str(w / "sft"), metrics=str(w / "sft_metrics" / "metrics.jsonl"))


def _lines(r: dict) -> list[str]:
  s, g = r["sampled"], r["greedy"]
  return [
    f"  {r['steps']} steps: loss {_f(r['first_loss'])} -> {_f(r['last_loss'])}; "
    f"sampled pass {_f(s['pass_rate'], '.2f')} invalid-call rate {_f(s['invalid_call_rate'])}; "
    f"greedy pass {_f(g['pass_rate'], '.2f')} invalid {_f(g['invalid_call_rate'])}",
    f"  checkpoints {r['checkpoints']}, metrics {r['metrics']}",
  ]


def _check(config: Config) -> None:
  """The model builds and the chat tokenizer has the turn format's tokens and fits the vocabulary."""
  from composer_jax.rl import chat

  try:
    cfg = configs.rl_model(config)
  except ValueError as e:
    raise configs.ConfigError(f"rl.model: {e}") from None
  try:
    tok = chat.tokenizer(config.rl.tokenizer)
  except (ValueError, OSError) as e:
    raise configs.ConfigError(f"rl.tokenizer: {e}") from None
  if tok.vocab_size > cfg.vocab_size:
    raise configs.ConfigError(
      f"rl.tokenizer has {tok.vocab_size} ids but the model's vocab_size is {cfg.vocab_size}: "
      "raise --config.rl.model.vocab_size (or use the checkpoint's own tokenizer)"
    )


STAGE = Stage(
  name="sft",
  run=run,
  check=_check,
  doc="SFT warm-up of the small one-device RL model on toy tool-use demonstrations",
  depends=("seed", "model", "optim", "sft", "rl.model", "init_from")
  + tuple(f"rl.{k}" for k in _ROLLOUT_FIELDS),
  extends=tuple(f"sft.{k}" for k in configs.CADENCE),
  outputs=("sft", "sft_metrics", "sft.json"),
  summarize=_summarize,
  lines=_lines,
)
