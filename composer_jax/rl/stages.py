"""The `sft` and `rl` pipeline stages: a small one-device model (`config.model` with `config.rl.model`
overrides, meshes None) warmed up on toy tool-use demonstrations, then trained with RL + text feedback.

  sft(config, workdir)  → <workdir>/sft (checkpoints), sft_metrics/, sft.json (losses, eval on fresh problems)
  rl(config, workdir)   → <workdir>/rl (checkpoints), rl_metrics/, rl.json; with `rl.compare_without_feedback`
                          and λ > 0 also the λ = 0 arm on the same problems and seeds (rl_nofb/...)

Both resume mid-run from their newest checkpoint: the batch (SFT) and the problems and sampling keys (RL)
of step s are pure functions of (seed, s), so a resumed run continues the same run. The summaries take
their per-step history from the metrics JSONL (every step so far, not only this process's), so a resumed
stage still reports first → last. Ctrl-C: the loop saves, then the stage raises KeyboardInterrupt (no
evaluation, no summary file), so the pipeline never records an interrupted stage as finished.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import jax

from composer_jax import pipeline
from composer_jax.model.config import ModelConfig

_log = functools.partial(print, "[pipeline]", flush=True)


def rl_model_config(config: Any) -> ModelConfig:
  """The experiment's model with `config.rl.model` overrides (the small one-device SFT/RL model)."""
  return dataclasses.replace(pipeline.model_config_from(config.model), **config.rl.model.to_dict())


def rl_optimizer(config: Any, lr: float, steps: int, warmup: int, min_lr_ratio: float) -> Any:
  """`config.optim` with the stage's learning rate and schedule length."""
  from composer_jax import optim

  fields = config.optim.to_dict() | dict(
    learning_rate=lr,
    total_steps=max(steps, 2),
    warmup_steps=min(warmup, max(steps, 2) - 1),
    min_lr_ratio=min_lr_ratio,
  )
  return optim.OptimizerConfig(**fields)


def rl_config_from(config: Any, **overrides: Any) -> Any:
  """`RLConfig` from the `config.rl` entries that are its fields (others, e.g. `model`, are ignored)."""
  from composer_jax.rl import train as rl_train

  d = config.rl.to_dict()
  fields = {f.name: d[f.name] for f in dataclasses.fields(rl_train.RLConfig) if f.name in d}
  return rl_train.RLConfig(**(fields | overrides))


def sft_config_from(config: Any) -> Any:
  from composer_jax.rl import sft as sft_lib

  d = config.sft.to_dict()
  return sft_lib.SFTConfig(
    **{f.name: d[f.name] for f in dataclasses.fields(sft_lib.SFTConfig) if f.name in d}
  )


def load_sft_params(workdir: str, cfg: ModelConfig) -> Any | None:
  """Params of the newest `<workdir>/sft` checkpoint (None if there is none); its model must be `cfg`."""
  from composer_jax import optim, train
  from composer_jax.train import checkpoint

  d = pathlib.Path(workdir, "sft")
  if not d.exists():
    return None
  probe = checkpoint.Checkpointer(d, {}, keep=100)
  step = probe.latest_step()
  if step is None:
    probe.close()
    return None
  meta = probe.read_meta(step)
  probe.close()
  want = checkpoint.config_record(model=cfg)["model"]
  if meta["config"].get("model") != want:
    raise checkpoint.CheckpointError(f"{d}/{step} holds a different model than config.rl.model; rerun sft.")
  ocfg = optim.OptimizerConfig(**meta["config"]["optim"])
  tx = pipeline.build_optimizer(ocfg, cfg, None)
  template = train.create_state(cfg, tx, jax.random.key(0), None)
  ck = checkpoint.Checkpointer(d, meta["config"], keep=100)
  try:
    state, _ = ck.restore(template, step)
  finally:
    ck.close()
  return state.params


def sft(config: Any, workdir: str) -> dict[str, Any]:
  """SFT warm-up on `toy.demonstrations`; resumes from `<workdir>/sft`; evaluates on fresh problems."""
  from composer_jax import optim, train
  from composer_jax.rl import sft as sft_lib
  from composer_jax.rl import train as rl_train
  from composer_jax.rl.envs import toy
  from composer_jax.train import checkpoint

  cfg = rl_model_config(config)
  scfg = sft_config_from(config)
  ocfg = rl_optimizer(config, scfg.lr, scfg.steps, scfg.warmup_steps, 0.1)
  tx = pipeline.build_optimizer(ocfg, cfg, None)
  state = train.create_state(cfg, tx, jax.random.key(config.seed), None)
  record = checkpoint.config_record(model=cfg, optim=ocfg, sft=scfg, seed=config.seed)
  ckpt = checkpoint.Checkpointer(pathlib.Path(workdir, "sft"), record, keep=scfg.keep_checkpoints)
  if ckpt.latest_step() is not None:
    state, _ = ckpt.restore(state)
    _log(f"sft: resumed from {ckpt.directory}/{int(state.step)}")
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  _log(f"sft: {n_params:,} params, one device (meshes None), {scfg.steps} steps x {scfg.batch_size} demos")
  demos = toy.demonstrations(
    scfg.demos, seed=config.seed, mistake_fraction=scfg.mistake_fraction, hint_fraction=scfg.hint_fraction
  )
  step = sft_lib.make_sft_step(cfg, tx, optim.lr_schedule(ocfg), router_bias_rate=scfg.router_bias_rate)
  metrics_dir = pathlib.Path(workdir, "sft_metrics")
  state, summary = _fit_checkpointed(
    sft_lib.fit, ckpt, metrics_dir, state, step, demos, scfg, seed=config.seed
  )
  summary.pop("losses")
  logged = history(metrics_dir / "metrics.jsonl", "loss")
  if logged:  # the whole run's first and last loss, also after a resume
    summary["first_loss"], summary["last_loss"] = logged[0]["loss"], logged[-1]["loss"]
  rcfg = rl_config_from(config)
  for name, temp in (("sampled", rcfg.temperature), ("greedy", 0.0)) if config.sft.eval_problems else ():
    ev = rl_train.evaluate(state.params, cfg, rcfg, n=config.sft.eval_problems, temperature=temp)
    summary[f"eval_{name}"] = ev
    _log(
      f"sft eval ({name}, {config.sft.eval_problems} problems): pass {ev['pass_rate']:.2f} "
      f"invalid-call rate {ev['invalid_call_rate']:.3f} turns {ev['turns_per_rollout']:.2f}"
    )
  summary["checkpoints"] = str(pathlib.Path(workdir, "sft"))
  pathlib.Path(workdir, "sft.json").write_text(json.dumps(summary, indent=1))
  f = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
  _log(f"sft: loss {f(summary['first_loss'])} -> {f(summary['last_loss'])} in {summary['seconds']:.0f}s")
  return summary


def rl(config: Any, workdir: str) -> dict[str, Any]:
  """RL from the SFT checkpoint (random init if none, with a warning); resumes from `<workdir>/rl`.

  With `config.rl.compare_without_feedback` (and λ > 0) the λ = 0 arm then runs from the same SFT
  params on the same problems and seeds; its summary is `without_feedback` in the returned dict."""
  rcfg = rl_config_from(config)
  summary = _arm(config, workdir, rcfg, "rl")
  if config.rl.get("compare_without_feedback", False) and rcfg.lambda_feedback > 0:
    _log("rl: the same run without feedback (lambda_feedback 0), same problems and seeds")
    summary["without_feedback"] = _arm(
      config, workdir, dataclasses.replace(rcfg, lambda_feedback=0.0), "rl_nofb"
    )
  pathlib.Path(workdir, "rl.json").write_text(json.dumps(summary, indent=1))
  return summary


def _arm(config: Any, workdir: str, rcfg: Any, name: str) -> dict[str, Any]:
  """One RL run into `<workdir>/<name>` (checkpoints) and `<workdir>/<name>_metrics`."""
  from composer_jax import optim, train
  from composer_jax.rl import train as rl_train
  from composer_jax.train import checkpoint

  cfg = rl_model_config(config)
  ocfg = rl_optimizer(config, rcfg.lr, rcfg.steps, rcfg.warmup_steps, 1.0)
  tx = pipeline.build_optimizer(ocfg, cfg, None)
  tx = rl_train.teacher_optimizer(tx, rcfg)  # rl.teacher="ema": the teacher lives in the optimizer state
  state = train.create_state(cfg, tx, jax.random.key(config.seed), None)
  record = checkpoint.config_record(model=cfg, optim=ocfg, rl=rcfg, seed=config.seed)
  ckpt = checkpoint.Checkpointer(pathlib.Path(workdir, name), record, keep=rcfg.keep_checkpoints)
  if ckpt.latest_step() is not None:
    state, _ = ckpt.restore(state)
    _log(f"{name}: resumed from {ckpt.directory}/{int(state.step)}")
  else:
    params = load_sft_params(workdir, cfg)
    if params is None:
      _log(
        f"{name}: no SFT checkpoint under <workdir>/sft: starting from random weights (run stage sft first)"
      )
    else:
      state = train.TrainState(step=state.step, params=params, opt_state=tx.init(params))
      _log(f"{name}: starting from the SFT checkpoint in {workdir}/sft")
  if rcfg.env == "toy":
    make_envs = rl_train.toy_envs(rcfg)
  elif rcfg.env == "coding":
    make_envs = coding_envs(config, workdir, rcfg, pathlib.Path(workdir, f"{name}_episodes"))
  else:
    raise ValueError(f"rl.env must be 'toy' or 'coding', got {rcfg.env!r}")
  schedule = optim.lr_schedule(ocfg)
  steps = {fb: rl_train.make_rl_step(cfg, tx, schedule, rcfg, with_feedback=fb) for fb in (False, True)}
  evaluate = None  # the fixed problem set (rl.eval_every, rl.eval_problems): step-to-step noise-free progress
  if rcfg.env == "toy" and rcfg.eval_every > 0:
    evaluate = functools.partial(rl_train.evaluate, cfg=cfg, rcfg=rcfg, n=rcfg.eval_problems)
  _log(
    f"{name}: env {rcfg.env}, {rcfg.steps} steps x {rcfg.problems_per_step} problems x {rcfg.group_size} "
    f"rollouts, {rcfg.objective}/{rcfg.advantage}, lambda_feedback {rcfg.lambda_feedback} ({rcfg.divergence})"
  )
  metrics_dir = pathlib.Path(workdir, f"{name}_metrics")
  state, summary = _fit_checkpointed(
    rl_train.fit, ckpt, metrics_dir, state, steps, make_envs, cfg, rcfg, evaluate=evaluate
  )
  summary["history"] = history(metrics_dir / "metrics.jsonl") or summary["history"]
  summary["evals"] = eval_history(metrics_dir / "metrics.jsonl") or summary["evals"]
  summary |= {
    "lambda_feedback": rcfg.lambda_feedback,
    "rollouts_per_step": rcfg.problems_per_step * rcfg.group_size,
    "checkpoints": str(ckpt.directory),
    "metrics": str((metrics_dir / "metrics.jsonl").absolute()),
  }
  h = summary["history"]
  if h:
    _log(
      f"{name}: reward {h[0]['reward']:.3f} -> {h[-1]['reward']:.3f}, invalid-call rate "
      f"{h[0]['invalid_call_rate']:.3f} -> {h[-1]['invalid_call_rate']:.3f}, {summary['seconds']:.0f}s"
    )
  return summary


def _fit_checkpointed(
  fit: Any, ckpt: Any, metrics_dir: pathlib.Path, *args: Any, **kw: Any
) -> tuple[Any, dict]:
  """`fit(*args, writer=, save=, log=print, **kw)` with metrics in `metrics_dir` and checkpoints in `ckpt`,
  both closed afterwards; an interrupted fit (it saved first) raises KeyboardInterrupt for the pipeline."""
  from composer_jax.train import metrics

  writer = metrics.MetricsWriter(metrics_dir)
  try:
    state, summary = fit(
      *args, writer=writer, save=lambda s, force: ckpt.save(s, {}, force=force), log=print, **kw
    )
  finally:
    ckpt.close()
    writer.close()
  if summary["interrupted"]:
    raise KeyboardInterrupt
  return state, summary


def history(path: pathlib.Path, key: str = "reward") -> list[dict]:
  """The records of a metrics JSONL that carry `key`, one per step (the newest write wins: a step redone
  after a resume from an older checkpoint replaces the first try), in step order; [] when there is none.
  key "reward": the training steps; "eval_reward": the fixed-set evaluations (see `eval_history`)."""
  from composer_jax.train import metrics

  if not path.exists():
    return []
  by_step = {rec["step"]: rec for rec in metrics.read_jsonl(path) if "step" in rec and key in rec}
  return [by_step[s] for s in sorted(by_step)]


def eval_history(path: pathlib.Path) -> list[dict]:
  """The fixed-set evaluations of a metrics JSONL in `fit`'s `evals` layout (the `eval_` prefix dropped)."""
  return [
    {"step": r["step"]} | {k.removeprefix("eval_"): v for k, v in r.items() if k.startswith("eval_")}
    for r in history(path, "eval_reward")
  ]


def coding_envs(config: Any, workdir: str, rcfg: Any, root: pathlib.Path):
  """P tasks of the TFDS dataset `<workdir>/synth_tasks` (stage synth) x G rollouts per step; the
  episodes' checkouts under `root`."""
  from composer_jax.rl.envs import coding
  from composer_jax.synth import dataset, tasks

  records = dataset.read_tasks(pathlib.Path(workdir, "synth_tasks"))
  if not records:
    raise ValueError(f"no tasks under {workdir}/synth_tasks: run stage synth first")
  task_list = [tasks.Task.from_record(r) for r in records]
  ccfg = coding.CodingConfig(max_turns=rcfg.max_turns, max_output_chars=config.rl.coding.output_chars)

  def make(step: int):
    picks = [(step * rcfg.problems_per_step + i) % len(task_list) for i in range(rcfg.problems_per_step)]
    G = rcfg.group_size
    env_list = [
      coding.CodingEnv(task_list[t], root / f"{step}-{i}", ccfg)
      for i, t in enumerate(picks)
      for _ in range(G)
    ]
    seeds = [g for _ in picks for g in range(G)]
    return env_list, seeds, [i for i in range(len(picks)) for _ in range(G)]

  return make
