"""The config layer: dataclasses are the one source of defaults, conversion round-trips, unknown keys
anywhere fail with one line naming the key, and run.py reports bad input in one line before any work."""

import dataclasses
import importlib.util
import pathlib
import subprocess
import sys
import typing

import pytest

from composer_jax import configs

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _experiment():
  spec = importlib.util.spec_from_file_location("composer25", _ROOT / "experiments" / "composer25.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("variant", ["tiny", "moonlight_16b", "kimi_k25_1t"])
def test_every_variant_round_trips_and_sets_every_section(variant):
  cd = _experiment().get_config(variant)
  config = configs.from_config(cd)
  assert configs.to_config_dict(config).to_dict() == cd.to_dict()
  assert set(cd) == {f.name for f in dataclasses.fields(configs.Config)}


def test_tiny_is_the_dataclass_defaults_but_the_model():
  tiny = configs.from_config(_experiment().get_config("tiny"))
  assert dataclasses.replace(tiny, model=configs.ModelConfig()) == configs.Config()


def test_an_override_of_an_optional_field_is_typed():
  cd = _experiment().get_config("tiny")
  cd.data.src_dir = "/some/dir"  # a placeholder (None) that keeps its type: a string may be set
  cd.optim.total_steps = 7
  config = configs.from_config(cd)
  assert config.data.src_dir == "/some/dir" and configs.pretrain_optimizer(config).total_steps == 7


@pytest.mark.parametrize(
  "values, message",
  [
    (dict(rl=dict(stepz=3)), "unknown config key 'rl.stepz'; did you mean 'rl.schedule.steps'?"),
    (dict(rl=dict(steps=3)), "unknown config key 'rl.steps'; did you mean 'rl.schedule.steps'?"),
    (dict(optim=dict(warmup_steps=5)), "unknown config key 'optim.warmup_steps': it is derived"),
    (dict(train=dict(bogus=1)), "unknown config key 'train.bogus'; valid keys here: schedule, "),
    (dict(rl=dict(stale=dict(ratez=3))), "unknown config key 'rl.stale.ratez'; did you mean 'rl.stale.rate"),
    (dict(model=dict(rope=dict(thetta=1.0))), "unknown config key 'model.rope.thetta'; did you mean 'model"),
    (dict(stagez="demo"), "unknown config key 'stagez'; did you mean 'stages'?"),
    (dict(train=dict(schedule=dict(steps="many"))), "train.schedule.steps='many': expected int, got str"),
    (dict(mesh=dict(dense=4)), "mesh.dense must be a tuple"),
    (dict(model=dict(n_experts=3, n_group=2)), "model: Invalid ModelConfig: n_experts=3 is not divisible"),
  ],
)  # fmt: skip
def test_bad_keys_and_values_name_the_key(values, message):
  with pytest.raises(configs.ConfigError) as e:
    configs.from_config(values)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_check_path_walks_sections_and_partial_sections():
  for ok in ("rl.schedule.steps", "rl.stale.rate", "model.rope.theta", "compile.topology", "seed"):
    configs.check_path(ok)
  with pytest.raises(
    configs.ConfigError, match="'rl.coding.output_charz'; did you mean 'rl.coding.output_chars'"
  ):
    configs.check_path("rl.coding.output_charz")


def test_stage_optimizer_ignores_the_pretrain_horizon():
  ocfg = configs.OptimizerConfig(total_steps=10_000)
  schedule = configs.ScheduleConfig(steps=20, warmup_steps=3)
  rl = configs.stage_optimizer(ocfg, schedule, lr=3e-4, min_lr_ratio=1.0)
  assert (rl.total_steps, rl.warmup_steps, rl.learning_rate, rl.min_lr_ratio) == (20, 3, 3e-4, 1.0)
  assert configs.optimizer_for(ocfg, configs.ScheduleConfig(steps=60, warmup_steps=500)).warmup_steps == 500
  short = configs.ScheduleConfig(steps=1, warmup_steps=10)
  short = configs.optimizer_for(configs.OptimizerConfig(), short)  # optax needs a positive decay length
  assert (short.total_steps, short.warmup_steps) == (2, 1)


def test_the_three_stages_share_one_schedule_section():
  sections = (configs.TrainConfig, configs.SFTConfig, configs.RLConfig)
  assert {typing.get_type_hints(s)["schedule"] for s in sections} == {configs.ScheduleConfig}
  config = configs.Config()
  assert [s.schedule.steps for s in (config.train, config.sft, config.rl)] == [60, 300, 30]
  assert configs.pretrain_optimizer(config).warmup_steps == config.train.schedule.warmup_steps == 10
  flat = ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "warmup_steps")
  for section in sections + (configs.OptimizerConfig,):
    assert not set(flat) & set(configs.to_config_dict(section())), section
  # A partial section keeps the stage's own defaults for the keys it leaves out.
  rl = configs.from_config(dict(rl=dict(schedule=dict(steps=7)))).rl.schedule
  assert rl == dataclasses.replace(configs.RLConfig().schedule, steps=7)


def test_a_schedule_flag_sets_that_stage_only(monkeypatch):
  """run.py's parser (ml_collections' config flag, locked; it reads the overrides from sys.argv when it is
  defined) on the experiment file, then `from_config`."""
  from absl import flags
  from ml_collections import config_flags

  argv = ["run.py", "--config.rl.schedule.steps=7", "--config.train.schedule.warmup_steps=4"]
  monkeypatch.setattr(sys, "argv", argv)
  fv = flags.FlagValues()
  path = str(_ROOT / "experiments" / "composer25.py")
  config_flags.DEFINE_config_file("config", path, flag_values=fv, lock_config=True)
  fv(argv)
  config = configs.from_config(fv.config)
  assert config.rl.schedule == dataclasses.replace(configs.RLConfig().schedule, steps=7)
  assert config.train.schedule.warmup_steps == 4 and config.sft.schedule == configs.SFTConfig().schedule
  assert configs.pretrain_optimizer(config).warmup_steps == 4
  with pytest.raises(configs.ConfigError, match=r"^unknown config key 'rl.steps'; did you mean 'rl.schedule"):
    configs.check_path("rl.steps")  # what run.py reports when the flag parser refuses the old flat key


def test_a_checkpoint_continues_across_cadence_but_not_warmup():
  rl = configs.RLConfig()
  longer = dataclasses.replace(rl.schedule, steps=99, log_every=7, eval_every=0, keep_checkpoints=3)
  assert configs.identity(dataclasses.replace(rl, schedule=longer)) == configs.identity(rl)
  warmer = dataclasses.replace(rl, schedule=dataclasses.replace(rl.schedule, warmup_steps=4))
  assert configs.identity(warmer) != configs.identity(rl)
  assert configs.identity(rl)["schedule"] == {"warmup_steps": 3}
  assert "sft.schedule.steps" in configs.cadence_paths(
    "sft"
  ) and "sft.eval_problems" in configs.cadence_paths("sft")


@pytest.mark.parametrize(
  "args, message",
  [
    (["--config.rl.stepz=3"], "unknown config key 'rl.stepz'; did you mean 'rl.schedule.steps'?"),
    (["--config.rl.steps=7"], "unknown config key 'rl.steps'; did you mean 'rl.schedule.steps'?"),
    (["--config.optim.warmup_steps=5"], "unknown config key 'optim.warmup_steps': it is derived"),
    (["--config.train.bogus=1"], "unknown config key 'train.bogus'"),
    (["--config=experiments/nope.py"], "config file 'experiments/nope.py' not found"),
    (["--config=experiments/composer25.py:huge"], "unknown variant 'huge'"),
    (["--config.stages=pretrian"], "unknown stage(s) pretrian; known stages: demo, pretrain"),
    (["--config.train.schedule.steps=abc"], "--config.train.schedule.steps=abc"),
    (["--workdir=/proc/x"], "--workdir /proc/x is not a writable directory"),
  ],
)  # fmt: skip
def test_run_py_reports_bad_input_in_one_line(args, message, tmp_path):
  extra = [] if any(a.startswith("--workdir") for a in args) else [f"--workdir={tmp_path / 'w'}"]
  p = subprocess.run(
    [sys.executable, "run.py", *args, *extra], cwd=_ROOT, capture_output=True, text=True, timeout=120,
    env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
  )  # fmt: skip
  lines = [line for line in p.stderr.splitlines() if line.strip()]
  assert p.returncode == 2 and len(lines) == 1 and message in lines[0], p.stderr
  assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())  # no work was done
