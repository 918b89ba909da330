"""What a run shows on the console: absl log lines for progress, a tqdm bar on a terminal.

Library code logs through `absl.logging` (INFO for stage progress). `setup()` (called by `run.py`;
notebooks may call it too) installs absl's handler with a short `HH:MM:SS message` format and keeps
other libraries' INFO records (orbax and tfds log every file operation) out, so the stage lines stay
readable. `progress(...)` draws a tqdm bar on a terminal only (never in CI logs or captured output)
and routes log lines above it, so the bar and the lines don't overwrite each other.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import sys
import time
import warnings
from collections.abc import Iterator

from absl import logging
from tqdm import tqdm

_PACKAGE_MARK = "composer_jax"


class _Format(std_logging.Formatter):
  def format(self, record: std_logging.LogRecord) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
    level = "" if record.levelno == std_logging.INFO else f"{record.levelname}: "
    return f"{stamp} {level}{record.getMessage()}"


def _ours_or_important(record: std_logging.LogRecord) -> bool:
  """INFO and below only from this package (and `__main__`); warnings and errors from everyone."""
  if record.levelno >= std_logging.WARNING:
    return True
  path = record.pathname or ""
  return _PACKAGE_MARK in path or record.module in ("run", "__main__")


def setup(verbosity: int = logging.INFO) -> None:
  """absl's handler on the root logger, INFO by default, with this module's format and filter."""
  logging.use_absl_handler()
  logging.set_verbosity(verbosity)
  handler = logging.get_absl_handler()
  handler.setFormatter(_Format())
  if _ours_or_important not in handler.filters:
    handler.addFilter(_ours_or_important)


def _teardown_noise(record: std_logging.LogRecord) -> bool:
  """asyncio's report of a future nobody awaited: after a failed async save, orbax's own writes end that
  way (the failure itself is reported once, by the run)."""
  return record.name == "asyncio" and "exception was never retrieved" in record.getMessage()


def _closed_loop(exc_type: type, exc: BaseException) -> bool:
  return exc_type is RuntimeError and str(exc) == "Event loop is closed"


def quiet_teardown() -> None:
  """Drops the noise third-party threads print while a failed save is torn down (tensorstore callbacks
  into orbax's closed event loop, asyncio's unretrieved futures), so a failure ends in the run's one line."""
  std_logging.getLogger("asyncio").addFilter(lambda r: not _teardown_noise(r))
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
  previous = sys.unraisablehook  # tensorstore reports its failed callbacks as unraisable

  def hook(unraisable):
    if not _closed_loop(unraisable.exc_type, unraisable.exc_value):
      previous(unraisable)

  sys.unraisablehook = hook


class _AboveBar:
  """A stream that prints through `tqdm.write`, so a log line goes above an active bar."""

  def write(self, text: str) -> None:
    if text.strip():
      tqdm.write(text.rstrip("\n"), file=sys.stderr)

  def flush(self) -> None:
    sys.stderr.flush()


@contextlib.contextmanager
def progress(total: int, initial: int = 0, desc: str = "") -> Iterator[tqdm]:
  """A tqdm bar over `total` steps, drawn only on a terminal (`disable=None`)."""
  bar = tqdm(total=total, initial=initial, desc=desc, disable=None, leave=False, dynamic_ncols=True)
  python_handler = logging.get_absl_handler().python_handler
  stream = python_handler.stream
  if not bar.disable:
    python_handler.stream = _AboveBar()
  try:
    yield bar
  finally:
    python_handler.stream = stream
    bar.close()
