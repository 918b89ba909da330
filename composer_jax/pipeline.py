"""The runner: `run(config, workdir)` runs `config.stages` in order, then prints the summary.

  results = pipeline.run(config, workdir)     # config: an experiment's ConfigDict or a configs.Config

The config is validated first (`configs.from_config`: an unknown key anywhere fails before any work,
naming it; `checks.numbers`: no steps, a negative cadence, a non-finite value), the workdir is locked
(`lock`: a second run on it stops, naming the first), then each stage runs or is skipped
(`resume.run_stage`: a finished stage with the same config is reused). A stage that needs a gate (rl)
does not start after that gate failed (`GateFailed`) unless `gate.required=False`; its summary then
carries the warning. What a stage is, what it depends on and writes, and how the summary shows it live in its
record (`composer_jax/stages/`). Nothing imports this module but `run.py`, notebooks and tests.
"""

from __future__ import annotations

import pathlib
from typing import Any

from absl import logging

from composer_jax import checks, configs, lock, report, resume
from composer_jax.stages import REGISTRY, Interrupted


class GateFailed(RuntimeError):
  """The gate stage's verdict is FAILED and `gate.required`: the stage that needs it is not run."""


_GATED = {"rl": "gate"}  # a stage → the stage whose passing verdict it needs


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
  import jax

  config = configs.resolve(configs.from_config(config))
  names = parse_stages(config.stages)
  force = _parse_force(config.force, names)
  checks.numbers(config)  # steps, cadences, learning rates: usable values anywhere in the config
  for name in names:  # every selected stage's config problems, before any stage starts
    REGISTRY[name].check(config)
  pathlib.Path(workdir, "stages").mkdir(parents=True, exist_ok=True)
  results: dict[str, Any] = {}
  runs: dict[str, dict] = {}
  with lock.hold(workdir, primary=jax.process_index() == 0):
    try:
      for i, name in enumerate(names):
        logging.info("[pipeline] ===== stage %d/%d: %s =====", i + 1, len(names), name)
        warning = _gate(config, workdir, name, results)
        results[name], runs[name] = resume.run_stage(REGISTRY[name], config, workdir, name in force)
        if warning:
          runs[name]["warning"] = warning
    except (Interrupted, KeyboardInterrupt) as e:
      why = f": {e}" if str(e) else ""
      raise Interrupted(f"interrupted in stage {names[len(results)]}{why}") from e
    finally:
      if results:
        logging.info("[pipeline]\n%s", report.write(report.build(results, runs, workdir), workdir))
  return results


def _gate_failure(workdir: str, gate: str, results: dict[str, Any]) -> str | None:
  """What failed, from the gate's summary of this run or its marker; None when it passed, never finished,
  or judged an SFT checkpoint that has been replaced since (then it says nothing about this one)."""
  if gate in results:
    verdict = results[gate]
  elif (done := resume.finished(workdir, gate)) is not None:
    judged = (done["config"].get("upstream.sft") or {}).get("run")
    if judged != (resume.finished(workdir, "sft") or {}).get("run"):
      logging.warning("[pipeline] the %s verdict on disk is for an earlier SFT checkpoint: not applied", gate)
      return None
    verdict = done["summary"]
  else:
    return None
  if verdict.get("passed", True):
    return None
  failed = [k for k, g in verdict.get("gates", {}).items() if not g.get("pass")]
  return f"stage {gate} FAILED ({', '.join(failed) or verdict.get('why', 'no verdict')})"


def _gate(config: Any, workdir: str, name: str, results: dict[str, Any]) -> str | None:
  """Before a stage that needs a gate: raises GateFailed when it failed and `gate.required`; else the
  warning its summary carries (None when the gate passed or has no verdict)."""
  failed = _gate_failure(workdir, _GATED[name], results) if name in _GATED else None
  if failed is None:
    return None
  if config.gate.required:
    raise GateFailed(
      f"{failed}, see {workdir}/{_GATED[name]}.json: the hinted teacher was not shown to help, so {name} "
      f"would distil it; stopped before stage {name} (--config.gate.required=False runs it anyway)"
    )
  logging.warning("[pipeline] %s; running %s anyway (gate.required=False)", failed, name)
  return f"{failed}: {name} ran anyway (gate.required=False)"
