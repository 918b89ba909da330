"""The config layer: dataclasses are the one source of defaults, conversion round-trips, unknown keys
anywhere fail with one line naming the key, and run.py reports bad input in one line before any work."""

import dataclasses
import importlib.util
import pathlib
import subprocess
import sys

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
    (dict(rl=dict(stepz=3)), "unknown config key 'rl.stepz'; did you mean 'rl.steps'?"),
    (dict(train=dict(bogus=1)), "unknown config key 'train.bogus'; valid keys here: steps, "),
    (dict(rl=dict(stale=dict(ratez=3))), "unknown config key 'rl.stale.ratez'; did you mean 'rl.stale.rate"),
    (dict(model=dict(rope=dict(thetta=1.0))), "unknown config key 'model.rope.thetta'; did you mean 'model"),
    (dict(stagez="demo"), "unknown config key 'stagez'; did you mean 'stages'?"),
    (dict(train=dict(steps="many")), "train.steps='many': expected int, got str"),
    (dict(mesh=dict(dense=4)), "mesh.dense must be a tuple"),
    (dict(model=dict(n_experts=3, n_group=2)), "model: Invalid ModelConfig: n_experts=3 is not divisible"),
  ],
)  # fmt: skip
def test_bad_keys_and_values_name_the_key(values, message):
  with pytest.raises(configs.ConfigError) as e:
    configs.from_config(values)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_check_path_walks_sections_and_partial_sections():
  for ok in ("rl.steps", "rl.stale.rate", "model.rope.theta", "compile.topology", "seed"):
    configs.check_path(ok)
  with pytest.raises(
    configs.ConfigError, match="'rl.coding.output_charz'; did you mean 'rl.coding.output_chars'"
  ):
    configs.check_path("rl.coding.output_charz")


def test_stage_optimizer_ignores_the_pretrain_horizon():
  ocfg = configs.OptimizerConfig(total_steps=10_000, warmup_steps=500)
  rl = configs.stage_optimizer(ocfg, 20, lr=3e-4, warmup=3, min_lr_ratio=1.0)
  assert (rl.total_steps, rl.warmup_steps, rl.learning_rate, rl.min_lr_ratio) == (20, 3, 3e-4, 1.0)
  short = configs.optimizer_for(configs.OptimizerConfig(), 1)  # optax needs a positive decay length
  assert (short.total_steps, short.warmup_steps) == (2, 1)


@pytest.mark.parametrize(
  "args, message",
  [
    (["--config.rl.stepz=3"], "unknown config key 'rl.stepz'; did you mean 'rl.steps'?"),
    (["--config.train.bogus=1"], "unknown config key 'train.bogus'"),
    (["--config=experiments/nope.py"], "config file 'experiments/nope.py' not found"),
    (["--config=experiments/composer25.py:huge"], "unknown variant 'huge'"),
    (["--config.stages=pretrian"], "unknown stage(s) pretrian; known stages: demo, pretrain"),
    (["--config.train.steps=abc"], "--config.train.steps=abc"),
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
