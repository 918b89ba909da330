"""The `synth` stage: build feature-deletion tasks for several sources and write them as one TFDS dataset.

  summary = build(["toolz", "inflection", "/path/to/repo"], workdir, max_tasks_per_source=3)

Per source: fetch (cached under `<workdir>/synth_sources`), an editable venv (built once, marked
`ready`), `tasks.make_tasks` with one progress line per candidate, then a summary row: candidates tried,
valid, rejections by reason, seconds per valid task, tasks per minute, yield (valid ÷ candidates tried).
All valid tasks go to `<workdir>/synth_tasks` (`dataset.write_tasks`). Ctrl-C writes what is done (tasks
of finished sources and the valid tasks of the current one) before re-raising. With `done_dir`, each
finished PyPI source's tasks and summary row are kept in `<done_dir>/<name>-<version>.json` and a later
build with the same settings reuses them instead of rebuilding the source (local dirs are always rebuilt:
their content is not pinned).
"""

import collections
import dataclasses
import json
import math
import os
import pathlib
import shutil
import time
from collections.abc import Callable, Iterable, Sequence

from absl import logging

from composer_jax.synth import sources, tasks

# Test-only dependencies of the default sources' suites (their `[tests]` extras minus coverage/benchmark
# plugins the suites do not need); installed next to pytest and coverage in the source's venv.
TEST_DEPS: dict[str, tuple[str, ...]] = {"humanize": ("freezegun",)}
_BASE_DEPS = ("pytest", "coverage")


@dataclasses.dataclass
class SourceSummary:
  name: str
  version: str
  candidates: int = 0  # tried (make_tasks stops at max_tasks)
  total_candidates: int = 0  # found by coverage
  valid: int = 0
  rejected: dict = dataclasses.field(default_factory=dict)
  seconds: float = 0.0  # fetch + venv + baseline + coverage + candidates
  setup_seconds: float = 0.0  # fetch + venv
  error: str = ""

  @property
  def seconds_per_task(self) -> float | None:
    return self.seconds / self.valid if self.valid else None

  @property
  def tasks_per_minute(self) -> float:
    return 60.0 * self.valid / self.seconds if self.seconds > 0 else 0.0

  @property
  def yield_(self) -> float:
    return self.valid / self.candidates if self.candidates else 0.0

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(
      seconds_per_task=self.seconds_per_task, tasks_per_minute=self.tasks_per_minute, yield_=self.yield_
    )
    return d


def resolve_sources(names: str | Iterable[str], local_dir: str | None = None) -> list:
  """Comma-separated DEFAULT_SOURCES names (or a list) plus an optional local directory."""
  if isinstance(names, str):
    names = [n.strip() for n in names.split(",")]
  known = {s.name: s for s in sources.DEFAULT_SOURCES}
  names = [n for n in names if n]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"unknown synth source(s) {unknown}; known sources: {', '.join(known)}.")
  out: list = [known[n] for n in names]
  if local_dir:
    out.append(local_dir)
  if not out:
    raise ValueError(f"no synth sources: set synth.sources (known: {', '.join(known)}) or synth.local_dir.")
  return out


def _as_source(item) -> sources.Source:
  if isinstance(item, sources.Source):
    return item
  path = pathlib.Path(item).resolve()
  if not path.is_dir():
    raise ValueError(f"local synth source {str(path)!r} is not a directory")
  return sources.Source(path.name, "0", kind="local", path=str(path))


def ensure_venv(src: pathlib.Path, venv: pathlib.Path, extras: Sequence[str]) -> pathlib.Path:
  """The source's editable venv, built once (a `ready` marker guards against half-built ones)."""
  if not (venv / "ready").exists():
    if venv.exists():
      shutil.rmtree(venv)
    sources.make_venv(src, venv, extras=tuple(extras))
    (venv / "ready").write_text("ok\n")
  return venv


def build(
  items: Sequence,
  workdir: str | os.PathLike,
  *,
  mode: str = "stub",
  max_tasks_per_source: int | None = None,
  runs: int = 3,
  timeout_s: float = 300.0,
  log: Callable[[str], None] | None = None,
  done_dir: str | os.PathLike | None = None,
) -> dict:
  """Build tasks for each of `items` (Source or local dir), write the dataset, return the summary."""
  log = log or logging.info
  workdir = pathlib.Path(workdir)
  srcs = [_as_source(item) for item in items]  # bad local paths fail before any work
  cache = workdir / "synth_sources"
  cache.mkdir(parents=True, exist_ok=True)
  built: list[tasks.Task] = []
  rows: list[SourceSummary] = []
  interrupted = False
  t_all = time.perf_counter()
  try:
    for src_obj in srcs:
      key = dict(mode=mode, max_tasks=max_tasks_per_source, runs=runs, version=src_obj.version)
      done = pathlib.Path(done_dir, f"{src_obj.name}-{src_obj.version}.json") if done_dir else None
      if done is not None and src_obj.kind == "sdist":
        key["sha256"] = src_obj.sha256
        reused = _reuse(done, key)
        if reused is not None:
          rows.append(reused[0])
          built += reused[1]
          log(
            f"[synth] {src_obj.name} {src_obj.version}: {len(reused[1])} task(s) of an earlier build ({done})"
          )
          continue
      row = SourceSummary(src_obj.name, src_obj.version)
      rows.append(row)
      n_before = len(built)
      _build_source(src_obj, cache, row, built, mode, max_tasks_per_source, runs, timeout_s, log)
      if done is not None and src_obj.kind == "sdist" and not row.error:
        done.parent.mkdir(parents=True, exist_ok=True)
        records = [t.to_record() for t in built[n_before:]]
        tmp = done.with_suffix(".tmp")  # replaced atomically: a Ctrl-C mid-write leaves no half file
        tmp.write_text(json.dumps(dict(key=key, row=dataclasses.asdict(row), records=records), indent=1))
        tmp.replace(done)
  except KeyboardInterrupt:
    interrupted = True
    log("[synth] interrupted: writing the tasks built so far")
  summary = {
    "sources": [r.to_dict() for r in rows],
    "total_valid": len(built),
    "total_seconds": time.perf_counter() - t_all,
    "interrupted": interrupted,
    "dataset": None,
    "table": table(rows),
  }
  if built:
    summary["dataset"] = _write(built, workdir / "synth_tasks")
  log(summary["table"])
  (workdir / "synth.json").write_text(json.dumps(summary, indent=1))
  if interrupted:
    raise KeyboardInterrupt
  return summary


def _reuse(done: pathlib.Path, key: dict) -> tuple[SourceSummary, list] | None:
  """(row, tasks) of a source finished by an earlier build with the same settings, if its files remain."""
  if not done.exists():
    return None
  saved = json.loads(done.read_text())
  if saved.get("key") != key:
    return None
  found = [tasks.Task.from_record(r) for r in saved["records"]]
  if not all(pathlib.Path(t.repo_dir).exists() and pathlib.Path(t.venv).exists() for t in found):
    return None
  return SourceSummary(**saved["row"]), found


def _write(built: list, data_dir: pathlib.Path) -> str:
  from composer_jax.synth import dataset  # tfds: loaded only when there is something to write

  return dataset.write_tasks([t.to_record() for t in built], data_dir)


def _build_source(src_obj, cache, row, built, mode, max_tasks, runs, timeout_s, log) -> None:
  t0 = time.perf_counter()
  row_rej: collections.Counter = collections.Counter()
  try:
    src = sources.fetch(src_obj, cache)
    venv_dir = cache / f"{src_obj.name}-{src_obj.version}" / "venv"
    venv = ensure_venv(src, venv_dir, (*_BASE_DEPS, *TEST_DEPS.get(src_obj.name, ())))
  except (RuntimeError, OSError, ValueError, sources.ChecksumError) as err:
    row.error = (
      f"setup: {str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__}"
    )
    row.seconds = time.perf_counter() - t0
    log(f"[synth] {src_obj.name}: {row.error}")
    return
  row.setup_seconds = time.perf_counter() - t0
  log(f"[synth] {src_obj.name} {src_obj.version}: source + venv ready ({row.setup_seconds:.1f}s)")
  last, first_done = [time.perf_counter()], []

  def progress(i: int, n: int, name: str, status: str) -> None:
    now = time.perf_counter()
    row.candidates, row.total_candidates = i + 1, n
    row.valid = sum(1 for t in built if t.source.get("name") == src_obj.name)
    note = " (incl. baseline + coverage)" if i == 0 else ""
    first_done.append(now)
    left = _candidates_left(i, n, row.valid, max_tasks)
    per = (now - first_done[0]) / max(len(first_done) - 1, 1) if len(first_done) > 1 else now - last[0]
    eta = f", eta {_mmss(left * per)}" if left else ""
    log(f"[synth] {src_obj.name} {i + 1}/{n} {name}: {'valid' if status == 'ok' else status} "
        f"{now - last[0]:.1f}s{note}{eta}")  # fmt: skip
    last[0] = now

  try:
    tasks.make_tasks(
      src,
      mode=mode,
      max_tasks=max_tasks,
      venv=venv,
      source=src_obj if src_obj.kind == "sdist" else {"name": src_obj.name, "version": src_obj.version},
      progress=progress,
      rejections=row_rej,
      runs=runs,
      timeout_s=timeout_s,
      on_task=built.append,
    )
  except KeyboardInterrupt:
    raise
  except Exception as err:  # one broken source must not lose the others' tasks
    row.error = f"{type(err).__name__}: {str(err).strip()[:200]}"
    log(f"[synth] {src_obj.name}: failed: {row.error}")
  finally:
    row.valid = sum(1 for t in built if t.source.get("name") == src_obj.name)
    row.rejected = dict(sorted(row_rej.items()))
    row.seconds = time.perf_counter() - t0


def _candidates_left(i: int, n: int, valid: int, max_tasks: int | None) -> int:
  """Candidates still to try after the (i+1)-th of n: all of them, or (with `max_tasks`) as many as the
  yield so far says it takes to reach the cap."""
  left = n - i - 1
  if max_tasks is None:
    return left
  need = max(max_tasks - valid, 0)
  if need == 0:
    return 0
  return min(left, math.ceil(need * (i + 1) / valid)) if valid else left


def _mmss(seconds: float) -> str:
  s = max(int(seconds), 0)
  return f"{s // 60}:{s % 60:02d}"


def table(rows: Sequence[SourceSummary]) -> str:
  """Markdown summary table, one row per source plus a total."""
  head = "| source | candidates | valid | rejected (by reason) | s/task | tasks/min | yield |"
  lines = [head, "|---|---:|---:|---|---:|---:|---:|"]
  for r in rows:
    rej = ", ".join(f"{k} {v}" for k, v in r.rejected.items()) or "–"
    if r.error:
      rej += f"; error: {r.error}"
    spt = f"{r.seconds_per_task:.1f}" if r.seconds_per_task is not None else "–"
    cands = f"{r.candidates} of {r.total_candidates}" if r.total_candidates else str(r.candidates)
    lines.append(
      f"| {r.name} {r.version} | {cands} | {r.valid} | {rej} | {spt} | {r.tasks_per_minute:.2f} | "
      f"{r.yield_:.0%} |"
    )
  valid, cands, secs = (
    sum(r.valid for r in rows),
    sum(r.candidates for r in rows),
    sum(r.seconds for r in rows),
  )
  tpm = 60.0 * valid / secs if secs else 0.0
  y = f"{valid / cands:.0%}" if cands else "–"
  spt = f"{secs / valid:.1f}" if valid else "–"
  lines.append(f"| **total** | {cands} | {valid} | | {spt} | {tpm:.2f} | {y} |")
  return "\n".join(lines)
