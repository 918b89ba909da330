"""Canary twins and held-out comparisons, unit by unit: what is altered, what looks alike, what is equal.

The end-to-end behaviour (forgers caught, honest code passing) is in test_synth_redteam.py; here each
piece is checked against hand-worked expectations on small inputs.
"""

import ast
import random

import pytest

from composer_jax.synth import canary, heldout, runner

TESTS = """
import pytest
import pkg

TABLE = (("a", "A"), ("bc", "BC"))


def helper():
  return 1


def test_value():
  assert pkg.up("x") == "X"


def test_empty():
  assert pkg.up("") == ""


@pytest.mark.parametrize(("low", "high"), TABLE)
def test_table(low, high):
  assert high == pkg.up(low)


def test_truthy():
  assert pkg.up("x")


class TestUp:
  def setup_method(self):
    self.n = 1

  def test_method(self):
    self.assertEqual(pkg.up("y"), "Y")

  def test_other(self):
    assert True
"""
F2P = (
  "tests/test_up.py::test_value",
  "tests/test_up.py::test_empty",
  "tests/test_up.py::test_table[a-A]",
  "tests/test_up.py::test_table[bc-BC]",
  "tests/test_up.py::test_truthy",
  "tests/test_up.py::TestUp::test_method",
  "tests/test_up.py::TestUp::test_inherited",  # defined elsewhere: run from the original file
)


@pytest.fixture
def made():
  units, other = canary.units(F2P, {"tests/test_up.py": TESTS})
  rng = random.Random(0)
  return {u.func: u for u in units}, other, {u.func: canary.make_canary(u, TESTS, rng) for u in units}


def test_units_group_parametrised_ids(made):
  units, other, _ = made
  assert sorted(units) == ["test_empty", "test_method", "test_table", "test_truthy", "test_value"]
  assert units["test_table"].ids == F2P[2:4] and units["test_method"].cls == "TestUp"
  assert other == ["tests/test_up.py::TestUp::test_inherited"]


def test_canary_alterations(made):
  _, _, canaries = made
  value = ast.unparse(canaries["test_value"].fn)
  assert canaries["test_value"].how == "expected value" and "== 'X'" not in value and "pkg.up('x')" in value
  assert canaries["test_empty"].how == "expected value" and "== ''" not in ast.unparse(
    canaries["test_empty"].fn
  )
  table = canaries["test_table"]
  assert table.how == "parametrize table"
  (assign,) = table.extra
  rows = ast.literal_eval(assign.value)
  assert [r[1] for r in rows] != ["A", "BC"] and [r[0] for r in rows] == ["a", "bc"]  # the expected column
  assert canaries["test_truthy"].how == "negated assertion"
  assert "assertEqual(pkg.up('y'), 'Y')" not in ast.unparse(canaries["test_method"].fn)


def test_generated_modules_hide_which_twin_is_real(made):
  units, _, canaries = made
  twins = [canary.Twin(units["test_table"], "real", canary.def_of(units["test_table"], TESTS))]
  twins.append(
    canary.Twin(units["test_table"], "canary", canaries["test_table"].fn, canaries["test_table"].extra)
  )
  twins.append(
    canary.Twin(units["test_method"], "canary", canaries["test_method"].fn, canaries["test_method"].extra)
  )
  src, names = canary.generate(TESTS, twins, random.Random(1))
  tree = ast.parse(src)
  top = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
  assert "helper" in top and not {"test_value", "test_table", "test_truthy"} & top  # originals gone
  assert "TABLE" not in src  # only the removed tests used it: a private copy replaces it
  assert sorted(t.kind for t in names.values()) == ["canary", "canary", "real"]
  tables = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)]
  assert (
    len(tables) == 2 and (("a", "A"), ("bc", "BC")) in tables
  )  # the real twin's copy, and the altered one
  for (cls, func), twin in names.items():
    assert func.startswith("test_") and func not in ("test_table", "test_method")
    assert (cls is None) == (twin.unit.cls is None) and (cls is None or cls.startswith("Test"))
  owner = next(
    n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test") and n.name != "TestUp"
  )
  assert "setup_method" in {f.name for f in owner.body} and "test_other" not in {f.name for f in owner.body}


class _Anything(int):
  def __eq__(self, other):
    return True

  __hash__ = int.__hash__


@pytest.mark.parametrize("value", [_Anything(3), object(), type("L", (list,), {})()])
def test_runner_encodes_exact_types_only(value):
  with pytest.raises(runner.Unencodable):
    runner.encode(value, results=True)


def test_canonical_equality_is_type_strict():
  c = heldout.canonical

  def enc(x):
    return runner.encode(x, results=True)

  assert c(enc(1)) != c(enc(1.0)) != c(enc(True))
  assert c(enc((1, 2))) != c(enc([1, 2]))
  assert c(enc({"a": 1, "b": 2})) == c(enc({"b": 2, "a": 1}))
  assert c(enc({3, 1, 2})) == c(enc({1, 2, 3}))
  assert c(enc(iter([1, 2]))) == c(enc([1, 2]))  # a generator and a list of the same items
  assert c(enc(0.1 + 0.2)) == c(enc(0.3))  # 12 significant digits
  assert c(enc(b"ab")) != c(enc("ab"))


def test_heldout_flags_only_contradictions():
  call = runner.encode_call({"pos": [[1, 2]], "var": [], "kw": {}})
  checks = heldout.Checks(
    "pkg", "f", (call, call), (("t::a",), ("t::b",)), (("r", heldout.canonical(3)),) * 2
  )
  wrong = [{"t": "out", "i": 0, "r": 4}, {"t": "out", "i": 1, "r": 3}]
  assert heldout.mismatches(checks, wrong) == [0]
  assert heldout.flags(checks, wrong, passed={"t::b"}) == []  # t::a failed: an honest partial answer
  assert heldout.flags(checks, wrong, passed={"t::a"})  # t::a passed with a wrong answer: forged
  assert heldout.flags(checks, [], passed={"t::b"})  # no answer at all, yet its test passed
