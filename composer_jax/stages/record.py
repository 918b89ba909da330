"""What the runner knows of a stage: one record per stage, declared in the stage's own module.

  STAGE = Stage(name="sft", run=run, doc="...", depends=("seed", "model", "sft"), outputs=("sft",), ...)

`pipeline.run` runs `stage.run(config, workdir)`; `resume` fingerprints `depends` (dotted config paths)
plus the finished runs of `upstream(config)` and moves `outputs` aside when a stage starts over;
`report` turns the stage's summary into the end-of-run block with `summarize` and `lines`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

from composer_jax.configs import Config


class Interrupted(Exception):
  """A stage stopped on SIGINT/SIGTERM after saving; rerunning the same command resumes it."""


def scalars(summary: dict, workdir: pathlib.Path) -> dict:
  """Numbers and one-line strings of a summary (the default `summarize`)."""
  short = lambda v: isinstance(v, str) and len(v) <= 80 and "\n" not in v  # noqa: E731
  return {k: v for k, v in summary.items() if isinstance(v, int | float | bool) or v is None or short(v)}


def key_values(row: dict) -> list[str]:
  """One line of `key value` pairs (the default `lines`)."""
  return [
    "  "
    + ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("seconds", "skipped", "finished", "warning"))
  ]


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  run: Callable[[Config, str], dict[str, Any]]  # (config, workdir) → JSON-able summary
  doc: str  # one line for listings
  depends: tuple[str, ...]  # config paths (dotted) whose values the result depends on
  # paths under `depends` that only decide what happens after the stage (e.g. gate.required): left out of
  # the fingerprint, so changing them neither reruns the stage nor the stages that read it
  ignores: tuple[str, ...] = ()
  # Cheap checks of the config this stage reads, run for every selected stage before any stage starts:
  # a ConfigError (one line) instead of a failure minutes into the run.
  check: Callable[[Config], None] = lambda config: None
  outputs: tuple[str, ...] = ()  # what it writes under the workdir, moved aside when it starts over
  upstream: Callable[[Config], tuple[str, ...]] = lambda config: ()  # finished stages it reads
  summarize: Callable[[dict, pathlib.Path], dict] = scalars  # summary → the report's numbers and paths
  lines: Callable[[dict], list[str]] = key_values  # the report's numbers → printed lines
  resume_on_change: bool = False  # a changed config continues in place (its checkpointer refuses what it
  # cannot continue, naming the field) instead of starting over
  extends: tuple[str, ...] = ()  # config paths whose change continues in place (more steps, other cadence)
  always_run: bool = False  # never skipped (cheap, and the printed output is the point)
  force_only: tuple[str, ...] = ()  # caches moved aside only by --config.force
