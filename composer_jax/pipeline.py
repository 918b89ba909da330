"""Stages wired together: `run(config, workdir)` runs `config.stages` in order, then prints a summary.

`demo`: build both meshes, initialise the sharded model, print where each parameter lives, run one
forward pass and greedy-decode a few tokens. `pretrain`: next-token training on the stdlib corpus,
resuming from `<workdir>/checkpoints`. `synth`: feature-deletion coding tasks from real repositories
(`composer_jax/synth/build.py`) into the TFDS dataset `<workdir>/synth_tasks`. `sft` and `rl`
(`composer_jax/rl/stages.py`): a small one-device model warmed up on toy tool-use demonstrations, then
multi-turn RL with targeted text feedback. `plan` (`composer_jax/plan.py`): per-device memory and traffic.

Stage-level resume: a finished stage writes `<workdir>/stages/<stage>.json` (its summary, wall time and
the config entries it depends on, fingerprinted; a downstream stage's fingerprint includes the run of the
stages it reads). A rerun skips a finished stage whose fingerprint is unchanged and reuses its saved
summary; a changed one reruns (pretrain in place, so raising `train.steps` continues training; the others
start over, their old outputs moved to `<workdir>/stages/previous/`). `config.force` ("sft,rl" or "all")
starts stages over the same way. An interrupted stage (Ctrl-C, a crash) writes no marker and resumes from
its own checkpoints on the next run; Ctrl-C stops the run after the stage has saved.

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

STAGES = ("demo", "pretrain", "synth", "sft", "rl", "plan")
_log = functools.partial(print, "[pipeline]", flush=True)


def run(config: Any, workdir: str) -> dict[str, Any]:
  """Runs (or skips, when finished with the same config) each stage of `config.stages`, prints the
  summary and writes `<workdir>/summary.json`; returns {stage: its summary dict}."""
  from composer_jax import report, resume

  stages = parse_stages(config.stages)
  force = _parse_force(config.get("force") or "", stages)
  pathlib.Path(workdir, "stages").mkdir(parents=True, exist_ok=True)
  results: dict[str, Any] = {}
  runs: dict[str, dict] = {}
  try:
    for i, stage in enumerate(stages):
      _log(f"===== stage {i + 1}/{len(stages)}: {stage} =====")
      results[stage], runs[stage] = resume.run_stage(
        stage, _STAGE_FNS[stage], config, workdir, stage in force
      )
  except KeyboardInterrupt:
    _log(
      f"interrupted in stage {stages[len(results)]}: it saved its checkpoint; finished stages are recorded "
      f"under {workdir}/stages. Rerun the same command to resume."
    )
    raise
  finally:
    if results:
      text = report.write(report.build(results, runs, workdir), workdir)
      print(text, flush=True)
  return results


def parse_stages(stages: str) -> list[str]:
  names = [s.strip() for s in stages.split(",") if s.strip()]
  unknown = [s for s in names if s not in STAGES]
  if unknown or not names:
    raise ValueError(f"stages={stages!r} has unknown or no stage names; known stages: {', '.join(STAGES)}.")
  return names


def _parse_force(force: str, stages: list[str]) -> set[str]:
  if force.strip() == "all":
    return set(stages)
  return set(parse_stages(force)) if force.strip() else set()


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

  return optim.build_optimizer(cfg, ocfg, meshes)


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
    done_dir=pathlib.Path(workdir, "synth_done"),
  )


def sft(config: Any, workdir: str) -> dict[str, Any]:
  """`composer_jax.rl.stages.sft`: SFT warm-up of the small one-device model (`<workdir>/sft`)."""
  from composer_jax.rl import stages

  return stages.sft(config, workdir)


def rl(config: Any, workdir: str) -> dict[str, Any]:
  """`composer_jax.rl.stages.rl`: RL with targeted text feedback from the SFT checkpoint (`<workdir>/rl`)."""
  from composer_jax.rl import stages

  return stages.rl(config, workdir)


def plan(config: Any, workdir: str) -> dict[str, Any]:
  """`composer_jax.plan.run_stage`: per-device memory and collective traffic of `config` (`config.plan`)."""
  from composer_jax import plan as planner

  return planner.run_stage(config, workdir)


_STAGE_FNS = {"demo": demo, "pretrain": pretrain, "synth": synth, "sft": sft, "rl": rl, "plan": plan}


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
