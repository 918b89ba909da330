"""Environment factories: what the RL loop rolls out at step s, as a pure function of (config, s).

  make = factory(rcfg, workdir, episodes_dir)   # by `rcfg.env`: "stale" | "toy" | "ledger" | "coding"
  env_list, seeds, group_ids = make(step)        # P problems × G rollouts, one group per problem
  env_list, seeds = fixed_set(rcfg, n)           # the fixed evaluation problems (seeded envs)
  demos = demonstrations(rcfg, scfg, seed, tok)  # the SFT corpus of the env's family

Adding an environment: write it under `rl/envs/` (the `Env` protocol in `rl/envs/__init__.py`), then a
factory here and its name in `FACTORIES` (and in `MAKE_ONE` if it has a fixed evaluation set).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np

from composer_jax.configs import RLConfig, SFTConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl.envs import Env

Make = Callable[[int], tuple[list[Env], list[int], list[int]]]


def _toy(rcfg: RLConfig) -> Env:
  from composer_jax.rl.envs import toy

  return toy.ToyEnv(toy.ToyConfig(max_turns=rcfg.max_turns))


def _stale(rcfg: RLConfig) -> Env:
  from composer_jax.rl.envs import stale

  s = rcfg.stale
  cfg = stale.StaleConfig(
    stale_rate=s.rate,
    invalid_penalty=s.invalid_penalty,
    max_errors=s.max_errors,
    max_ops=s.max_ops,
    max_turns=rcfg.max_turns,
  )
  return stale.StaleEnv(cfg)


def _ledger(rcfg: RLConfig) -> Env:
  from composer_jax.rl.envs import ledger

  c = rcfg.ledger
  cfg = ledger.LedgerConfig(c.k, c.risky_share, c.redo_cost, rcfg.max_turns, c.rule_in_prompt)
  return ledger.LedgerEnv(cfg, "informative" if c.informative else "silent")


# One fresh environment of a seeded-problem family (the fixed evaluation set and the gate use these).
MAKE_ONE: dict[str, Callable[[RLConfig], Env]] = {"toy": _toy, "stale": _stale, "ledger": _ledger}


def evaluation_config(rcfg: RLConfig) -> RLConfig:
  """The fixed set is scored in the environment every arm shares: the ledger's silent one (an arm that
  trains with informative errors is measured where they are gone)."""
  return dataclasses.replace(rcfg, ledger=dataclasses.replace(rcfg.ledger, informative=False))


def seeded_envs(rcfg: RLConfig, workdir: str | None = None, episodes: pathlib.Path | None = None) -> Make:
  """P problems × G rollouts per step; the problem seeds are a pure function of (seed, step)."""
  make_one = MAKE_ONE[rcfg.env]

  def make(step: int):
    rng = np.random.default_rng([rcfg.seed, step, 1])
    seeds = rng.integers(0, 1 << 30, size=rcfg.problems_per_step).tolist()
    G = rcfg.group_size
    return (
      [make_one(rcfg) for _ in range(len(seeds) * G)],
      [s for s in seeds for _ in range(G)],
      [p for p in range(len(seeds)) for _ in range(G)],
    )

  return make


def toy_envs(rcfg: RLConfig, workdir: str | None = None, episodes: pathlib.Path | None = None) -> Make:
  """`seeded_envs` of the arithmetic toy, whatever `rcfg.env` says."""
  return seeded_envs(dataclasses.replace(rcfg, env="toy"))


def fixed_set(rcfg: RLConfig, n: int, seed: int = 12345) -> tuple[list[Env], list[int]]:
  """`n` problems of `rcfg.env`'s family, the same for every run with this `seed` (one rollout each)."""
  if rcfg.env not in MAKE_ONE:
    raise ValueError(f"no fixed problem set for rl.env={rcfg.env!r}; have {', '.join(MAKE_ONE)}")
  rcfg = evaluation_config(rcfg)
  seeds = np.random.default_rng([seed]).integers(0, 1 << 30, size=n).tolist()
  return [MAKE_ONE[rcfg.env](rcfg) for _ in seeds], seeds


def demonstrations(rcfg: RLConfig, scfg: SFTConfig, seed: int, tok: Tokenizer) -> list:
  """The SFT corpus in `tok`'s ids: the stale-docs or ledger demonstrations for those envs, the toy's
  otherwise (coding has none: the model learns the turn format on the toy)."""
  from composer_jax.rl.envs import ledger, stale, toy

  if rcfg.env == "ledger":
    return ledger.demonstrations(scfg.demos, seed, rcfg.ledger.demo_max_k, rcfg.ledger.risky_share, tok=tok)
  if rcfg.env == "stale":
    cfg = stale.StaleConfig(max_ops=rcfg.stale.max_ops, max_turns=rcfg.max_turns)
    return stale.demonstrations(scfg.demos, seed=seed, cfg=cfg, tok=tok)
  return toy.demonstrations(
    scfg.demos, seed=seed, mistake_fraction=scfg.mistake_fraction, hint_fraction=scfg.hint_fraction, tok=tok
  )


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


FACTORIES: dict[str, Callable[..., Make]] = {
  "toy": seeded_envs,
  "stale": seeded_envs,
  "ledger": seeded_envs,
  "coding": coding_envs,
}


def factory(rcfg: RLConfig, workdir: str, episodes: pathlib.Path) -> Make:
  """The factory of `rcfg.env` (episodes: where environments that need a directory keep theirs)."""
  if rcfg.env not in FACTORIES:
    raise ValueError(f"rl.env must be one of {', '.join(FACTORIES)}; got {rcfg.env!r}")
  return FACTORIES[rcfg.env](rcfg, workdir, episodes)
