"""A seconds-long pretraining run for the tests that drive `run.py` as a user would (test_robustness.py):
the tiny variant with the two-layer test model (tests/tiny.py) on a corpus directory given by the test."""

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from tiny import TINY  # noqa: E402

from composer_jax import configs  # noqa: E402


def get_config(arg: str = "") -> object:
  del arg
  config = configs.Config(
    variant="small",
    stages="pretrain",
    model=dataclasses.replace(TINY, vocab_size=272),  # the byte tokenizer's 267 ids fit
    train=configs.TrainConfig(
      schedule=configs.ScheduleConfig(
        steps=8, warmup_steps=1, log_every=1, eval_every=100, checkpoint_every=2, keep_checkpoints=2
      ),
      batch_size=4,
      seq_len=32,
      eval_batches=1,
    ),
    optim=configs.OptimizerConfig(learning_rate=1e-2),
  )
  return configs.to_config_dict(config)
