"""Held-out inputs beyond plain arguments, and inputs no test made (issue 30, class 5).

The runner encodes functions and classes by the name their module exports them under, and instances of
the library's own classes by their state, so held-out calls exist for methods and callbacks; the grader
generates variants of the recorded inputs, and code that is right only on the tests' own inputs is
flagged once every test passed (an honest solution that differs on a few odd inputs is not).
"""

import collections
import operator
import random
import sys
import types

import pytest

from composer_jax.synth import codec, heldout, runner


class Box:  # stands for a class of the library under test (`codec.LIBRARY`), module `fakelib`
  __module__ = "fakelib"

  def __init__(self, items):
    self.items = list(items)


class Slotted:
  __module__ = "fakelib"
  __slots__ = ("x",)


class ListBox(list):
  __module__ = "fakelib"


class OrderedBox(collections.OrderedDict):  # its items live in a C base the codec does not read
  __module__ = "fakelib"


@pytest.fixture
def library(monkeypatch):
  lib = types.ModuleType("fakelib")
  lib.Box, lib.Slotted, lib.ListBox, lib.OrderedBox = Box, Slotted, ListBox, OrderedBox
  monkeypatch.setitem(sys.modules, "fakelib", lib)
  monkeypatch.setattr(codec, "LIBRARY", {"fakelib"})


def test_references_and_library_objects_round_trip(library):
  enc = runner.encode([len, operator.add, Box([1, 2])])
  assert enc[1][0] == ["ref", "builtins", "len"] and enc[1][1] == ["ref", "_operator", "add"]
  assert enc[1][2][:3] == ["obj", "fakelib", "Box"]
  out = runner.decode(enc)
  assert out[0] is len and out[1] is operator.add and type(out[2]) is Box and out[2].items == [1, 2]


@pytest.mark.parametrize(
  "value",
  [lambda x: x, Box.__init__.__get__(Box([])), OrderedBox()],
  ids=["lambda", "bound_method", "c_base_other_than_dict_list_set"],
)
def test_what_cannot_be_named_or_restored_is_not_encoded(library, value):
  with pytest.raises(runner.Unencodable):
    runner.encode(value)


def test_objects_outside_the_library_are_not_encoded(library, monkeypatch):
  monkeypatch.setattr(codec, "LIBRARY", set())
  with pytest.raises(runner.Unencodable):
    runner.encode(Box([1]))  # LIBRARY empty: a state-only encoding could make unequal objects equal


def test_canonical_tells_references_and_states_apart(library):
  c = heldout.canonical
  assert c(runner.encode(len)) != c(runner.encode(abs))
  assert c(runner.encode(Box([1]))) != c(runner.encode(Box([2])))
  assert c(runner.encode(Box([1]))) == c(runner.encode(Box([1])))


def test_variants_are_new_inputs():
  calls = ({"pos": [["list", [1, 2, 3]]], "var": [], "kw": {}}, {"pos": ["ab_cd", True], "var": [], "kw": {}})
  made, tests = heldout.variants(calls, (("t1",), ("t2",)), random.Random(0))
  assert made and len(made) == len(tests) and not set(map(repr, made)) & set(map(repr, calls))
  assert len({repr(m) for m in made}) == len(made)
  assert heldout.variants(calls, (("t1",), ("t2",)), random.Random(0)) == (made, tests)  # seeded
  refs = ({"pos": [["ref", "builtins", "len"]], "var": [], "kw": {}},)
  assert heldout.variants(refs, (("t",),), random.Random(0)) == ((), ())  # nothing plain to vary


def _checks(n_recorded: int, n_generated: int) -> heldout.Checks:
  n = n_recorded + n_generated
  return heldout.Checks(
    "m", "f", tuple({"pos": [i], "var": [], "kw": {}} for i in range(n)), (("t",),) * n,
    (("r", ("int", 1)),) * n, (False,) * n_recorded + (True,) * n_generated,
  )  # fmt: skip


def _outs(right: int, wrong: int) -> list[dict]:
  return [{"t": "out", "i": i, "r": 1 if i < right else 2} for i in range(right + wrong)]


def test_generated_inputs_flag_only_code_fit_to_the_tests():
  checks = _checks(2, 4)
  table = _outs(2, 4)  # right on the tests' inputs, wrong on every generated one
  assert "fit only the tests' inputs" in heldout.flags(checks, table, {"t"}, all_passed=True)[0]
  assert heldout.flags(checks, table, {"t"}, all_passed=False) == []  # a partial solution: never
  assert heldout.flags(checks, _outs(5, 1), {"t"}, all_passed=True) == []  # differs on one odd input
  assert heldout.flags(_checks(2, 2), _outs(2, 2), {"t"}, all_passed=True) == []  # too few to decide
