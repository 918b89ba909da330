"""The private tokamax names this package uses exist in the installed tokamax, which is the pinned one.

A tokamax upgrade that moves them fails here, in one line naming the version they were written for,
rather than deep inside a kernel trace on a TPU."""

import pathlib
import tomllib

import pytest

from composer_jax.model import tokamax_private

_PYPROJECT = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def test_the_kernels_extra_pins_the_version_the_private_names_are_for():
  assert _PYPROJECT["project"]["optional-dependencies"]["kernels"] == [f"tokamax=={tokamax_private.PINNED}"]


@pytest.mark.parametrize("name", sorted(tokamax_private.MODULES))
def test_every_private_name_is_there(name):
  if tokamax_private.installed() is None:
    pytest.skip("tokamax is not installed (extra `kernels`)")
  assert tokamax_private.installed() == tokamax_private.PINNED, (
    f"tokamax {tokamax_private.installed()} is installed; composer_jax's private tokamax names are those "
    f"of tokamax {tokamax_private.PINNED}: install it with `pip install -e '.[kernels]'`"
  )
  found = tokamax_private.module(name)
  assert all(hasattr(found, n) for n in tokamax_private.MODULES[name][1])


def test_a_moved_module_fails_in_one_line_naming_the_pinned_version(monkeypatch):
  monkeypatch.setitem(tokamax_private.MODULES, "moved", ("ops.no_such_module", ()))
  with pytest.raises(ImportError, match=rf"tokamax._src.ops.no_such_module: .* {tokamax_private.PINNED}"):
    tokamax_private.module("moved")


def test_a_missing_name_fails_in_one_line_naming_the_pinned_version(monkeypatch):
  pytest.importorskip("tokamax", reason="tokamax is not installed (extra `kernels`)")
  monkeypatch.setitem(tokamax_private.MODULES, "gone", ("ops.ragged_dot.base", ("vjp", "no_such_name")))
  pinned = tokamax_private.PINNED
  with pytest.raises(ImportError, match=rf"has no no_such_name: .* tokamax {pinned} \(installed"):
    tokamax_private.module("gone")
