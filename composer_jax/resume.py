"""Stage-level resume: a finished stage leaves a marker, a rerun with the same config skips it.

  summary, run = run_stage(stage, config, workdir, force=False)   # runs stage.run or reuses the marker

`<workdir>/stages/<stage>.json` holds the stage's summary, wall time, finish time and `record`: the config
entries the stage depends on (`stage.depends`) plus the finished runs of the stages it reads
(`stage.upstream`), fingerprinted. Same fingerprint: skipped. Changed: rerun; in place when the stage is
`resume_on_change` (pretrain: its checkpointer continues what it can and refuses the rest, naming the
field) or only its `extends` paths changed (more steps, another logging cadence), the marker kept until it
finishes; otherwise from scratch, with its `outputs` moved to `<workdir>/stages/previous/<stage>-<time>/`
(never deleted). `force` starts over the same way, once: `<workdir>/stages/<stage>.forced` stays until
that run finishes, so rerunning the same command (still with `--config.force`) after an interrupt resumes
it. No marker is written for an interrupted stage, nor for one whose summary says `incomplete`, so the
next run resumes or retries it.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil
import time
import uuid
from typing import Any

from absl import logging

from composer_jax import configs
from composer_jax.configs import Config
from composer_jax.stages.record import Stage


def record(stage: Stage, config: Config, workdir: str) -> dict[str, Any]:
  """The config entries `stage` depends on, plus the finished runs of the stages it reads."""
  tree = configs.plain(config)
  rec: dict[str, Any] = {}
  for path in stage.depends:
    node: Any = tree
    for key in path.split("."):
      node = node.get(key) if isinstance(node, dict) else None
    if node is not None:
      rec[path] = node
  for path in stage.ignores:
    *parents, leaf = path.split(".")
    node = rec
    for key in parents:
      node = node.get(key, {}) if isinstance(node, dict) else {}
    if isinstance(node, dict):
      node.pop(leaf, None)
  for up in stage.upstream(config):
    done = _read_marker(workdir, up)
    rec[f"upstream.{up}"] = done and dict(fingerprint=done["fingerprint"], run=done.get("run"))
  return json.loads(json.dumps(rec, sort_keys=True, default=str))


def _marker(workdir: str, stage: str) -> pathlib.Path:
  return pathlib.Path(workdir, "stages", f"{stage}.json")


def _read_marker(workdir: str, stage: str) -> dict | None:
  path = _marker(workdir, stage)
  return json.loads(path.read_text()) if path.exists() else None


def finished(workdir: str, stage: str) -> dict | None:
  """The marker of a finished stage ({summary, config, run, ...}), None if it has not finished."""
  return _read_marker(workdir, stage)


def _forced(workdir: str, stage: str) -> pathlib.Path:
  """Present from a forced start-over until that run of the stage finishes: a rerun of the same command
  (which still says --config.force) resumes it instead of starting over again."""
  return pathlib.Path(workdir, "stages", f"{stage}.forced")


def run_stage(stage: Stage, config: Config, workdir: str, force: bool) -> tuple[dict, dict]:
  """(the stage's summary, {seconds, skipped, finished}); writes the marker when the stage finished."""
  rec = record(stage, config, workdir)
  fp = configs.fingerprint(rec)
  done = _read_marker(workdir, stage.name)
  if force and _forced(workdir, stage.name).exists():
    logging.info(
      "[pipeline] %s: resuming its forced run, which was interrupted (--config.force starts a stage over "
      "once; after it finishes, the same flag starts it over again)", stage.name,
    )  # fmt: skip
  elif force:
    _set_aside(stage, workdir, "forced", forced=True)
    if _is_writer():
      _forced(workdir, stage.name).write_text(datetime.datetime.now(datetime.UTC).isoformat())
  elif done is not None and done["fingerprint"] == fp and not stage.always_run:
    logging.info(
      "[pipeline] %s: finished %s (%.0fs) with this config: skipped (--config.force=%s redoes it)",
      stage.name, done["finished"], done["seconds"], stage.name,
    )  # fmt: skip
    return done["summary"], dict(seconds=done["seconds"], skipped=True, finished=done["finished"])
  elif done is not None and done["fingerprint"] != fp:
    changed = _changed(done["config"], rec)
    shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:4])
    if stage.resume_on_change or all(_covered(k, stage.extends) for k, _, _ in changed):
      # In place: the marker stays until the stage finishes, so a refused change damages nothing.
      logging.info(
        "[pipeline] %s: config changed since it finished (%s): continuing in place", stage.name, shown
      )
    else:
      logging.info("[pipeline] %s: config changed since it finished (%s): starting over", stage.name, shown)
      _set_aside(stage, workdir, "config changed")
  t0 = time.perf_counter()
  try:
    summary = stage.run(config, workdir)
  except Exception as e:
    from composer_jax.train import checkpoint  # orbax: imported by the stage that raised, if it did

    if not isinstance(e, checkpoint.CheckpointError):
      raise
    raise checkpoint.CheckpointError(
      f"{e}\n--config.force={stage.name} starts stage {stage.name} over (its outputs are moved to "
      f"{workdir}/stages/previous), or use another --workdir."
    ) from e
  seconds = time.perf_counter() - t0
  finished = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
  if summary.get("incomplete"):
    logging.warning("[pipeline] %s: %s: not marked finished", stage.name, summary["incomplete"])
  elif _is_writer():
    run = uuid.uuid4().hex[:12]  # tells a downstream stage that this stage ran again, even unchanged
    marker = dict(stage=stage.name, fingerprint=fp, run=run, finished=finished, seconds=seconds, config=rec)
    marker["summary"] = summary
    _marker(workdir, stage.name).write_text(json.dumps(marker, indent=1, default=str))
    _forced(workdir, stage.name).unlink(missing_ok=True)
  logging.info("[pipeline] %s: done in %.0fs", stage.name, seconds)
  return summary, dict(seconds=seconds, skipped=False, finished=finished)


def _is_writer() -> bool:
  """Process 0 writes markers and moves outputs (the others see them on the shared file system)."""
  import jax

  return jax.process_index() == 0


def _covered(key: str, paths: tuple[str, ...]) -> bool:
  return any(key == p or key.startswith(p + ".") for p in paths)


def _changed(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
  """(dotted key, saved value, current value) where they differ, e.g. [('rl.schedule.steps', 20, 30)]."""

  def flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
      return {prefix[:-1]: d}
    return {k: v for key, val in d.items() for k, v in flat(val, f"{prefix}{key}.").items()}

  a, b = flat(saved), flat(current)
  return [
    (k, a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
  ]


def _set_aside(stage: Stage, workdir: str, why: str, forced: bool = False) -> None:
  """Moves the stage's outputs and marker to `<workdir>/stages/previous/<stage>-<time>/` (never deletes)."""
  marker = _marker(workdir, stage.name)
  names = stage.outputs + (stage.force_only if forced else ())
  found = [p for p in [pathlib.Path(workdir, name) for name in names] + [marker] if p.exists()]
  if not found or not _is_writer():
    return
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
  dest, n = pathlib.Path(workdir, "stages", "previous", f"{stage.name}-{stamp}"), 1
  while dest.exists():  # twice in one second: never move onto an earlier set
    dest, n = dest.with_name(f"{stage.name}-{stamp}-{n}"), n + 1
  dest.mkdir(parents=True)
  for p in found:
    shutil.move(str(p), str(dest / ("marker.json" if p == marker else p.name)))
  logging.info("[pipeline] %s: %s: starting over; its previous outputs are in %s", stage.name, why, dest)
