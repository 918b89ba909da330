"""Strict conversion between nested frozen dataclasses and `ml_collections.ConfigDict`s, and the
records and fingerprints built from them. Generic: `configs.py` applies it to `Config`.

  cd = to_config_dict(obj)          # unset `T | None` fields become typed placeholders
  obj = from_dict(Cls, cd)          # unknown key → ConfigError naming it and the nearest valid one

A field with `metadata={"derived": why}` is filled in by code from other fields, never by the config: it
is left out of the ConfigDict, and a config that sets it fails naming it and `why`.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
  """A config that cannot run: an unknown key, a wrong type, an impossible value. One line."""


def plain(c: Any) -> Any:
  """JSON-able nested dicts of a dataclass, ConfigDict or mapping (tuples become lists)."""
  if dataclasses.is_dataclass(c) and not isinstance(c, type):
    c = dataclasses.asdict(c)
  elif hasattr(c, "to_dict"):
    c = c.to_dict()
  return json.loads(json.dumps(c, sort_keys=True, default=str))


def record(**configs: Any) -> dict:
  """{name: plain fields} of the configs a checkpoint or a finished stage depends on."""
  return {name: plain(c) for name, c in configs.items()}


def fingerprint(rec: dict) -> str:
  """A short stable hash of a record (sorted JSON)."""
  return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:16]


def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _settable(cls: type) -> dict[str, dataclasses.Field]:
  """The fields of `cls` that a config may set (all but the derived ones), by name."""
  return {f.name: f for f in dataclasses.fields(cls) if "derived" not in f.metadata}


def _derived(cls: type, key: str) -> str | None:
  """Why `key` of `cls` is not a config key (it is derived), or None."""
  field = {f.name: f for f in dataclasses.fields(cls)}.get(key)
  return None if field is None else field.metadata.get("derived")


def _optional_base(tp: Any) -> Any | None:
  """T for `T | None` (or Optional[T]); None for anything else."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(tp)) == 2:
      return args[0]
  return None


def to_config_dict(config: Any, path: str = "") -> Any:
  """A dataclass as a nested `ConfigDict`; unset `T | None` fields become typed placeholders, so that
  `--config.section.field=value` can still set them. Derived fields are left out (ConfigError when one
  was set: its value would be lost)."""
  from ml_collections import ConfigDict, config_dict

  out = ConfigDict()
  hints = _hints(type(config))
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if "derived" in f.metadata:
      if value != f.default:
        raise ConfigError(f"{path}{f.name}={value!r} is not a config key: {f.metadata['derived']}")
      continue
    if dataclasses.is_dataclass(value):
      out[f.name] = to_config_dict(value, f"{path}{f.name}.")
    elif isinstance(value, dict):
      out[f.name] = ConfigDict(value)
    elif value is None:
      base = _optional_base(hints[f.name])
      out[f.name] = config_dict.placeholder(base if isinstance(base, type) else object)
    else:
      out[f.name] = value
  return out


def from_dict(
  cls: type, values: Mapping[str, Any], path: str = "", *, base: Any = None, derived: bool = False
) -> Any:
  """`cls(**values)` with nested dataclasses built the same way; missing keys take the defaults: `base`'s
  values when given, and in a nested section the enclosing field's default (`train.schedule` keeps
  pretraining's cadence when only its `steps` are given). `derived`: `values` is a record (`plain` of a
  resolved object), whose derived fields are read back too.

  Raises ConfigError on an unknown key (naming it and the nearest valid one), a value of the wrong type,
  or a value the dataclass rejects (its own checks, e.g. ModelConfig's).
  """
  if hasattr(values, "to_dict"):
    values = values.to_dict()
  if not isinstance(values, Mapping):
    raise ConfigError(f"{path.rstrip('.') or 'config'} must be a section (a mapping), got {values!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)} if derived else _settable(cls)
  hints = _hints(cls)
  kwargs = {}
  for key, value in values.items():
    if key not in fields:
      raise ConfigError(f"unknown config key '{path}{key}'{_nearest(key, cls, path)}")
    overridden = fields[key].metadata.get("overrides")
    if overridden is not None:  # a partial section: its keys must be fields of `overridden`
      _check_keys(overridden, value, f"{path}{key}.")
    default = fields[key].default
    kwargs[key] = _coerce(
      hints[key], value, f"{path}{key}", default if dataclasses.is_dataclass(default) else None
    )
  try:
    return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{path.rstrip('.') or 'config'}: {e}") from e


def check_path(dotted: str, cls: type, prefix: str = "") -> None:
  """Raises ConfigError when `dotted` (e.g. "rl.stepz") names no field of `cls`, nested sections and
  partial sections (`rl.model`) included; the message names the key and the nearest valid one."""
  head, _, rest = dotted.partition(".")
  fields = _settable(cls)
  if head not in fields:
    raise ConfigError(f"unknown config key '{prefix}{dotted}'{_nearest(head, cls, prefix)}")
  hint = _hints(cls)[head]
  tp = fields[head].metadata.get("overrides") or _optional_base(hint) or hint
  if rest and dataclasses.is_dataclass(tp):
    check_path(rest, tp, f"{prefix}{head}.")


def _nearest(key: str, cls: type, path: str) -> str:
  """Where `key` may have been meant: a derived field's source, else the closest name here or one section
  down (a field that moved into a section: `rl.steps` → `rl.schedule.steps`)."""
  why = _derived(cls, key)
  if why:
    return f": it is derived; {why}"
  hints, names = _hints(cls), list(_settable(cls))
  options = {n: n for n in names}  # dotted name → its last part; this section's own names first
  for n in names:
    if dataclasses.is_dataclass(hints[n]):
      options |= {f"{n}.{k}": k for k in _settable(hints[n])}
  close = difflib.get_close_matches(key, list(dict.fromkeys(options.values())), n=1, cutoff=0.5)
  if not close:
    return f"; valid keys here: {', '.join(names)}"
  return f"; did you mean '{path}{next(o for o, last in options.items() if last == close[0])}'?"


def _coerce(tp: Any, value: Any, where: str, default: Any = None) -> Any:
  """The value as the field's type: nested dataclasses built (missing keys from `default`, the field's
  default section), lists → tuples, ints → floats."""
  base = _optional_base(tp)
  if base is not None:
    return None if value is None else _coerce(base, value, where)
  if dataclasses.is_dataclass(tp):
    return value if isinstance(value, tp) else from_dict(tp, value, f"{where}.", base=default)
  origin = typing.get_origin(tp)
  if origin is dict:
    return dict(value.to_dict() if hasattr(value, "to_dict") else value)
  if origin is tuple:
    if not isinstance(value, list | tuple):
      raise ConfigError(f"{where} must be a tuple, got {value!r}")
    return tuple(value)
  if origin is typing.Literal:
    if value not in typing.get_args(tp):
      raise ConfigError(f"{where}={value!r}: must be one of {', '.join(map(repr, typing.get_args(tp)))}")
    return value
  if tp is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if isinstance(tp, type) and tp is not Any and not isinstance(value, tp):
    raise ConfigError(f"{where}={value!r}: expected {tp.__name__}, got {type(value).__name__}")
  return value


def _check_keys(cls: type, value: Any, path: str) -> None:
  names = _settable(cls)
  for key in value.to_dict() if hasattr(value, "to_dict") else value:
    if key not in names:
      raise ConfigError(f"unknown config key '{path}{key}'{_nearest(key, cls, path)}")
