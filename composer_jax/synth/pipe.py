"""The result pipe's records, validated as data before the grader uses any of them.

Why: the runner shares its interpreter with the code under test, which can write to the pipe too (its fd
number is in the environment) and can rewrite what the runner writes. So nothing on the pipe is trusted
for its shape either: each line must be one JSON object of a known type with exactly its fields, of the
right types, within bounds (string and line length, nesting depth, node count); a record type the run's
mode never emits, a second `end`/`ready` or a second collection of one test, anything after `end`, a
line cut short, and a pipe cut at its byte cap are flags, never a crash and never a pass. What is left
is still only what the process *says*; which test a record stands for, and which canary it pairs with,
the grader decides from its own prepared data (grading.py).

Record types (runner.py): item, rep, cerr, call (record mode), ready, out (call mode), end.
"""

import dataclasses
import json

MAX_LINE_BYTES = 4 << 20
MAX_RECORDS = 200_000
MAX_DEPTH = 64  # nesting of an encoded value (runner.encode) inside a record
MAX_NODES = 200_000  # JSON nodes in one record
MAX_ID = 8192  # characters of a node id or a name
PYTEST_TYPES = frozenset({"item", "rep", "cerr", "end"})
RECORD_TYPES = PYTEST_TYPES | {"call"}
CALL_TYPES = frozenset({"ready", "out", "end"})
_WHEN = frozenset({"setup", "call", "teardown"})
_OUTCOMES = frozenset({"passed", "failed", "skipped"})
_ONCE = frozenset({"item", "ready", "end"})  # at most one per id (item) or per run


@dataclasses.dataclass(frozen=True)
class Parsed:
  records: list[dict]  # the valid records, in order
  flags: list[str]  # "pipe: ..." lines; empty for a clean pipe


def _text(v, limit: int = MAX_ID) -> bool:
  return type(v) is str and len(v) <= limit


def _int(v, lo: int, hi: int) -> bool:
  return type(v) is int and lo <= v <= hi


def _member(v, choices: frozenset) -> bool:
  return type(v) is str and v in choices


def _bounded(v) -> bool:
  """Nesting depth at most MAX_DEPTH and at most MAX_NODES nodes (iterative: no recursion to exhaust)."""
  todo, nodes = [(v, 0)], 0
  while todo:
    x, depth = todo.pop()
    nodes += 1
    if depth > MAX_DEPTH or nodes > MAX_NODES:
      return False
    if isinstance(x, list):
      todo += [(y, depth + 1) for y in x]
    elif isinstance(x, dict):
      todo += [(y, depth + 1) for y in x.values()]
    elif isinstance(x, str) and len(x) > MAX_LINE_BYTES:
      return False
  return True


def _idx(v) -> bool:
  return (
    isinstance(v, list)
    and len(v) <= 64
    and all(isinstance(p, list) and len(p) == 2 and _text(p[0], 256) and _int(p[1], 0, 1 << 20) for p in v)
  )


def _args(v) -> bool:
  return (
    isinstance(v, dict)
    and set(v) == {"pos", "var", "kw"}
    and isinstance(v["pos"], list)
    and isinstance(v["var"], list)
    and isinstance(v["kw"], dict)
  )


def _out(r: dict) -> bool:
  kinds = [k for k in ("r", "exc", "obj") if k in r]
  if len(kinds) != 1 or set(r) != {"t", "i", kinds[0]} or not _int(r["i"], 0, MAX_RECORDS):
    return False
  return kinds[0] == "r" or _text(r[kinds[0]], 1024)


_FIELDS = {  # type -> (exact field set, check of the values)
  "item": ({"t", "id", "idx"}, lambda r: _text(r["id"]) and _idx(r["idx"])),
  "rep": (
    {"t", "id", "when", "outcome", "xfail"},
    lambda r: (
      _text(r["id"])
      and _member(r["when"], _WHEN)
      and _member(r["outcome"], _OUTCOMES)
      and type(r["xfail"]) is bool
    ),
  ),
  "cerr": ({"t", "id"}, lambda r: _text(r["id"])),
  "call": ({"t", "test", "args"}, lambda r: _text(r["test"]) and _args(r["args"])),
  "ready": ({"t"}, lambda r: True),
  "end": ({"t", "rc"}, lambda r: _int(r["rc"], -(1 << 16), 1 << 16)),
}


def check(line: bytes, allowed: frozenset) -> tuple[dict | None, str]:
  """(the record, "") when `line` is a valid record of an allowed type, else (None, why not)."""
  if len(line) > MAX_LINE_BYTES:
    return None, f"a line of {len(line)} bytes"
  try:
    r = json.loads(line)
  except (ValueError, RecursionError, MemoryError):  # RecursionError: nesting past the decoder's stack
    return None, "not JSON"
  t = r.get("t") if isinstance(r, dict) else None
  if type(t) is not str or t not in allowed:
    return None, f"record type {str(t)[:40]!r} not expected here"
  if not _bounded(r):
    return None, f"a {t} record nested or sized past the bounds"
  if t == "out":
    return (r, "") if _out(r) else (None, "a malformed out record")
  fields, ok = _FIELDS[t]
  if set(r) != fields or not ok(r):
    return None, f"a malformed {t} record"
  return r, ""


def _once_key(r: dict):
  return (r["t"], r["id"]) if r["t"] == "item" else (r["t"],) if r["t"] in _ONCE else None


def parse(data: bytes, *, allowed: frozenset = RECORD_TYPES | CALL_TYPES, truncated: bool = False) -> Parsed:
  """Valid records of `data` and one flag per kind of trouble (first instance named)."""
  bad: list[str] = []
  flags = ["pipe: truncated at its byte cap (results past it were lost)"] if truncated else []
  lines = data.split(b"\n")
  if lines[-1]:
    bad.append("an unterminated last line")
  lines = lines[:-1]
  if len(lines) > MAX_RECORDS:
    flags.append(f"pipe: {len(lines)} records, more than the {MAX_RECORDS} a run may send")
    lines = lines[:MAX_RECORDS]
  out, seen, ended = [], set(), False
  for line in lines:
    r, why = check(line, allowed)
    if r is not None and ended:
      why = f"a {r['t']} record after the end record"
    elif r is not None and (key := _once_key(r)) is not None:
      why = (
        f"a second {r['t']} record" + (f" for {r['id'][:200]}" if "id" in r else "") if key in seen else ""
      )
      seen.add(key)
    if why:
      bad.append(why)
      continue
    ended = r["t"] == "end"
    out.append(r)
  if bad:
    flags.append(f"pipe: {len(bad)} malformed or unexpected records (first: {bad[0]})")
  return Parsed(out, flags)
