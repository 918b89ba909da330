"""Where a stage's starting weights come from: the upstream stage's newest checkpoint, or `init_from`.

  params, source = weights.starting_params(config, workdir, "sft", meshes)   # gate, rl: from sft
  params, source = weights.starting_params(config, workdir, "pretrain", meshes)  # sft: from pretrain

One chain for every stage: pretrain -> sft -> gate and rl, all on the same two meshes. `source` is the
line a stage logs and records ("pretrain checkpoint runs/tiny/checkpoints/60"). A missing upstream is one
line naming the stage to run first.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
from absl import logging

from composer_jax import configs, optim, sharding
from composer_jax.configs import Config
from composer_jax.model.config import ModelConfig

# The checkpoint directory of each training stage under the workdir.
CHECKPOINT_DIRS = {"pretrain": "checkpoints", "sft": "sft"}
# ModelConfig fields that say how to compute, not what the weights are: free to differ between stages.
_HOW = set(configs.COMPUTE_FIELDS) | {"attention_impl", "scan_layers"}


class MissingUpstream(FileNotFoundError):
  """The stage a stage starts from has no checkpoint (and there is no `init_from`)."""


def model_identity(record: dict) -> dict:
  """The fields of a model record that fix the weights' shapes and meaning."""
  return {k: v for k, v in record.items() if k not in _HOW}


def checkpoint_params(
  directory: pathlib.Path, cfg: ModelConfig, meshes: sharding.Meshes | None
) -> tuple[Any, int] | None:
  """(params, step) of the newest checkpoint under `directory`, placed on `meshes` (None: no checkpoint).

  The whole train state is restored into a template built with the optimizer the checkpoint was written
  with (its record says which), then only the params are kept."""
  from composer_jax import train
  from composer_jax.train import checkpoint

  if not directory.exists():
    return None
  probe = checkpoint.Checkpointer(directory, {}, keep=100)
  try:
    step = probe.latest_step()
    meta = None if step is None else probe.read_meta(step)
  finally:
    probe.close()
  if meta is None:
    return None
  saved = meta["config"].get("model", {})
  if model_identity(saved) != model_identity(configs.record(model=cfg)["model"]):
    differ = sorted(k for k in model_identity(saved) if saved.get(k) != configs.plain(cfg).get(k))
    raise checkpoint.CheckpointError(
      f"{directory}/{step} holds another model (differs in {', '.join(differ) or 'its fields'}); "
      "rerun that stage with this model (or --config.force it)"
    )
  saved_optim = configs.from_dict(configs.OptimizerConfig, meta["config"]["optim"], derived=True)
  ocfg = configs.optimizer_for(saved_optim, configs.ScheduleConfig(steps=2))  # the state's shapes only
  tx = optim.build_optimizer(cfg, ocfg, meshes)
  template = train.create_state(cfg, tx, jax.random.key(0), meshes)
  ck = checkpoint.Checkpointer(directory, meta["config"], keep=100)
  try:
    state, _ = ck.restore(template, step)
  finally:
    ck.close()
  return state.params, step


def hf_params(config: Config, meshes: sharding.Meshes | None) -> Any:
  """The `init_from` checkpoint's weights on `meshes`."""
  from composer_jax import model

  return model.load_hf_checkpoint(config.init_from, config.model, meshes)


def starting_params(
  config: Config, workdir: str, upstream: str, meshes: sharding.Meshes | None
) -> tuple[Any, str]:
  """(params, where they came from) for a stage that starts from `upstream`'s newest checkpoint; without
  one, `init_from`'s weights; without those, MissingUpstream (one line naming the stage to run)."""
  directory = pathlib.Path(workdir, CHECKPOINT_DIRS[upstream])
  found = checkpoint_params(directory, config.model, meshes)
  if found is not None:
    params, step = found
    return params, f"{upstream} checkpoint {directory}/{step}"
  if config.init_from:
    logging.info("no %s checkpoint under %s: starting from init_from's weights", upstream, directory)
    return hf_params(config, meshes), f"init_from {config.init_from}"
  raise MissingUpstream(
    f"no {upstream} checkpoint under {directory} (and no init_from): run stage {upstream} first"
  )
