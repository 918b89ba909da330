"""The result pipe as data (issue 30): a strict schema, and a fuzz of random and adversarial content.

Every record on the pipe may come from the code under test. `pipe.parse` must never raise, keep only
records of the exact shape the runner writes, and name every other line, a line cut short or a pipe cut at
its cap in a flag; the held-out check must flag outputs that are not one per call.
"""

import json
import random

import pytest

from composer_jax.synth import heldout, pipe

GOOD = [
  {"t": "item", "id": "tests/test_a.py::test_x[1-2]", "idx": [["a", 0], ["b", 1]]},
  {"t": "rep", "id": "tests/test_a.py::test_x[1-2]", "when": "call", "outcome": "passed", "xfail": False},
  {"t": "cerr", "id": "tests/test_b.py"},
  {"t": "end", "rc": 0},
]


def lines(*recs) -> bytes:
  return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in recs)


def test_runner_records_pass_unflagged():
  p = pipe.parse(lines(*GOOD), allowed=pipe.PYTEST_TYPES)
  assert p.records == GOOD and p.flags == []
  out = [{"t": "ready"}, {"t": "out", "i": 0, "r": ["list", [1, ["float", "2.5"]]]}, {"t": "end", "rc": 0}]
  assert pipe.parse(lines(*out), allowed=pipe.CALL_TYPES) == pipe.Parsed(out, [])


ADVERSARIAL = {
  "deep_nesting": b'{"t": "item", "id": "x", "idx": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
  "deep_value": json.dumps({"t": "out", "i": 0, "r": json.loads("[" * 500 + "]" * 500)}).encode(),
  "idx_wrong_type": json.dumps({"t": "item", "id": "x", "idx": [1, 2]}).encode(),
  "idx_str_index": json.dumps({"t": "item", "id": "x", "idx": [["a", "0"]]}).encode(),
  "id_not_str": json.dumps(
    {"t": "rep", "id": 7, "when": "call", "outcome": "passed", "xfail": False}
  ).encode(),
  "bool_as_int": json.dumps({"t": "end", "rc": True}).encode(),
  "unknown_outcome": json.dumps(
    {"t": "rep", "id": "x", "when": "call", "outcome": "ok", "xfail": False}
  ).encode(),
  "extra_field": json.dumps({"t": "cerr", "id": "x", "also": 1}).encode(),
  "unknown_type": json.dumps({"t": "pass_all"}).encode(),
  "not_object": b"[1, 2, 3]",
  "not_json": b"\xff\xfe garbage",
  "huge_number": b'{"t": "end", "rc": ' + b"9" * 5000 + b"}",
  "out_in_pytest_run": json.dumps({"t": "out", "i": 0, "r": 1}).encode(),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_line_is_flagged_not_raised(name):
  p = pipe.parse(lines(GOOD[0], ADVERSARIAL[name], {"t": "end", "rc": 0}), allowed=pipe.PYTEST_TYPES)
  assert p.records == [GOOD[0], {"t": "end", "rc": 0}]
  assert len(p.flags) == 1 and p.flags[0].startswith("pipe: 1 malformed or unexpected"), p.flags


@pytest.mark.parametrize(
  ("recs", "why"),
  [
    ((GOOD[0], GOOD[0]), "a second item record"),
    (({"t": "ready"}, {"t": "ready"}), "a second ready record"),
    (({"t": "end", "rc": 0}, GOOD[1]), "after the end record"),
  ],
)
def test_duplicates_and_records_after_end_are_flagged(recs, why):
  p = pipe.parse(lines(*recs), allowed=pipe.PYTEST_TYPES | pipe.CALL_TYPES)
  assert any(why in f for f in p.flags), p.flags


def test_truncation_and_unterminated_line_are_flagged():
  assert pipe.parse(lines(*GOOD), truncated=True).flags == [
    "pipe: truncated at its byte cap (results past it were lost)"
  ]
  p = pipe.parse(lines(*GOOD) + b'{"t": "rep", "id"')
  assert p.records == GOOD and "unterminated" in p.flags[0]


def _random_value(rng: random.Random, depth: int = 0):
  kind = rng.randrange(8 if depth < 6 else 5)
  if kind == 0:
    return rng.choice([None, True, False, 0, -1, 2**70, 1.5, float("inf")])
  if kind in (1, 2):
    return rng.choice(["t", "id", "idx", "item", "rep", "end", "out", "i", "r", "call", "", "passed"])
  if kind in (3, 4):
    return rng.randrange(-5, 5)
  if kind == 5:
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
  keys = ["t", "id", "idx", "when", "outcome", "xfail", "rc", "i", "r", "exc"]
  return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(6))}


def _random_line(rng: random.Random) -> bytes:
  roll = rng.random()
  if roll < 0.5:
    return json.dumps(_random_value(rng)).encode()
  if roll < 0.8:  # a valid record with one field replaced
    rec = dict(rng.choice(GOOD))
    rec[rng.choice(list(rec))] = _random_value(rng)
    return json.dumps(rec).encode()
  return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))


def test_fuzz_never_raises_and_keeps_only_schema_records():
  rng = random.Random(30)
  for _ in range(400):
    data = b"\n".join(_random_line(rng) for _ in range(rng.randrange(1, 30)))
    p = pipe.parse(data, allowed=pipe.PYTEST_TYPES | pipe.CALL_TYPES, truncated=rng.random() < 0.1)
    for r in p.records:  # what survives is exactly what the schema allows, checked again line by line
      assert pipe.check(json.dumps(r).encode(), pipe.PYTEST_TYPES | pipe.CALL_TYPES) == (r, "")
    checks = heldout.Checks("m", "f", ({"pos": [], "var": [], "kw": {}},), (("t",),), (("r", ("int", 1)),))
    heldout.flags(checks, p.records, {"t"})  # the held-out comparison takes any surviving record


def test_heldout_flags_outputs_not_one_per_call():
  checks = heldout.Checks("m", "f", ({"pos": [1], "var": [], "kw": {}},), (("t",),), (("r", ("int", 1)),))
  one = [{"t": "out", "i": 0, "r": 1}]
  assert heldout.flags(checks, one, {"t"}) == []
  assert "more than once" in heldout.flags(checks, one * 2, {"t"})[0]
  assert "never made" in heldout.flags(checks, [*one, {"t": "out", "i": 3, "r": 1}], {"t"})[0]
