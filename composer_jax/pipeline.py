"""The runner: `run(config, workdir)` runs `config.stages` in order, then prints the summary.

  results = pipeline.run(config, workdir)     # config: an experiment's ConfigDict or a configs.Config

The config is validated first (`configs.from_config`: an unknown key anywhere fails before any work,
naming it), then each stage runs or is skipped (`resume.run_stage`: a finished stage with the same config
is reused). What a stage is, what it depends on and writes, and how the summary shows it live in its
record (`composer_jax/stages/`). Nothing imports this module but `run.py`, notebooks and tests.
"""

from __future__ import annotations

import pathlib
from typing import Any

from absl import logging

from composer_jax import configs, report, resume
from composer_jax.stages import REGISTRY, Interrupted


def parse_stages(stages: str) -> list[str]:
  """Stage names of a comma-separated list; a ConfigError naming the unknown ones and the known."""
  names = [s.strip() for s in stages.split(",") if s.strip()]
  unknown = [s for s in names if s not in REGISTRY]
  if unknown or not names:
    raise configs.ConfigError(
      f"stages={stages!r} has {'unknown stage(s) ' + ', '.join(unknown) if unknown else 'no stage'}; "
      f"known stages: {', '.join(REGISTRY)}"
    )
  return names


def _parse_force(force: str, stages: list[str]) -> set[str]:
  if force.strip() == "all":
    return set(stages)
  return set(parse_stages(force)) if force.strip() else set()


def run(config: Any, workdir: str) -> dict[str, Any]:
  """Runs (or skips, when finished with the same config) each stage of `config.stages`, prints the
  summary and writes `<workdir>/summary.json`; returns {stage: its summary dict}.

  An interrupt (SIGINT, SIGTERM; a training loop saves first) raises `stages.Interrupted` naming the stage,
  after the summary of what finished.
  """
  config = configs.resolve(configs.from_config(config))
  names = parse_stages(config.stages)
  force = _parse_force(config.force, names)
  for name in names:  # every selected stage's config problems, before any stage starts
    REGISTRY[name].check(config)
  pathlib.Path(workdir, "stages").mkdir(parents=True, exist_ok=True)
  results: dict[str, Any] = {}
  runs: dict[str, dict] = {}
  try:
    for i, name in enumerate(names):
      logging.info("[pipeline] ===== stage %d/%d: %s =====", i + 1, len(names), name)
      results[name], runs[name] = resume.run_stage(REGISTRY[name], config, workdir, name in force)
  except (Interrupted, KeyboardInterrupt) as e:
    why = f": {e}" if str(e) else ""
    raise Interrupted(f"interrupted in stage {names[len(results)]}{why}") from e
  finally:
    if results:
      logging.info("[pipeline]\n%s", report.write(report.build(results, runs, workdir), workdir))
  return results
