"""Stage-level resume: a finished stage leaves a marker, a rerun with the same config skips it.

  summary, run = run_stage("sft", fn, config, workdir, force=False)   # runs fn or reuses the marker

`<workdir>/stages/<stage>.json` holds the stage's summary, wall time, finish time and `record`: the config
entries the stage depends on (`DEPENDS`) plus the finished runs of the stages it reads (rl: sft, and synth
with the coding env), fingerprinted. Same fingerprint: skipped. Changed: rerun; pretrain in place (its
checkpointer continues what it can, e.g. more steps, and refuses the rest naming the field), the other
stages start over with their `OUTPUTS` moved to `<workdir>/stages/previous/<stage>-<time>/` (never
deleted); `force` starts over the same way. No marker is written for an interrupted stage (it raises
KeyboardInterrupt, or pretrain returns `interrupted`), so the next run resumes it from its checkpoints.
"""

import datetime
import functools
import hashlib
import json
import pathlib
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any

_log = functools.partial(print, "[pipeline]", flush=True)

# The config entries (dotted paths; absent ones are left out) whose values a stage's result depends on.
DEPENDS = {
  "demo": ("seed", "model", "mesh", "demo"),
  "pretrain": ("seed", "model", "train", "optim", "data"),
  "synth": ("synth",),
  "sft": ("seed", "model", "optim", "sft", "rl.model")
  + tuple(f"rl.{k}" for k in ("temperature", "top_k", "max_turns", "max_turn_tokens", "cache_len")),
  "rl": ("seed", "model", "optim", "rl"),
  "plan": ("model", "mesh", "train", "optim", "plan"),
}
# What a stage writes under the workdir (moved aside when it starts over); caches (tfds corpus, synth
# sources and venvs) stay.
OUTPUTS = {
  "demo": ("demo.json",),
  "pretrain": ("checkpoints", "metrics", "pretrain.json"),
  "synth": ("synth_tasks", "synth.json"),
  "sft": ("sft", "sft_metrics", "sft.json"),
  "rl": ("rl", "rl_metrics", "rl_episodes", "rl_nofb", "rl_nofb_metrics", "rl_nofb_episodes", "rl.json"),
  "plan": ("plan.json",),
}
# Caches keyed on their own settings: kept when the config changes (a new synth source reuses the
# finished ones), moved aside only by `force`.
FORCE_ONLY = {"synth": ("synth_done",)}
RESUME_ON_CHANGE = ("pretrain",)  # its checkpointer refuses what it cannot continue, naming the field
ALWAYS_RUN = ("plan",)  # host arithmetic in seconds, the printed table is the point: never skipped


def record(stage: str, config: Any, workdir: str) -> dict[str, Any]:
  """The config entries `stage` depends on, plus the finished runs of the stages it reads."""
  rec: dict[str, Any] = {}
  for path in DEPENDS[stage]:
    node = config
    for key in path.split("."):
      node = node.get(key) if hasattr(node, "get") else None
    if node is not None:
      rec[path] = node.to_dict() if hasattr(node, "to_dict") else node
  upstream = ["sft"] if stage == "rl" else []
  if stage == "rl" and config.rl.get("env") == "coding":
    upstream.append("synth")
  for up in upstream:
    done = _read_marker(workdir, up)
    rec[f"upstream.{up}"] = done and dict(fingerprint=done["fingerprint"], run=done.get("run"))
  return json.loads(json.dumps(rec, sort_keys=True, default=str))


def fingerprint(record: dict) -> str:
  return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _marker(workdir: str, stage: str) -> pathlib.Path:
  return pathlib.Path(workdir, "stages", f"{stage}.json")


def _read_marker(workdir: str, stage: str) -> dict | None:
  path = _marker(workdir, stage)
  return json.loads(path.read_text()) if path.exists() else None


def run_stage(stage: str, fn: Callable, config: Any, workdir: str, force: bool) -> tuple[dict, dict]:
  """(the stage's summary, {seconds, skipped, finished}); writes the marker when the stage finished."""
  rec = record(stage, config, workdir)
  fp = fingerprint(rec)
  done = _read_marker(workdir, stage)
  if force:
    _set_aside(stage, workdir, "forced", forced=True)
  elif done is not None and done["fingerprint"] == fp and stage not in ALWAYS_RUN:
    _log(
      f"{stage}: finished {done['finished']} ({done['seconds']:.0f}s) with this config: skipped "
      f"(--config.force={stage} redoes it)"
    )
    return done["summary"], dict(seconds=done["seconds"], skipped=True, finished=done["finished"])
  elif done is not None and done["fingerprint"] != fp:
    changed = _changed(done["config"], rec)
    _log(f"{stage}: config changed since it finished ({'; '.join(changed[:4])}): rerunning")
    if stage in RESUME_ON_CHANGE:
      _marker(workdir, stage).unlink()
    else:
      _set_aside(stage, workdir, "config changed")
  t0 = time.perf_counter()
  try:
    summary = fn(config, workdir)
  except Exception as e:
    from composer_jax.train import checkpoint  # orbax: imported by the stage that raised, if it did

    if not isinstance(e, checkpoint.CheckpointError):
      raise
    raise checkpoint.CheckpointError(
      f"{e}\n--config.force={stage} starts stage {stage} over (its outputs are moved to "
      f"{workdir}/stages/previous), or use another --workdir."
    ) from e
  if summary.get("interrupted"):  # pretrain: Ctrl-C saved and returned
    raise KeyboardInterrupt
  seconds = time.perf_counter() - t0
  finished = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
  failed = [r["name"] for r in summary.get("sources", []) if r.get("error")]
  if failed:  # synth: a source that could not be set up (e.g. no network) is retried on the next run
    _log(f"{stage}: source(s) {', '.join(failed)} failed: not marked finished, a rerun retries them")
  elif _is_writer():
    run = uuid.uuid4().hex[:12]  # tells a downstream stage that this stage ran again, even unchanged
    marker = dict(stage=stage, fingerprint=fp, run=run, finished=finished, seconds=seconds, config=rec)
    marker["summary"] = summary
    _marker(workdir, stage).write_text(json.dumps(marker, indent=1, default=str))
  _log(f"{stage}: done in {seconds:.0f}s")
  return summary, dict(seconds=seconds, skipped=False, finished=finished)


def _is_writer() -> bool:
  """Process 0 writes markers and moves outputs (the others see them on the shared file system)."""
  import jax

  return jax.process_index() == 0


def _changed(saved: dict, current: dict) -> list[str]:
  """Dotted keys whose values differ, e.g. ['rl.steps: 20 -> 30']."""

  def flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
      return {prefix[:-1]: d}
    return {k: v for key, val in d.items() for k, v in flat(val, f"{prefix}{key}.").items()}

  a, b = flat(saved), flat(current)
  return [
    f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
    for k in sorted(set(a) | set(b))
    if a.get(k) != b.get(k)
  ]


def _set_aside(stage: str, workdir: str, why: str, forced: bool = False) -> None:
  """Moves the stage's outputs and marker to `<workdir>/stages/previous/<stage>-<time>/` (never deletes)."""
  marker = _marker(workdir, stage)
  names = OUTPUTS[stage] + (FORCE_ONLY.get(stage, ()) if forced else ())
  found = [p for p in [pathlib.Path(workdir, name) for name in names] + [marker] if p.exists()]
  if not found or not _is_writer():
    return
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
  dest, n = pathlib.Path(workdir, "stages", "previous", f"{stage}-{stamp}"), 1
  while dest.exists():  # twice in one second: never move onto an earlier set
    dest, n = dest.with_name(f"{stage}-{stamp}-{n}"), n + 1
  dest.mkdir(parents=True)
  for p in found:
    shutil.move(str(p), str(dest / ("marker.json" if p == marker else p.name)))
  _log(f"{stage}: {why}: starting over; its previous outputs are in {dest}")
