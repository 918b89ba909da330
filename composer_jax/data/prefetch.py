"""A checkpointable iterator's elements prepared ahead by a background thread, so that the training
thread only takes them (pretraining packs its batches this way while the device runs the step).

  it = Prefetch(packer, size=2)      # next(it), it.get_state(), it.set_state(saved), it.close()

`get_state` is the state after the last element taken, not after the last one prepared: each element
travels with the state its iterator had right after producing it, so a checkpoint never skips the
elements still waiting in the buffer. An exception in the worker is raised by `next` in the caller's
thread, carrying the worker's traceback; after it, or after the end, `next` raises the same again. The
worker never waits on a full buffer without checking for `close`, so closing waits at most for the
element in hand. The thread starts at the first `next`, so a `set_state` right after construction
costs nothing.

Why not grain's thread prefetch: it keeps the same state discipline, but the installed grain (0.2.18)
closes its iterators again from `__del__` at interpreter exit and prints a traceback there.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Iterator
from typing import Any

_POLL_S = 0.05  # how often a worker blocked on a full buffer checks for `close`


def _work(it: Iterator, buffer: queue.Queue, stop: threading.Event) -> None:
  """The worker: (element, state after it, None) per element; then (None, None, what ended it)."""
  try:
    while not stop.is_set():
      element = next(it)
      if not _put(buffer, (element, copy.deepcopy(it.get_state()), None), stop):
        return
  except BaseException as e:  # StopIteration included: the caller sees the end as the iterator's own
    _put(buffer, (None, None, e), stop)


def _put(buffer: queue.Queue, item: tuple, stop: threading.Event) -> bool:
  while not stop.is_set():
    try:
      buffer.put(item, timeout=_POLL_S)
      return True
    except queue.Full:
      continue
  return False


class Prefetch:
  """`it` (with `get_state`/`set_state`) read `size` elements ahead by a daemon thread."""

  def __init__(self, it: Any, size: int):
    if size < 1:
      raise ValueError(f"prefetch size must be >= 1, got {size}")
    self._it, self._size = it, size
    self._state = copy.deepcopy(it.get_state())
    self._thread: threading.Thread | None = None
    self._ended: BaseException | None = None
    self._closed = False
    self._reset()

  def _reset(self) -> None:
    self._buffer: queue.Queue = queue.Queue(maxsize=self._size)
    self._stop = threading.Event()
    self._thread, self._ended = None, None

  def _halt(self) -> None:
    """Stops the worker and waits for it: afterwards only this thread touches `it`."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    self._reset()

  def __iter__(self) -> Prefetch:
    return self

  def __next__(self) -> Any:
    if self._closed:
      raise ValueError("next() on a closed Prefetch")
    if self._ended is not None:
      raise StopIteration if isinstance(self._ended, StopIteration) else self._ended
    if self._thread is None:
      self._thread = threading.Thread(
        target=_work, args=(self._it, self._buffer, self._stop), name="prefetch", daemon=True
      )
      self._thread.start()
    element, state, ended = self._buffer.get()
    if ended is not None:
      self._ended = ended
      self._thread.join()  # it has put its last item
      raise ended
    self._state = state
    return element

  def get_state(self) -> Any:
    return copy.deepcopy(self._state)

  def set_state(self, state: Any) -> None:
    """Drops what was prepared and continues from `state`."""
    self._halt()
    self._it.set_state(state)
    self._state = copy.deepcopy(self._it.get_state())

  def close(self) -> None:
    """Stops the worker (it finishes the element in hand); closes `it` when it can be closed."""
    if self._closed:
      return
    self._closed = True
    self._halt()
    if hasattr(self._it, "close"):
      self._it.close()

  def __del__(self) -> None:
    # The worker holds no reference to this object: dropping it unclosed still lets the worker end.
    stop = getattr(self, "_stop", None)
    if stop is not None:
      stop.set()
