"""Stage `synth`: feature-deletion coding tasks from real repositories (`synth/build.py`).

<workdir>/synth_tasks (TFDS dataset), synth.json (per-source summary); caches: synth_sources (sdists
and venvs), synth_done (finished sources, reused when the config changes; moved aside only by force)
"""

from __future__ import annotations

import pathlib
from typing import Any

from absl import logging

from composer_jax.configs import Config
from composer_jax.stages.record import Stage


def run(config: Config, workdir: str) -> dict[str, Any]:
  """Tasks for `config.synth.sources` (+ `local_dir`); writes `<workdir>/synth.json`."""
  from composer_jax.synth import build  # subprocess-heavy, no jax: imported only by this stage

  s = config.synth
  items = build.resolve_sources(s.sources, s.local_dir)
  logging.info(
    "[synth] %d source(s), mode %s, max %s task(s) per source", len(items), s.mode, s.max_tasks_per_source
  )
  summary = build.build(
    items,
    workdir,
    mode=s.mode,
    max_tasks_per_source=s.max_tasks_per_source,
    runs=s.runs,
    timeout_s=s.timeout_s,
    done_dir=pathlib.Path(workdir, "synth_done"),
  )
  failed = [r["name"] for r in summary.get("sources", []) if r.get("error")]
  if failed:  # e.g. no network: not marked finished, so the next run retries these sources
    summary["incomplete"] = f"source(s) {', '.join(failed)} failed: a rerun retries them"
  return summary


def _summarize(s: dict, w: pathlib.Path) -> dict:
  rows = s.get("sources", [])
  return dict(
    tasks=s.get("total_valid", 0),
    candidates=sum(r.get("candidates", 0) for r in rows),
    sources={
      r["name"]: dict(valid=r.get("valid"), candidates=r.get("candidates"), error=r.get("error"))
      for r in rows
    },
    tasks_dir=str(w / "synth_tasks"),
  )


def _lines(r: dict) -> list[str]:
  per = ", ".join(
    f"{n} {v['valid']}/{v['candidates']}" + (" (error)" if v["error"] else "")
    for n, v in r["sources"].items()
  )
  return [f"  {r['tasks']} tasks built of {r['candidates']} candidates tried ({per}); tasks {r['tasks_dir']}"]


def _check(config: Config) -> None:
  from composer_jax.configs import ConfigError
  from composer_jax.synth import build

  s = config.synth
  if s.mode not in ("stub", "remove"):
    raise ConfigError(f"synth.mode {s.mode!r}: use 'stub' or 'remove'")
  try:
    for item in build.resolve_sources(s.sources, s.local_dir):
      build._as_source(item)
  except ValueError as e:
    raise ConfigError(str(e)) from None


STAGE = Stage(
  name="synth",
  run=run,
  check=_check,
  doc="feature-deletion coding tasks from pinned PyPI sdists in a bubblewrap sandbox",
  depends=("synth",),
  outputs=("synth_tasks", "synth.json"),
  summarize=_summarize,
  lines=_lines,
  force_only=("synth_done",),
)
