"""The runner's codec beyond plain values (issue 30, class 5): held-out calls for methods of dict
subclasses holding locks and linked lists, properties of slotted caches, functions returning paths.

Each kind round-trips (decode(encode(x)) encodes the same) and compares by value in `heldout.canonical`,
independently of the order an object's attributes were set in; the real libraries' objects (boltons'
LRI, cachetools' TTLCache, humanize's locale path) encode when their sources are cached on this machine.
"""

import collections
import datetime
import decimal
import enum
import fractions
import importlib
import pathlib
import sys
import tempfile
import threading
import types

import pytest

from composer_jax.synth import codec, heldout, sources

MISSING = object()


class Lri(dict):  # boltons.cacheutils.LRI's shape: a dict base, a lock, a cyclic sentinel list
  __module__ = "fakelib"

  def __init__(self, order=1):
    self._lock = threading.RLock()
    anchor = []
    anchor[:] = [anchor, anchor, MISSING, MISSING]
    if order:
      self.lookup, self.anchor = {}, anchor
    else:
      self.anchor, self.lookup = anchor, {}


class Link:  # cachetools' links: slots, a cycle through two objects
  __module__ = "fakelib"
  __slots__ = ("key", "next")


class Colour(enum.Enum):
  RED = 1


Colour.__module__ = "fakelib"


class Cache:
  __module__ = "fakelib"

  def __init__(self, maxsize):
    self.__maxsize = maxsize

  @property
  def maxsize(self):
    return self.__maxsize


@pytest.fixture
def library(monkeypatch):
  lib = types.ModuleType("fakelib")
  lib.Lri, lib.Link, lib.Colour, lib.Cache, lib.MISSING = Lri, Link, Colour, Cache, MISSING
  monkeypatch.setitem(sys.modules, "fakelib", lib)
  monkeypatch.setattr(codec, "LIBRARY", {"fakelib"})


def _linked():
  a, b = Link(), Link()
  a.key, a.next, b.key, b.next = 1, b, 2, a
  return a


VALUES = {
  "path": pathlib.PurePosixPath("/task/src/pkg/locale"),
  "datetime": datetime.datetime(2026, 12, 7, 11, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
  "date": datetime.date(2026, 12, 7),
  "time": datetime.time(11, 30, 5, 12),
  "timedelta": datetime.timedelta(days=3, seconds=4, microseconds=5),
  "decimal": decimal.Decimal("1.10"),
  "fraction": fractions.Fraction(3, 4),
  "odict": collections.OrderedDict([("b", 1), ("a", [2])]),
  "counter": collections.Counter("abca"),
  "defaultdict": collections.defaultdict(list, {1: [2]}),
  "deque": collections.deque([1, 2], maxlen=4),
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_standard_library_values_round_trip(name):
  enc = codec.encode(VALUES[name], results=True)
  out = codec.decode(enc)
  assert out == VALUES[name] and type(out) is type(VALUES[name])
  assert heldout.canonical(codec.encode(out, results=True)) == heldout.canonical(enc)


def test_library_objects_with_bases_slots_locks_and_cycles_round_trip(library):
  lri = Lri()
  lri["k"] = [1, 2]
  out = codec.decode(codec.encode(lri))
  assert type(out) is Lri and dict(out) == {"k": [1, 2]} and out.anchor[0] is out.anchor
  assert out.anchor[2] is MISSING and type(out._lock) is type(threading.RLock())
  link = codec.decode(codec.encode(_linked()))
  assert link.next.next is link and link.next.key == 2
  assert codec.decode(codec.encode(Colour.RED)) is Colour.RED


def test_canonical_ignores_attribute_order_not_values(library):
  c = heldout.canonical
  assert c(codec.encode(Lri(order=1))) == c(codec.encode(Lri(order=0)))
  other = Lri()
  other.anchor[1] = []  # the same shape, one link no longer a cycle
  assert c(codec.encode(other)) != c(codec.encode(Lri()))
  assert c(codec.encode(Cache(2))) != c(codec.encode(Cache(3)))


def _closure():
  def inner():
    return 1

  return inner


class _Zone(datetime.tzinfo):  # a zone the codec cannot name (zoneinfo's, dateutil's ...)
  def utcoffset(self, dt):
    return datetime.timedelta(0)


@pytest.mark.parametrize(
  "value",
  [threading.local(), datetime.datetime(2026, 1, 1, tzinfo=_Zone()), _closure()],
  ids=["state_out_of_reach", "zone_not_a_fixed_offset", "function_not_exported"],
)
def test_values_the_codec_cannot_restore_are_refused(library, value):
  with pytest.raises(codec.Unencodable):
    codec.encode(value)


def test_a_property_resolves_to_its_getter(library):
  call, fn = codec.resolve("fakelib", "Cache.maxsize")
  assert call is fn is Cache.maxsize.fget and call(Cache(5)) == 5


# ---- the libraries themselves ---------------------------------------------------------------------------
_CACHE = pathlib.Path(tempfile.gettempdir(), "composer_jax_synth_real")


def _import(monkeypatch, name: str, module: str):
  """`module` of the source `name` from its cached sdist (skipped when it was never fetched here)."""
  src = next(s for s in sources.DEFAULT_SOURCES if s.name == name)
  root = _CACHE / f"{src.name}-{src.version}" / "src"
  if not root.is_dir():
    pytest.skip(f"{name} is not cached under {_CACHE} (tests/test_synth_real.py's cache)")
  monkeypatch.syspath_prepend(str(root / "src" if (root / "src").is_dir() else root))
  for key in [k for k in sys.modules if k.split(".")[0] == module.split(".")[0]]:
    monkeypatch.delitem(sys.modules, key)
  monkeypatch.setattr(codec, "LIBRARY", {module.split(".")[0]})
  return importlib.import_module(module)


def test_boltons_lri_and_its_init_ll(monkeypatch):
  cu = _import(monkeypatch, "boltons", "boltons.cacheutils")
  lri = cu.LRI(max_size=2)
  lri["a"], lri["b"], lri["c"] = 1, 2, 3
  out = codec.decode(codec.encode(lri))
  assert dict(out) == {"b": 2, "c": 3} and out.get("b") == 2
  call, _ = codec.resolve("boltons.cacheutils", "LRI._init_ll")
  assert call(out) is None and codec.encode((None, out), results=True)


def test_boltons_init_ll_rewritten_in_another_order_compares_equal(monkeypatch):
  cu = _import(monkeypatch, "boltons", "boltons.cacheutils")

  def rewritten(self):  # an honest rewrite: the same list, attributes set in the other order
    anchor = [None, None, cu._MISSING, cu._MISSING]
    anchor[cu.PREV] = anchor[cu.NEXT] = anchor
    self._anchor, self._link_lookup = anchor, {}

  ours, theirs = cu.LRI(max_size=2), cu.LRI(max_size=2)
  for lri in (ours, theirs):
    del lri._link_lookup, lri._anchor
  cu.LRI._init_ll(ours)
  rewritten(theirs)
  assert list(vars(ours)) != list(vars(theirs))
  enc = [heldout.canonical(codec.encode((None, x), results=True)) for x in (ours, theirs)]
  assert enc[0] == enc[1]


def test_cachetools_ttl_cache_and_its_maxsize(monkeypatch):
  ct = _import(monkeypatch, "cachetools", "cachetools")
  cache = ct.TTLCache(maxsize=2, ttl=60)
  cache["a"] = 1
  out = codec.decode(codec.encode(cache))
  call, _ = codec.resolve("cachetools", "Cache.maxsize")
  assert call(out) == 2 and out["a"] == 1


def test_humanize_default_locale_path(monkeypatch):
  i18n = _import(monkeypatch, "humanize", "humanize.i18n")
  enc = codec.encode(codec.resolve("humanize.i18n", "_get_default_locale_path")[0](), results=True)
  assert enc[:2] == ["path", "PosixPath"] and enc[2].endswith("humanize/locale") and i18n
