"""Stages wired together: `run(config, workdir)` runs `config.stages` in order.

`demo`: build both meshes, initialise the sharded model, print where each parameter lives, run one
forward pass and greedy-decode a few tokens. `pretrain`: next-token training on the stdlib corpus,
resuming from `<workdir>/checkpoints`. `synth`: feature-deletion coding tasks from real repositories
(`composer_jax/synth/build.py`) into the TFDS dataset `<workdir>/synth_tasks`. `sft`: a small model from
scratch on toy tool-use demonstrations (`<workdir>/sft`). `rl`: multi-turn RL with targeted text feedback
from the SFT checkpoint (`<workdir>/rl`); both run on one device with `config.rl.model` overrides.

Shape suffixes: B batch, T time, V vocab, N decoded tokens.
"""

import dataclasses
import functools
import json
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax import model, sharding
from composer_jax.model.config import ModelConfig, RopeConfig

STAGES = ("demo", "pretrain", "synth", "sft", "rl")
_log = functools.partial(print, "[pipeline]", flush=True)


def run(config: Any, workdir: str) -> dict[str, Any]:
  """Runs each stage of `config.stages`; returns {stage: its summary dict}."""
  stages = parse_stages(config.stages)
  pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
  return {stage: _STAGE_FNS[stage](config, workdir) for stage in stages}


def parse_stages(stages: str) -> list[str]:
  names = [s.strip() for s in stages.split(",") if s.strip()]
  unknown = [s for s in names if s not in STAGES]
  if unknown or not names:
    raise ValueError(f"stages={stages!r} has unknown or no stage names; known stages: {', '.join(STAGES)}.")
  return names


def model_config_from(cfg: Any) -> ModelConfig:
  """`ModelConfig` from the experiment's `model` ConfigDict (or a plain dict)."""
  fields = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
  rope = RopeConfig(**dict(fields.pop("rope")))
  return ModelConfig(**fields, rope=rope)


def demo(config: Any, workdir: str) -> dict[str, Any]:
  """Sharded init, parameter table, one forward pass, greedy decoding."""
  cfg = model_config_from(config.model)
  meshes = sharding.make_meshes(config)
  _log(f"meshes: {sharding.describe(meshes)}")

  t0 = time.perf_counter()
  params = jax.block_until_ready(model.init(cfg, jax.random.key(config.seed), meshes))
  _log(f"init: {time.perf_counter() - t0:.1f}s")
  print(param_table(params, model.logical_axes(cfg)), flush=True)

  rng = jax.random.fold_in(jax.random.key(config.seed), 1)
  tokens_BT = jax.random.randint(rng, (config.demo.batch, config.demo.prompt_len), 0, cfg.vocab_size)
  tokens_BT = jax.device_put(tokens_BT, sharding.activation_sharding(("batch", "seq"), meshes))
  t0 = time.perf_counter()
  forward = jax.jit(functools.partial(model.apply, cfg=cfg, meshes=meshes))
  logits_BTV, aux = jax.block_until_ready(forward(params, tokens=tokens_BT))
  logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  loss = float(-jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1).mean())
  uniform = math.log(cfg.vocab_size)
  _log(
    f"forward: logits {tuple(logits_BTV.shape)} {logits_BTV.dtype}, next-token loss {loss:.4f} "
    f"vs uniform ln(V) = {uniform:.4f} ({time.perf_counter() - t0:.1f}s incl. compile)"
  )
  load = np.asarray(aux["expert_load"])
  _log(
    f"experts (EP={meshes.expert_parallelism}, {cfg.expert_impl}): max/mean load per MoE layer "
    f"{[f'{r:.2f}' for r in load.max(1) / load.mean(1)]}, dropped assignments {int(aux['overflow'])}"
  )

  t0 = time.perf_counter()
  decoded_BN = np.asarray(model.greedy_decode(params, cfg, tokens_BT, config.demo.decode_tokens, meshes))
  seconds = time.perf_counter() - t0
  _log(
    f"greedy decode: {decoded_BN.shape} in {seconds:.1f}s incl. compile; rows 0-1: {decoded_BN[:2].tolist()}"
  )

  summary = dict(loss=loss, uniform_loss=uniform, decoded=decoded_BN.tolist(), decode_seconds=seconds)
  pathlib.Path(workdir, "demo.json").write_text(json.dumps(summary, indent=1))
  return summary


def pretrain(config: Any, workdir: str) -> dict[str, Any]:
  """Trains `config.train.steps` steps (resuming from the newest checkpoint); returns the summary."""
  from composer_jax import optim, train
  from composer_jax.data import corpus, tokenizer  # tfds: imported only by the stages that read data
  from composer_jax.train import checkpoint, metrics
  from composer_jax.train import pretrain as pt

  cfg = model_config_from(config.model)
  tcfg = pt.TrainConfig(**config.train.to_dict())
  ocfg = optimizer_config_from(config)
  meshes = sharding.make_meshes(config)
  _log(f"meshes: {sharding.describe(meshes)}")
  d = config.data
  splits = corpus.build_corpus(str(pathlib.Path(workdir, "tfds")), src_dir=d.src_dir, max_files=d.max_files)
  tok = tokenizer.load(d.tokenizer)
  if tok.vocab_size > cfg.vocab_size:
    raise ValueError(
      f"tokenizer {d.tokenizer!r} has {tok.vocab_size} ids but model.vocab_size is {cfg.vocab_size}; "
      "raise --config.model.vocab_size or pick a smaller tokenizer."
    )

  tx = build_optimizer(ocfg, cfg, meshes)
  state = train.create_state(cfg, tx, jax.random.key(config.seed), meshes)
  shardings = train.state.state_shardings(state)
  record = checkpoint.config_record(
    model=dataclasses.replace(cfg, remat="none"),  # how to compute, not what: free to change on resume
    optim=ocfg,
    data=d,
    batch=dict(batch_size=tcfg.batch_size, seq_len=tcfg.seq_len),
    seed=config.seed,
  )
  ckpt = checkpoint.Checkpointer(pathlib.Path(workdir, "checkpoints"), record, keep=tcfg.keep_checkpoints)
  shape = dict(batch_size=tcfg.batch_size, seq_len=tcfg.seq_len)
  train_iter = corpus.batches(splits["train"], tok, **shape, seed=config.seed)
  if ckpt.latest_step() is not None:
    state, data_state = ckpt.restore(state)
    train_iter.set_state(data_state)
    _log(f"resumed from {ckpt.directory}/{int(state.step)}")
  eval_iter = corpus.batches(splits["validation"], tok, **shape, seed=0, shuffle=False, num_epochs=1)
  eval_batches = pt.fixed_batches(eval_iter, tcfg.eval_batches, meshes)

  schedule = optim.lr_schedule(ocfg)
  train_step = pt.make_train_step(
    cfg, tx, schedule, shardings, meshes,
    router_bias_rate=tcfg.router_bias_rate, grad_accum=tcfg.grad_accum, qk_clip_tau=ocfg.qk_clip_tau,
  )  # fmt: skip
  eval_step = pt.make_eval_step(cfg, shardings.params, meshes)
  n_active = pt.active_params(cfg)
  _log(f"pretrain: {n_active:,} active params/token, {tcfg.batch_size}x{tcfg.seq_len} tokens/step")
  writer = metrics.MetricsWriter(pathlib.Path(workdir, "metrics"))
  if not writer.has_tensorboard:
    _log("tensorboardX not installed: metrics go to metrics.jsonl only")

  def save(state, data_state, force):
    ckpt.save(state, data_state, force=force)

  try:
    state, summary = pt.fit(
      state, train_step, eval_step, train_iter, eval_batches, tcfg,
      meshes=meshes, writer=writer, save=save, flops_per_token=metrics.flops_per_token(n_active), log=print,
    )  # fmt: skip
  finally:
    ckpt.close()
    writer.close()
  summary["checkpoints"] = ckpt.all_steps()
  pathlib.Path(workdir, "pretrain.json").write_text(json.dumps(summary, indent=1))
  f = lambda key: "n/a" if summary[key] is None else f"{summary[key]:.4f}"  # noqa: E731
  _log(
    f"pretrain: steps {summary['start_step']}→{summary['steps']}, "
    f"train loss {f('first_train_loss')} → {f('last_train_loss')}, "
    f"validation {f('first_validation_loss')} → {f('last_validation_loss')}, "
    f"{summary['tokens_per_s']:,.0f} tok/s, {summary['seconds']:.0f} s"
  )
  return summary


def build_optimizer(ocfg: Any, cfg: ModelConfig, meshes: sharding.Meshes | None) -> Any:
  """`optim.build_optimizer` for the model `cfg` (its parameter shapes, abstractly)."""
  from composer_jax import optim

  return optim.build_optimizer(
    ocfg, jax.eval_shape(lambda: model.init(cfg, jax.random.key(0))), meshes, model_cfg=cfg
  )


def optimizer_config_from(config: Any) -> Any:
  """`optim.OptimizerConfig` from `config.optim`; `total_steps` None means `train.steps`.

  Warmup is cut to `total_steps - 1` for very short runs (optax needs a positive decay length).
  """
  from composer_jax import optim

  fields = config.optim.to_dict()
  if fields.get("total_steps") is None:
    fields["total_steps"] = config.train.steps
  fields["warmup_steps"] = min(fields["warmup_steps"], fields["total_steps"] - 1)
  return optim.OptimizerConfig(**fields)


def synth(config: Any, workdir: str) -> dict[str, Any]:
  """Feature-deletion tasks for `config.synth.sources` (+ `local_dir`); writes `<workdir>/synth.json`."""
  from composer_jax.synth import build  # subprocess-heavy, no jax: imported only by this stage

  s = config.synth
  items = build.resolve_sources(s.sources, s.local_dir)
  _log(f"synth: {len(items)} source(s), mode {s.mode}, max {s.max_tasks_per_source} task(s) per source")
  return build.build(
    items,
    workdir,
    mode=s.mode,
    max_tasks_per_source=s.max_tasks_per_source,
    runs=s.runs,
    timeout_s=s.timeout_s,
  )


def rl_model_config(config: Any) -> ModelConfig:
  """The experiment's model with `config.rl.model` overrides (the small one-device SFT/RL model)."""
  return dataclasses.replace(model_config_from(config.model), **config.rl.model.to_dict())


def _rl_optimizer(config: Any, lr: float, steps: int, warmup: int, min_lr_ratio: float) -> Any:
  from composer_jax import optim

  fields = config.optim.to_dict() | dict(
    learning_rate=lr,
    total_steps=max(steps, 2),
    warmup_steps=min(warmup, max(steps, 2) - 1),
    min_lr_ratio=min_lr_ratio,
  )
  return optim.OptimizerConfig(**fields)


def sft(config: Any, workdir: str) -> dict[str, Any]:
  """SFT warm-up on `toy.demonstrations` (one device, meshes None); resumes from `<workdir>/sft`."""
  from composer_jax import optim, train
  from composer_jax.rl import sft as sft_lib
  from composer_jax.rl import train as rl_train
  from composer_jax.rl.envs import toy
  from composer_jax.train import checkpoint, metrics

  cfg = rl_model_config(config)
  scfg = sft_lib.SFTConfig(**{k: v for k, v in config.sft.to_dict().items() if k != "eval_problems"})
  ocfg = _rl_optimizer(config, scfg.lr, scfg.steps, scfg.warmup_steps, 0.1)
  tx = build_optimizer(ocfg, cfg, None)
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
  writer = metrics.MetricsWriter(pathlib.Path(workdir, "sft_metrics"))
  try:
    state, summary = sft_lib.fit(
      state, step, demos, scfg, seed=config.seed, writer=writer,
      save=lambda s, force: ckpt.save(s, {}, force=force), log=print,
    )  # fmt: skip
  finally:
    ckpt.close()
    writer.close()
  rcfg = rl_config_from(config)
  for name, temp in (("sampled", rcfg.temperature), ("greedy", 0.0)):
    ev = rl_train.evaluate(state.params, cfg, rcfg, n=config.sft.eval_problems, temperature=temp)
    summary[f"eval_{name}"] = ev
    _log(
      f"sft eval ({name}, {config.sft.eval_problems} problems): pass {ev['pass_rate']:.2f} "
      f"invalid-call rate {ev['invalid_call_rate']:.3f} turns {ev['turns_per_rollout']:.2f}"
    )
  summary.pop("losses")
  pathlib.Path(workdir, "sft.json").write_text(json.dumps(summary, indent=1))
  _log(f"sft: loss {summary['first_loss']} -> {summary['last_loss']} in {summary['seconds']:.0f}s")
  return summary


def rl_config_from(config: Any) -> Any:
  from composer_jax.rl import train as rl_train

  fields = {k: v for k, v in config.rl.to_dict().items() if k not in ("model", "coding")}
  return rl_train.RLConfig(**fields)


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
  tx = build_optimizer(ocfg, cfg, None)
  template = train.create_state(cfg, tx, jax.random.key(0), None)
  ck = checkpoint.Checkpointer(d, meta["config"], keep=100)
  try:
    state, _ = ck.restore(template, step)
  finally:
    ck.close()
  return state.params


def rl(config: Any, workdir: str) -> dict[str, Any]:
  """RL from the SFT checkpoint (random init if none, with a warning); resumes from `<workdir>/rl`."""
  from composer_jax import optim, train
  from composer_jax.rl import train as rl_train
  from composer_jax.train import checkpoint, metrics

  cfg = rl_model_config(config)
  rcfg = rl_config_from(config)
  ocfg = _rl_optimizer(config, rcfg.lr, rcfg.steps, 0, 1.0)
  tx = build_optimizer(ocfg, cfg, None)
  state = train.create_state(cfg, tx, jax.random.key(config.seed), None)
  record = checkpoint.config_record(model=cfg, optim=ocfg, rl=rcfg, seed=config.seed)
  ckpt = checkpoint.Checkpointer(pathlib.Path(workdir, "rl"), record, keep=rcfg.keep_checkpoints)
  if ckpt.latest_step() is not None:
    state, _ = ckpt.restore(state)
    _log(f"rl: resumed from {ckpt.directory}/{int(state.step)}")
  else:
    params = load_sft_params(workdir, cfg)
    if params is None:
      _log("rl: no SFT checkpoint under <workdir>/sft: starting from random weights (run stage sft first)")
    else:
      state = train.TrainState(step=state.step, params=params, opt_state=tx.init(params))
      _log(f"rl: starting from the SFT checkpoint in {workdir}/sft")
  if rcfg.env == "toy":
    make_envs = rl_train.toy_envs(rcfg)
  elif rcfg.env == "coding":
    make_envs = _coding_envs(config, workdir, rcfg)
  else:
    raise ValueError(f"rl.env must be 'toy' or 'coding', got {rcfg.env!r}")
  schedule = optim.lr_schedule(ocfg)
  steps = {fb: rl_train.make_rl_step(cfg, tx, schedule, rcfg, with_feedback=fb) for fb in (False, True)}
  _log(
    f"rl: env {rcfg.env}, {rcfg.steps} steps x {rcfg.problems_per_step} problems x {rcfg.group_size} "
    f"rollouts, "
    f"{rcfg.objective}/{rcfg.advantage}, lambda_feedback {rcfg.lambda_feedback} ({rcfg.divergence})"
  )
  writer = metrics.MetricsWriter(pathlib.Path(workdir, "rl_metrics"))
  try:
    state, summary = rl_train.fit(
      state, steps, make_envs, cfg, rcfg, writer=writer,
      save=lambda s, force: ckpt.save(s, {}, force=force), log=print,
    )  # fmt: skip
  finally:
    ckpt.close()
    writer.close()
  h = summary["history"]
  if h:
    _log(
      f"rl: reward {h[0]['reward']:.3f} -> {h[-1]['reward']:.3f}, invalid-call rate "
      f"{h[0]['invalid_call_rate']:.3f} -> {h[-1]['invalid_call_rate']:.3f}, {summary['seconds']:.0f}s"
    )
  pathlib.Path(workdir, "rl.json").write_text(json.dumps(summary, indent=1))
  return summary


def _coding_envs(config: Any, workdir: str, rcfg: Any):
  """P tasks of the TFDS dataset `<workdir>/synth_tasks` (stage synth) x G rollouts per step."""
  from composer_jax.rl.envs import coding
  from composer_jax.synth import dataset, tasks

  records = dataset.read_tasks(pathlib.Path(workdir, "synth_tasks"))
  if not records:
    raise ValueError(f"no tasks under {workdir}/synth_tasks: run stage synth first")
  task_list = [tasks.Task.from_record(r) for r in records]
  root = pathlib.Path(workdir, "rl_episodes")
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


_STAGE_FNS = {"demo": demo, "pretrain": pretrain, "synth": synth, "sft": sft, "rl": rl}


@dataclasses.dataclass(frozen=True)
class _Leaf:
  path: str
  shape: tuple[int, ...]
  dtype: str
  axes: tuple[str | None, ...]
  where: str  # "<mesh role> mesh (<axis sizes>) P(<spec>)"
  size: int
  expert: bool


def param_table(params: Any, logical_axes: Any) -> str:
  """Per top-level group: leaves and parameter count; the largest leaf of each group with its
  logical axes and sharding (always including one expert leaf); totals, expert vs non-expert."""
  tree = jax.tree_util.tree_map_with_path(_leaf, logical_axes, params, is_leaf=lambda x: isinstance(x, tuple))
  leaves = jax.tree.leaves(tree)
  groups: dict[str, list[_Leaf]] = {}
  for leaf in leaves:
    groups.setdefault(leaf.path.split("/")[0], []).append(leaf)
  total = sum(leaf.size for leaf in leaves)
  expert = sum(leaf.size for leaf in leaves if leaf.expert)

  lines = [f"{'group':<24}{'leaves':>8}{'params':>14}{'share':>8}"]
  for name, group in groups.items():
    n = sum(leaf.size for leaf in group)
    lines.append(f"{name:<24}{len(group):>8}{_count(n):>14}{n / max(total, 1):>8.1%}")
  shown = [max(group, key=lambda leaf: leaf.size) for group in groups.values()]
  experts = [leaf for leaf in leaves if leaf.expert]
  if experts and not any(leaf.expert for leaf in shown):
    shown.append(max(experts, key=lambda leaf: leaf.size))
  rows = [("leaf", "shape", "dtype", "logical axes", "sharding")]
  rows += [(leaf.path, str(leaf.shape), leaf.dtype, str(leaf.axes), leaf.where) for leaf in shown]
  widths = [max(len(row[i]) for row in rows) + 2 for i in range(4)]
  lines += [""] + [
    "".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + row[-1] for row in rows
  ]
  share = expert / max(total, 1)
  lines += [
    "",
    f"params: total {_count(total)}, expert {_count(expert)} ({share:.1%}), other {_count(total - expert)}",
  ]
  return "\n".join(lines)


def _leaf(path: Any, axes: tuple[str | None, ...], p: Any) -> _Leaf:
  expert, s = sharding.is_expert_param(axes), getattr(p, "sharding", None)
  where = str(s)
  if isinstance(s, jax.sharding.NamedSharding):
    sizes = ",".join(f"{k}={v}" for k, v in s.mesh.shape.items())
    where = f"{'expert' if expert else 'dense'} mesh ({sizes}) P({', '.join(map(repr, s.spec))})"
  path = jax.tree_util.keystr(path, simple=True, separator="/")
  return _Leaf(path, tuple(p.shape), str(p.dtype), tuple(axes), where, math.prod(p.shape), expert)


def _count(n: int) -> str:
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= scale:
      return f"{n / scale:.2f}{unit}"
  return str(n)
