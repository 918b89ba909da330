"""Generic config checks by field name, run once before any stage: a run that could only train nothing or
train on NaN stops in one line naming the key, instead of being recorded as finished or failing minutes in.

  checks.numbers(config)   # raises configs.ConfigError, e.g. "train.schedule.steps=-5 must be > 0 ..."

The rules look at field names only (`steps`, `*_every`, `learning_rate`, `lr`, ...), wherever the field
sits, so they hold for any arrangement of the config's sections (nested dataclasses and dicts of numbers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from composer_jax.strict import ConfigError

# Every float must be finite. Learning rates may be 0 (the weights stay as they are: tests and ablations
# use it), never negative; a run of no steps, an empty batch or a zero Adam epsilon is refused.
_POSITIVE = ("steps", "batch_size", "seq_len", "adam_eps")
_NON_NEGATIVE = ("learning_rate", "lr", "weight_decay", "grad_clip", "keep_checkpoints", "prefetch")
_NON_NEGATIVE_SUFFIXES = ("_every", "_steps", "_lr", "_learning_rate")


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
  """(dotted path, field name, value) of every number under a dataclass or dict, recursively."""
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
  elif isinstance(node, dict):
    items = [(str(k), v) for k, v in node.items()]
  else:
    return
  for name, value in items:
    path = f"{prefix}{name}"
    if dataclasses.is_dataclass(value) or isinstance(value, dict):
      yield from _leaves(value, path + ".")
    elif isinstance(value, tuple | list):
      yield from ((f"{path}[{i}]", name, v) for i, v in enumerate(value) if _is_number(v))
    elif _is_number(value):
      yield path, name, value


def _is_number(v: Any) -> bool:
  return isinstance(v, int | float) and not isinstance(v, bool)


def _problem(name: str, value: float) -> str | None:
  """Why `value` is refused for a field called `name`, or None."""
  if isinstance(value, float) and not math.isfinite(value):
    return "must be a finite number"
  if name in _POSITIVE and value <= 0:
    return "must be > 0" + (" (a run of no steps trains nothing)" if name == "steps" else "")
  if (name in _NON_NEGATIVE or name.endswith(_NON_NEGATIVE_SUFFIXES)) and value < 0:
    return "must be >= 0" + (" (0: never)" if name.endswith("_every") else "")
  return None


def numbers(config: Any) -> None:
  """Raises ConfigError naming the first field whose value no run can use (see the module docstring)."""
  for path, name, value in _leaves(config):
    why = _problem(name, value)
    if why:
      raise ConfigError(f"{path}={value!r} {why}; set --config.{path.split('[')[0]}= to a usable value")
