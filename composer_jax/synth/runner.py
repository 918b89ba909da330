"""The grader's own entry point inside the sandbox: pytest with a fixed start-up, or the held-out driver.

Runs as `python -I -B /.grader/runner.py` (standalone: it imports nothing of composer_jax, which is not in
the sandbox). Its spec arrives on the fd in `$COMPOSER_INPUT_FD` (a memfd), read and closed before any
code under test runs: no file in the sandbox tells a run which run of the grade it is.

Why this start-up: `-I` keeps the working directory and `PYTHON*` variables out of `sys.path`, so a module
in the task dir cannot shadow the standard library or site-packages; the task's import roots are *appended*
after them. Plugin autoload is off and the venv's
own pytest plugins are passed explicitly (`-p`), so a `.dist-info` entry point or `.pth` planted in the
task tree loads nothing; the cache provider is off.

Results go to the pipe in `$COMPOSER_CHANNEL_FD` (held by the grader), one JSON object per line:
  {"t": "item", "id", "idx"}        a collected test and its parametrisation indices (to pair twins)
  {"t": "rep", "id", "when", "outcome", "xfail"}   pytest's report of one phase
  {"t": "cerr", "id"}               a collection error
  {"t": "call", "test", "args"}     record mode: the target was called with these (plain) arguments
  {"t": "out", "i", "r" | "exc" | "obj"}           call mode: result of call i (encoded), or why none
  {"t": "end", "rc"}                the runner finished
Code under test can write to the same pipe; the grader never trusts a line for more than the code could
have computed itself (see canary.py and heldout.py).

Encoding of plain values (arguments and results): None, bool, int, str as JSON; floats, bytes, complex,
range and containers as `[tag, payload]`; exact types only (a subclass or any other object is not plain),
so an object with a permissive `__eq__` can never encode as the value it claims to equal. Also: a
function or class by reference (`["ref", module, qualname]`, where the module exports it under that name)
and an instance of a class of the library by its state (`["obj", module, qualname, state]`, no slots, no
builtin base); test modules' functions and lambdas are not encoded. Every record is validated by the
grader (pipe.py) before use.

Start-up and the gate: pytest and the venv's plugins are imported first (no code of the task: its roots
are not on `sys.path` yet), then the runner waits on `$COMPOSER_GATE_FD` when given: the grader starts
the next run of a grade early and opens its gate only once the run before it has ended.
"""

import importlib
import json
import os
import sys
import types

MAX_NODES = 20_000
MAX_ITER = 10_000
MAX_DEPTH = 48  # nesting of an encoded value (the grader refuses deeper records)
_CO_VARARGS, _CO_VARKEYWORDS = 0x04, 0x08


class Unencodable(Exception):
  pass


def encode(x, budget: list | None = None, *, results: bool = False, depth: int = 0):
  """Plain value -> JSON-able tree. `results=True` also materialises builtin iterators and generators.
  Beyond plain values: a function or class importable by name -> ["ref", module, qualname]; an instance of
  a class of the library (`LIBRARY`: its packages) whose state is its `__dict__` -> ["obj", module,
  qualname, state] (held-out calls on methods and with callbacks; issue 30)."""
  budget = budget if budget is not None else [MAX_NODES]
  budget[0] -= 1
  if budget[0] < 0 or depth > MAX_DEPTH:
    raise Unencodable("too large")
  t = type(x)
  if x is None or t is bool or t is int or t is str:
    return x
  if t is float or t is complex:
    return [t.__name__, repr(x)]
  if t is bytes:
    return ["bytes", x.hex()]
  if t is range:
    return ["range", [x.start, x.stop, x.step]]
  sub = dict(budget=budget, results=results, depth=depth + 1)
  if t in (list, tuple, set, frozenset):
    return [t.__name__, [encode(v, **sub) for v in x]]
  if t is dict:
    return ["dict", [[encode(k, budget, depth=depth + 1), encode(v, **sub)] for k, v in dict.items(x)]]
  if results and _is_iterator(t):
    items = []
    for v in x:
      if len(items) >= MAX_ITER:
        return ["iter", items, "truncated"]
      items.append(encode(v, **sub))
    return ["iter", items]
  if (ref := _ref(x)) is not None:
    return ref
  if _is_library_object(x):
    return ["obj", t.__module__, t.__qualname__, encode(dict(vars(x)), **sub)]
  raise Unencodable(f"{t.__module__}.{t.__qualname__}")


LIBRARY: set = set()  # top-level package names of the library under test (from the spec)


def _named(module, qualname) -> bool:
  if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
    return False
  parts = module.split(".")
  return not any(p.startswith("test") or p == "conftest" for p in parts)  # test modules are not in every tree


def _ref(x):
  """["ref", module, qualname] for a function, builtin or class that its module exports under that name."""
  if not isinstance(x, type | types.FunctionType | types.BuiltinFunctionType):
    return None
  module, qualname = getattr(x, "__module__", None), getattr(x, "__qualname__", None)
  if not _named(module, qualname) or module not in sys.modules:
    return None
  obj = sys.modules[module]
  for part in qualname.split("."):
    obj = vars(obj).get(part) if isinstance(obj, types.ModuleType | type) else None
  return ["ref", module, qualname] if obj is x else None


def _is_library_object(x) -> bool:
  t = type(x)
  plain_state = not any("__slots__" in vars(c) for c in t.__mro__[:-1]) and isinstance(
    getattr(x, "__dict__", None), dict
  )
  builtin_base = any(c.__module__ == "builtins" for c in t.__mro__[:-1])
  return (
    t.__module__.split(".")[0] in LIBRARY
    and _named(t.__module__, t.__qualname__)
    and plain_state
    and not builtin_base
  )


def _is_iterator(t: type) -> bool:
  return hasattr(t, "__next__") and t.__module__ in ("builtins", "itertools", "collections")


def decode(v):
  if not isinstance(v, list):
    return v
  tag, payload = v[0], v[1]
  if tag in ("float", "complex"):
    return {"float": float, "complex": complex}[tag](payload)
  if tag == "bytes":
    return bytes.fromhex(payload)
  if tag == "range":
    return range(*payload)
  if tag == "dict":
    return {decode(k): decode(x) for k, x in payload}
  if tag == "ref":
    return resolve(payload, v[2])[0]
  if tag == "obj":
    cls = resolve(payload, v[2])[0]
    obj = cls.__new__(cls)
    vars(obj).update(decode(v[3]))
    return obj
  return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "iter": list}[tag](
    decode(x) for x in payload
  )


class Channel:
  def __init__(self):
    fd = os.environ.get("COMPOSER_CHANNEL_FD", "")
    self.fd = int(fd) if fd.isdigit() else None

  def emit(self, **record) -> None:
    if self.fd is None:
      return
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    while data:
      data = data[os.write(self.fd, data) :]


def resolve(module: str, qualname: str):
  """The object `module.qualname` (a function, or a method looked up in its class's __dict__)."""
  obj = importlib.import_module(module)
  for part in qualname.split("."):
    owner, obj = obj, getattr(obj, part)
  if isinstance(owner, type):
    raw = owner.__dict__.get(qualname.rsplit(".", 1)[-1])
    if isinstance(raw, staticmethod | classmethod):
      return obj, raw.__func__
  return obj, obj


def _code_of(fn):
  while hasattr(fn, "__wrapped__"):
    fn = fn.__wrapped__
  return getattr(fn, "__code__", None)


def bound_args(frame) -> dict:
  """{"pos", "var", "kw"} of a call, read from its frame at the 'call' event (before the body runs)."""
  code, loc = frame.f_code, frame.f_locals
  names, n = code.co_varnames, code.co_argcount
  out = {"pos": [loc[x] for x in names[:n]], "var": [], "kw": {}}
  out["kw"] = {x: loc[x] for x in names[n : n + code.co_kwonlyargcount]}
  i = n + code.co_kwonlyargcount
  if code.co_flags & _CO_VARARGS:
    out["var"], i = list(loc[names[i]]), i + 1
  if code.co_flags & _CO_VARKEYWORDS:
    out["kw"].update(loc[names[i]])
  return out


def encode_call(bound: dict) -> dict:
  """Arguments of one call (`bound_args`) as {"pos": [...], "var": [...], "kw": {name: ...}}, encoded."""
  budget = [MAX_NODES]
  return {
    "pos": [encode(v, budget) for v in bound["pos"]],
    "var": [encode(v, budget) for v in bound["var"]],
    "kw": {k: encode(v, budget) for k, v in bound["kw"].items()},
  }


def decode_call(call: dict) -> tuple[list, dict]:
  return [decode(v) for v in (*call["pos"], *call["var"])], {k: decode(v) for k, v in call["kw"].items()}


def _pytest(spec: dict, chan: Channel) -> int:
  os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
  import pytest

  record = spec.get("record")
  code = _code_of(resolve(record["module"], record["qualname"])[1]) if record else None
  state = {"test": None, "frames": []}

  def profile(frame, event, arg):
    # A generator's frame gets a 'call' event on every resume: record each frame once, at its first.
    if event != "call" or frame.f_code is not code or not state["test"]:
      return
    seen = state["frames"]
    if len(seen) < record.get("per_test", 4) and not any(frame is f for f in seen):
      seen.append(frame)
      try:
        chan.emit(t="call", test=state["test"], args=encode_call(bound_args(frame)))
      except Unencodable:
        pass

  class Reporter:
    def pytest_collection_finish(self, session):
      for item in session.items:
        spec_ = getattr(item, "callspec", None)
        idx = sorted(spec_.indices.items()) if spec_ is not None else []
        chan.emit(t="item", id=item.nodeid, idx=idx)

    def pytest_collectreport(self, report):
      if report.failed:
        chan.emit(t="cerr", id=report.nodeid)

    def pytest_runtest_logreport(self, report):
      chan.emit(t="rep", id=report.nodeid, when=report.when, outcome=report.outcome,
                xfail=hasattr(report, "wasxfail"))  # fmt: skip

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
      recording = code is not None and item.nodeid in record.get("tests", ())
      state["test"] = item.nodeid if recording else None
      if recording:
        sys.setprofile(profile)
      try:
        yield
      finally:
        sys.setprofile(None)
        state["test"], state["frames"] = None, []

  plugins = [a for p in spec.get("plugins", ()) for a in ("-p", p)]
  args = ["-p", "no:cacheprovider", "--color=no", "-q", "--tb=short", *plugins, *spec.get("args", ())]
  return int(pytest.main(args, plugins=[Reporter()]))


def _calls(spec: dict, chan: Channel) -> int:
  """Call the target on each call's arguments, `repeat` times; with `self_state`, a call's result is the
  pair (return value, state of its first argument afterwards): what a method that returns None does."""
  target, _ = resolve(spec["module"], spec["qualname"])
  chan.emit(t="ready")
  for i, call in enumerate(spec["calls"]):
    for _ in range(spec.get("repeat", 1)):
      try:
        args, kwargs = decode_call(call)
      except Exception:  # noqa: BLE001 (a reference this tree cannot import: no answer, the call is dropped)
        chan.emit(t="out", i=i, obj="undecodable")
        continue
      try:
        out = target(*args, **kwargs)
      except BaseException as err:  # noqa: BLE001 (SystemExit too: a result like any other)
        chan.emit(t="out", i=i, exc=type(err).__name__)
        continue
      try:
        out = (out, args[0]) if spec.get("self_state") and args else out
        chan.emit(t="out", i=i, r=encode(out, results=True))
      except Unencodable as err:
        chan.emit(t="out", i=i, obj=str(err)[:200])
  return 0


def read_spec() -> dict:
  fd = int(os.environ.pop("COMPOSER_INPUT_FD"))
  with os.fdopen(fd, "rb") as f:
    return json.loads(f.read())


def warm_up(spec: dict) -> None:
  """Imports that run no code of the task (pytest, the venv's plugins), done before the gate: the task's
  roots are not on `sys.path` yet."""
  if spec["mode"] != "pytest":
    return
  os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
  import pytest  # noqa: F401

  for name in spec.get("plugins", ()):
    try:
      importlib.import_module(name)
    except Exception:  # noqa: BLE001 (pytest reports it when it loads the plugin)
      pass


def wait_gate() -> None:
  """Held here until the grader opens the gate (the run before this one has ended); EOF: not to run."""
  fd = os.environ.pop("COMPOSER_GATE_FD", "")
  if fd.isdigit():
    opened = os.read(int(fd), 1)
    os.close(int(fd))
    if not opened:
      os._exit(5)


def main(argv: list[str]) -> None:
  spec = read_spec()
  warm_up(spec)
  wait_gate()
  sys.path += [r for r in spec.get("roots", ()) if r not in sys.path]
  LIBRARY.update(spec.get("packages", ()))
  chan, rc = Channel(), 3
  try:
    rc = _pytest(spec, chan) if spec["mode"] == "pytest" else _calls(spec, chan)
  finally:
    chan.emit(t="end", rc=rc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no atexit handler of the code under test runs after the end record


if __name__ == "__main__":
  main(sys.argv)
