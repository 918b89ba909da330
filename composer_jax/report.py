"""The end-of-run summary: the numbers that matter from each stage's summary, printed and kept.

  text = write(build(results, runs, workdir), workdir)   # also <workdir>/summary.json

`results` maps a stage name to the summary dict it returned (or saved, when skipped); `runs` to
{seconds, skipped, finished}. What each stage contributes is its record's `summarize` and `lines`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from composer_jax.stages import REGISTRY


def build(results: dict[str, dict], runs: dict[str, dict], workdir: str) -> dict[str, Any]:
  """{workdir, stages: {stage: {seconds, skipped, ...its key numbers and paths}}, seconds_this_run}."""
  w = pathlib.Path(workdir).absolute()
  stages = {name: dict(runs.get(name, {})) | REGISTRY[name].summarize(s, w) for name, s in results.items()}
  ran = sum(run.get("seconds", 0.0) for run in runs.values() if not run.get("skipped"))
  return dict(workdir=str(w), stages=stages, seconds_this_run=ran, summary=str(w / "summary.json"))


def write(report: dict[str, Any], workdir: str) -> str:
  """Writes `<workdir>/summary.json` (process 0 of a multi-process run) and returns the printed text."""
  import jax

  if jax.process_index() == 0:
    pathlib.Path(workdir, "summary.json").write_text(json.dumps(report, indent=1))
  return text(report)


def _seconds(x: Any) -> str:
  return "n/a" if x is None else f"{x:.0f}"


def text(report: dict[str, Any]) -> str:
  """The readable block printed at the end of a run."""
  lines = [f"===== summary: {report['workdir']} ====="]
  st = report["stages"]
  for name, r in st.items():
    when = "skipped, finished " + r.get("finished", "?") if r.get("skipped") else "ran"
    lines.append(f"{name} ({_seconds(r.get('seconds'))} s, {when})")
    lines += REGISTRY[name].lines(r)
    if r.get("warning"):  # e.g. rl run after a failed gate
      lines.append(f"  WARNING: {r['warning']}")
  total = sum(r.get("seconds", 0.0) for r in st.values())
  lines.append(
    "wall time: " + ", ".join(f"{s} {_seconds(r.get('seconds'))} s" for s, r in st.items()) + "; "
    f"this run {report['seconds_this_run']:.0f} s, all stages {total:.0f} s"
  )
  lines.append(f"summary: {report['summary']}")
  return "\n".join(lines)
