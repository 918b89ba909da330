"""A resumed RL arm keeps its history (issue 41): interrupted at a step drawn at random and resumed, the
rl stage's `run_arm` returns the training records and the fixed-set evaluations (each with its per-problem
outcomes) of the arm that was never interrupted, steps and values."""

import dataclasses
import os
import random
import signal

import jax
import pytest
from tiny import TINY

from composer_jax import configs, model
from composer_jax.rl.envs import factories
from composer_jax.stages import rl as rl_stage
from composer_jax.stages.record import Interrupted

STEPS = 4
CFG = dataclasses.replace(TINY, vocab_size=272, max_position_embeddings=512)  # the byte chat vocabulary
# λ = 0 (no teacher program), 2 problems x 2 rollouts a step, the fixed set of 4 problems at steps 0, 2, 4,
# a checkpoint every 2 steps: few compiles, each rollout a couple of short turns.
RC = configs.RLConfig(
  env="toy", lambda_feedback=0.0, problems_per_step=2, group_size=2, max_turns=2, max_turn_tokens=8,
  cache_len=192, eval_problems=4, lr=1e-2,
  schedule=configs.ScheduleConfig(steps=STEPS, log_every=1, eval_every=2, checkpoint_every=2),
)  # fmt: skip
CONFIG = configs.Config(model=CFG, rl=RC)
TIMING = {"step_s", "rollout_s"}  # wall-clock seconds: the only values two runs may not share


@pytest.fixture
def no_sft(monkeypatch):
  """The arm starts from a random init (same key every time) instead of an SFT checkpoint."""

  def starting_params(config, workdir, upstream, meshes):
    return model.init(config.model, jax.random.key(0), meshes), "random init (test)"

  monkeypatch.setattr(rl_stage.weights, "starting_params", starting_params)


def _signal_at(monkeypatch, step: int) -> None:
  """SIGINT while step `step`'s rollouts are drawn: the loop finishes that step, saves and stops (what a
  scheduler's SIGTERM or a Ctrl-C does)."""
  factory = factories.factory

  def interrupting(rcfg, workdir, episodes):
    make = factory(rcfg, workdir, episodes)

    def make_envs(s):
      if s == step:
        os.kill(os.getpid(), signal.SIGINT)
      return make(s)

    return make_envs

  monkeypatch.setattr(factories, "factory", interrupting)


def _untimed(history: list[dict]) -> list[dict]:
  return [{k: v for k, v in r.items() if k not in TIMING} for r in history]


def test_interrupted_and_resumed_arm_keeps_its_whole_history(no_sft, monkeypatch, tmp_path):
  whole = rl_stage.run_arm(CONFIG, str(tmp_path / "whole"), RC, "rl")
  stop = random.Random(41).randint(1, STEPS - 1)
  with monkeypatch.context() as m:
    _signal_at(m, stop)
    with pytest.raises(Interrupted, match=f"stopped at step {stop}"):
      rl_stage.run_arm(CONFIG, str(tmp_path / "cut"), RC, "rl")
  resumed = rl_stage.run_arm(CONFIG, str(tmp_path / "cut"), RC, "rl")
  assert resumed["start_step"] == stop and whole["start_step"] == 0
  assert [e["step"] for e in whole["evals"]] == [0, 2, 4]
  assert all(len(e["problems"]["seed"]) == RC.eval_problems for e in whole["evals"])
  assert resumed["evals"] == whole["evals"]  # steps, scores and every problem's outcome
  assert [r["step"] for r in resumed["history"]] == list(range(1, STEPS + 1))
  assert _untimed(resumed["history"]) == _untimed(whole["history"])
  for key in ("reward", "eval_reward"):
    assert resumed[f"first_{key}"] == whole[f"first_{key}"] and resumed[f"last_{key}"] == whole[f"last_{key}"]
