"""Environment factories: what the RL loop rolls out at step s, as a pure function of (config, s).

  make = factory(rcfg, workdir, episodes_dir)   # by `rcfg.env`: "toy" | "coding"
  env_list, seeds, group_ids = make(step)        # P problems × G rollouts, one group per problem

Adding an environment: write it under `rl/envs/` (the `Env` protocol in `rl/envs/__init__.py`), then a
factory here and its name in `FACTORIES`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import numpy as np

from composer_jax.configs import RLConfig
from composer_jax.rl.envs import Env

Make = Callable[[int], tuple[list[Env], list[int], list[int]]]


def toy_envs(rcfg: RLConfig, workdir: str | None = None, episodes: pathlib.Path | None = None) -> Make:
  """P arithmetic problems × G rollouts per step; the problem seeds are a pure function of (seed, step)."""
  from composer_jax.rl.envs import toy

  toy_cfg = toy.ToyConfig(max_turns=rcfg.max_turns)

  def make(step: int):
    rng = np.random.default_rng([rcfg.seed, step, 1])
    seeds = rng.integers(0, 1 << 30, size=rcfg.problems_per_step).tolist()
    G = rcfg.group_size
    return (
      [toy.ToyEnv(toy_cfg) for _ in range(len(seeds) * G)],
      [s for s in seeds for _ in range(G)],
      [p for p in range(len(seeds)) for _ in range(G)],
    )

  return make


def coding_envs(rcfg: RLConfig, workdir: str, root: pathlib.Path) -> Make:
  """P tasks of the TFDS dataset `<workdir>/synth_tasks` (stage synth) x G rollouts per step; the
  episodes' checkouts under `root`."""
  from composer_jax.rl.envs import coding
  from composer_jax.synth import dataset, tasks

  records = dataset.read_tasks(pathlib.Path(workdir, "synth_tasks"))
  if not records:
    raise ValueError(f"no tasks under {workdir}/synth_tasks: run stage synth first")
  task_list = [tasks.Task.from_record(r) for r in records]
  ccfg = coding.CodingConfig(max_turns=rcfg.max_turns, max_output_chars=rcfg.coding.output_chars)

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


FACTORIES: dict[str, Callable[..., Make]] = {"toy": toy_envs, "coding": coding_envs}


def factory(rcfg: RLConfig, workdir: str, episodes: pathlib.Path) -> Make:
  """The factory of `rcfg.env` (episodes: where environments that need a directory keep theirs)."""
  if rcfg.env not in FACTORIES:
    raise ValueError(f"rl.env must be one of {', '.join(FACTORIES)}; got {rcfg.env!r}")
  return FACTORIES[rcfg.env](rcfg, workdir, episodes)
