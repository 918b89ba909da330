"""The one training loop: pretraining, SFT and RL differ only in their hooks.

  result = loop.fit(state, step_fn, config.train.schedule, loop.Hooks(next_batch=...), name="pretrain")

Each step: `next_batch(step, state)` gives the device batch and host-side metrics (RL rolls out here),
`step_fn(state, batch)` dispatches the jitted step, and the *previous* step's metrics are read while
this one runs, so the host waits on the device only to print. The stage's `configs.ScheduleConfig` (its
`schedule` section, as it is) sets the cadence: every `log_every` steps a progress line (`describe(record)`
+ ETA) is logged; every `eval_every` steps `evaluate(state)`; every `checkpoint_every` steps and at the
end `save(state, step, final)`.

Interrupts: SIGINT (Ctrl-C) and SIGTERM (what schedulers send) only set a flag while the loop runs; the
step in flight finishes, the loop saves and returns with `interrupted=True`. A second Ctrl-C aborts at
once without saving. Reading `state.step` once at the start (never after a step was dispatched, when
the old state's buffers may already be donated) keeps the interrupt path off deleted arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from absl import logging

from composer_jax import console
from composer_jax.configs import ScheduleConfig
from composer_jax.train.metrics import MetricsWriter, read_history

Schedule = ScheduleConfig  # the loop's schedule is a stage's schedule section: one class, one set of fields


@dataclasses.dataclass(frozen=True)
class Hooks:
  """What makes a loop pretraining, SFT or RL."""

  next_batch: Callable[[int, Any], tuple[Any, dict[str, float]]]  # (step, state) → (batch, host metrics)
  describe: Callable[[dict[str, float]], str] = lambda rec: f"loss {rec.get('loss', float('nan')):.4f}"
  annotate: Callable[[dict[str, float]], dict[str, float]] | None = None  # extra fields of a logged record
  evaluate: Callable[[Any], dict[str, float]] | None = None  # state → named metrics
  save: Callable[[Any, int, bool], None] | None = None  # (state, step, final)
  check: Callable[[], None] | None = None  # every step: raises when an async save failed
  writer: MetricsWriter | None = None
  throughput_key: str | None = None  # e.g. "tokens": logged records get `<key>_per_s` of recent steps
  tolerate_failures: bool = False  # RL: a step whose rollouts or update raise is logged and skipped
  sync: bool = False  # read each step's metrics at once (RL: the next batch needs the new params anyway)


@dataclasses.dataclass
class Result:
  start_step: int
  steps: int  # the step count reached
  interrupted: bool = False
  failed_steps: int = 0
  skipped_steps: int = 0  # non-finite steps the guarded update skipped
  history: list[dict[str, float]] = dataclasses.field(default_factory=list)  # one record per step
  evals: list[dict[str, float]] = dataclasses.field(default_factory=list)  # {"step": s, **metrics}
  seconds: float = 0.0
  seconds_per_step: float | None = None  # after the first (compiling) step; evals and saves included

  def summary(self, *keys: str) -> dict:
    """What a stage's summary needs: the step range, timing, and the first and last value of each key
    over `history` and `evals` (after a resume, those of this process alone unless `with_earlier` added
    the ones before it)."""
    out = {k: getattr(self, k) for k in ("start_step", "steps", "interrupted", "failed_steps")}
    out |= {k: getattr(self, k) for k in ("skipped_steps", "seconds", "seconds_per_step")}
    for key in keys:
      values = [r[key] for r in self.history + self.evals if key in r]
      out[f"first_{key}"], out[f"last_{key}"] = (values[0], values[-1]) if values else (None, None)
    return out | {"history": self.history, "evals": self.evals}

  def with_earlier(self, path: str | pathlib.Path, step_key: str, eval_key: str) -> Result:
    """This result with the records of the steps and evaluations at or before `start_step` read back from
    the metrics JSONL the run writes (`path`: the writer's `resume_from` kept exactly those): a resumed
    run's whole history, as the run that never stopped has it in memory (the records are what `fit`
    wrote; JSON gives the floats back exactly). A training record is one that carries `step_key`, an
    evaluation one that carries `eval_key`. A fresh run's result is returned as it is."""
    if self.start_step == 0:
      return self

    def before(key: str) -> list[dict]:
      return [r for r in read_history(path, key) if r["step"] <= self.start_step]

    return dataclasses.replace(
      self, history=before(step_key) + self.history, evals=before(eval_key) + self.evals
    )


class Diverged(RuntimeError):
  """Too many non-finite steps in a row: the run stops without saving (the last checkpoint stays good)."""


class OutOfMemory(RuntimeError):
  """A step needed more memory than the device (on CPU: the host) has. Not tolerated like other failed
  steps: the next batch of the same shape needs the same memory."""


_MEMORY_KNOBS = (
  "make the step smaller: rl.update_tokens or rl.update_memory (RL: micro-batches), train.grad_accum or "
  "model.remat (pretraining, SFT)"
)


def out_of_memory(e: BaseException, name: str, step: int) -> OutOfMemory | None:
  """The one-line `OutOfMemory` for XLA's RESOURCE_EXHAUSTED (an allocation that failed), else None."""
  text = str(e)
  if "RESOURCE_EXHAUSTED" not in text:
    return None
  line = next((x.strip() for x in text.splitlines() if "RESOURCE_EXHAUSTED" in x), text.strip())[:200]
  return OutOfMemory(f"[{name}] step {step} ran out of memory ({line}); {_MEMORY_KNOBS}")


class _Stop:
  """Set by SIGINT/SIGTERM while a loop runs; a second SIGINT raises KeyboardInterrupt.

  `agreed()`, called by every process before each step, says whether to stop there: on one process,
  whether a signal came; on several, whether one came to any process, from an all-gather of the flags
  (one tiny collective per step). All then stop before the same step and save together: one process
  stopping alone would wait in its save for the others, which wait in the next step's collectives. The
  decision is the gathered value only: a signal landing during the gather counts at the next step, on
  every process at once. `requested`: this process stops (its own signal, or another's agreed).
  """

  def __init__(self, name: str):
    self.requested, self._signalled, self._name = False, False, name

  def agreed(self) -> bool:
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.int32(self._signalled))
    if flags.any() and not self.requested:
      logging.warning(
        "[%s] a signal to process(es) %s: stopping with them", self._name, np.flatnonzero(flags)
      )
    self.requested = self.requested or bool(flags.any())
    return bool(flags.any())

  def __call__(self, signum: int, frame: Any) -> None:
    if self._signalled and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self._signalled = self.requested = True
    logging.warning(
      "[%s] %s: stopping after the step in flight and saving (Ctrl-C again aborts without saving)",
      self._name,
      signal.Signals(signum).name,
    )


@contextlib.contextmanager
def stop_on_signal(name: str) -> Iterator[_Stop]:
  """SIGINT/SIGTERM become a flag for the duration (main thread only; elsewhere a flag never set)."""
  stop = _Stop(name)
  if threading.current_thread() is not threading.main_thread():
    yield stop
    return
  previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield stop
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _due(step: int, every: int, last: int) -> bool:
  return step == last or (every > 0 and step % every == 0)


class _Run:
  """The bookkeeping of one `fit`: pending metrics, history, evaluation and progress lines."""

  def __init__(self, schedule: ScheduleConfig, hooks: Hooks, name: str, start: int, bar: Any):
    self.s, self.h, self.name, self.bar = schedule, hooks, name, bar
    self.result = Result(start_step=start, steps=start)
    self.t0 = time.perf_counter()
    self.window = (self.t0, 0.0)  # (time, throughput counter) at the last progress line
    self.counted, self.done_at, self.skipped_in_a_row = 0.0, [], 0

  def record(self, step: int, metrics: Any, host: dict[str, float], t_dispatch: float) -> None:
    """Reads one step's device metrics (blocking on that step) and logs/writes its record."""
    rec = dict(host) | {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    rec["step_s"] = now - t_dispatch
    self.done_at.append(now)
    self.result.skipped_steps += int(rec.get("skipped", 0))
    self.skipped_in_a_row = self.skipped_in_a_row + 1 if rec.get("skipped", 0) else 0
    if self.h.throughput_key:
      self.counted += rec.get(self.h.throughput_key, 0.0)
    log_now = _due(step, self.s.log_every, self.s.steps)
    if log_now and self.h.throughput_key:
      rate = (self.counted - self.window[1]) / max(now - self.window[0], 1e-9)
      self.window = (now, self.counted)
      rec[f"{self.h.throughput_key}_per_s"] = rate
    if log_now and self.h.annotate is not None:
      rec |= self.h.annotate(rec)
    self.result.history.append({"step": step, **rec})
    if self.h.writer is not None:
      self.h.writer.write(step, rec)
    self.bar.update(1)
    if log_now:
      eta = (self.s.steps - step) * (now - self.t0) / max(step - self.result.start_step, 1)
      skipped = f" skipped {self.result.skipped_steps}" if self.result.skipped_steps else ""
      logging.info(
        "[%s] step %d/%d %s%s eta %s", self.name, step, self.s.steps, self.h.describe(rec), skipped, _hms(eta)
      )
    _check_diverged(self.skipped_in_a_row, self.s.max_skipped_in_a_row, self.name, step)

  def evaluate(self, step: int, state: Any) -> None:
    if self.h.evaluate is None:
      return
    t = time.perf_counter()
    metrics = self.h.evaluate(state)
    self.result.evals.append({"step": step, **metrics})
    if self.h.writer is not None:
      self.h.writer.write(step, metrics)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    logging.info("[%s] eval @ step %d: %s (%.1fs)", self.name, step, shown, time.perf_counter() - t)

  def finish(self) -> Result:
    r = self.result
    r.seconds = time.perf_counter() - self.t0
    if len(self.done_at) > 1:
      r.seconds_per_step = (self.done_at[-1] - self.done_at[0]) / (len(self.done_at) - 1)
    if self.h.writer is not None:
      self.h.writer.flush()
    return r


def fit(
  state: Any,
  step_fn: Callable[[Any, Any], tuple[Any, Any]],
  schedule: ScheduleConfig,
  hooks: Hooks,
  *,
  name: str,
  eval_at_start: bool = True,
  max_failed_in_a_row: int = 3,
) -> tuple[Any, Result]:
  """Trains from `state.step` to `schedule.steps`; returns (state, Result). See the module docstring.

  `eval_at_start`: evaluate before the first step of a fresh run (the curve's origin). With
  `hooks.tolerate_failures`, `max_failed_in_a_row` failed steps in a row re-raise the last failure (a
  broken environment or program fails every step; a flaky one does not)."""
  if schedule.steps < 1:
    raise ValueError(f"[{name}] steps must be >= 1, got {schedule.steps}")
  start = int(state.step)  # read before any donation (see the module docstring)
  step, pending, failed_in_a_row = start, None, 0
  if hooks.writer is not None:
    hooks.writer.resume_from(start)  # a resumed run redoes the steps after its checkpoint: one record each
  with console.progress(schedule.steps, start, name) as bar, stop_on_signal(name) as stop:
    run = _Run(schedule, hooks, name, start, bar)
    if start == 0 and eval_at_start:
      run.evaluate(0, state)
    for s in range(start + 1, schedule.steps + 1):
      if stop.agreed():  # every process, at every step: all stop before the same one
        break
      try:
        batch, host = hooks.next_batch(s, state)
        t_dispatch = time.perf_counter()
        state, metrics = step_fn(state, batch)  # dispatched; the previous step's metrics are read below
      except Exception as e:
        if (oom := out_of_memory(e, name, s)) is not None:
          raise oom from e
        failed_in_a_row += 1
        if not hooks.tolerate_failures or failed_in_a_row >= max_failed_in_a_row:
          raise
        run.result.failed_steps += 1
        logging.warning("[%s] step %d failed: %s: %s", name, s, type(e).__name__, str(e)[:300])
        continue
      step, failed_in_a_row = s, 0
      if hooks.check is not None:
        hooks.check()
      if pending is not None:
        run.record(*pending)
      pending = (s, metrics, host, t_dispatch)
      if hooks.sync or (_due(s, schedule.eval_every, schedule.steps) and hooks.evaluate is not None):
        run.record(*pending)
        pending = None
      if _due(s, schedule.eval_every, schedule.steps) and hooks.evaluate is not None:
        run.evaluate(s, state)
      if hooks.save is not None and schedule.checkpoint_every > 0 and s % schedule.checkpoint_every == 0:
        hooks.save(state, s, False)
    if pending is not None:
      run.record(*pending)
    run.result.steps = step
    run.result.interrupted = stop.requested and step < schedule.steps
    if hooks.save is not None:
      hooks.save(state, step, True)
    return state, run.finish()


def _check_diverged(n: int, limit: int, name: str, step: int) -> None:
  if limit > 0 and n >= limit:
    raise Diverged(
      f"[{name}] {n} non-finite steps in a row (steps {step - n + 1}-{step}): stopped without saving; "
      "the last checkpoint is untouched. Lower the learning rate, or check the data and the checkpoint."
    )


def _hms(seconds: float) -> str:
  """`m:ss`, or `h:mm:ss` from an hour."""
  s = max(int(seconds), 0)
  return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
