"""The grader's own entry point inside the sandbox: pytest with a fixed start-up, or the held-out driver.

Runs as `python -I -B /.grader/runner.py` (standalone: it imports nothing of composer_jax, which is not in
the sandbox). Its spec arrives on a memfd, read and closed before any code under test runs: no file in the
sandbox tells a run which run of the grade it is.

Every run looks the same to the code under test: the same argv, environment (no fd number in
it: the runner finds the sandbox's fds by kind, and `/proc/self/environ` keeps what a process started
with), the same open fds (the result pipe moved to CHANNEL_FD, the spec's memfd and the gate closed), the
same working directory and the same modules imported before its code (pytest and the venv's plugins, in
the held-out driver too). What differs is the work itself: which tests are collected, or, in the
held-out driver, that the runner calls the target rather than a test. Why that does not help is in
grading.py (`jobs`).

Why this start-up: `-I` keeps the working directory and `PYTHON*` variables out of `sys.path`, so a module
in the task dir cannot shadow the standard library or site-packages; the task's import roots are *appended*
after them. Plugin autoload is off and the venv's
own pytest plugins are passed explicitly (`-p`), so a `.dist-info` entry point or `.pth` planted in the
task tree loads nothing; the cache provider is off.

Results go to the pipe on fd CHANNEL_FD (held by the grader), one JSON object per line:
  {"t": "item", "id", "idx"}        a collected test and its parametrisation indices (to pair twins)
  {"t": "rep", "id", "when", "outcome", "xfail"}   pytest's report of one phase
  {"t": "cerr", "id"}               a collection error
  {"t": "call", "test", "args"}     record mode: the target was called with these (plain) arguments
  {"t": "out", "i", "r" | "exc" | "obj"}           call mode: result of call i (encoded), or why none
  {"t": "end", "rc"}                the runner finished
Code under test can write to the same pipe; the grader never trusts a line for more than the code could
have computed itself (see canary.py and heldout.py).

Arguments and results travel encoded by codec.py (bound next to this file in the sandbox): plain values,
standard-library values, references, and library objects by their state; every record is validated by
the grader (pipe.py) before use.

Start-up and the gate: pytest and the venv's plugins are imported first (no code of the task: its roots
are not on `sys.path` yet), then the runner waits on its gate when given one: the grader starts the next
run of a grade early and opens its gate only once the run before it has ended.
"""

import fcntl
import importlib.util
import json
import os
import pathlib
import sys

if __package__:  # imported on the host (tests, the grader)
  from composer_jax.synth import codec
else:  # run as the sandbox's entry point: its copy of codec.py lies next to it
  _spec = importlib.util.spec_from_file_location("codec", pathlib.Path(__file__).with_name("codec.py"))
  codec = importlib.util.module_from_spec(_spec)
  _spec.loader.exec_module(codec)

CHANNEL_FD = 3
_CO_VARARGS, _CO_VARKEYWORDS = 0x04, 0x08
Unencodable, encode, decode, resolve = codec.Unencodable, codec.encode, codec.decode, codec.resolve
encode_call, decode_call = codec.encode_call, codec.decode_call


class Channel:
  def __init__(self, fd: int | None):
    self.fd = fd

  def emit(self, **record) -> None:
    if self.fd is None:
      return
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    while data:
      data = data[os.write(self.fd, data) :]


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


def _pytest(spec: dict, chan: Channel) -> int:
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

  return _session(spec, Reporter(), spec.get("args", ()))


def _session(spec: dict, plugin, paths) -> int:
  """pytest.main with the fixed start-up, in every mode: the same session, environment and plugins."""
  import pytest

  plugins = [a for p in spec.get("plugins", ()) for a in ("-p", p)]
  args = ["-p", "no:cacheprovider", "--color=no", "-q", "--tb=short", *plugins, *paths]
  return int(pytest.main(args, plugins=[plugin]))


def _driver(spec: dict, chan: Channel) -> int:
  """The held-out calls, made from inside a pytest session that collects nothing: the code under test
  runs in the same surroundings as in a test run (pytest's environment and plugins configured)."""
  import pytest

  class Driver:
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session):
      return True

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
      capture = session.config.pluginmanager.getplugin("capturemanager")
      capture.resume_global_capture()  # as while a test module is imported: output captured
      try:
        _calls(spec, chan)
      finally:
        capture.suspend_global_capture()
      return True

  _session(spec, Driver(), ())
  return 0


def _calls(spec: dict, chan: Channel) -> None:
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


def take_fds() -> dict:
  """The fds the sandbox passed, by kind: "input" (the spec's memfd), "gate" (a pipe's read end),
  "channel" (a pipe's write end, moved to CHANNEL_FD). Found by what they are, not by a number in the
  environment, so that every run's environment and open fds are the same."""
  found = {}
  for name in os.listdir("/proc/self/fd"):
    fd = int(name)
    try:
      link, mode = os.readlink(f"/proc/self/fd/{fd}"), fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:  # the listing's own fd, closed by now
      continue
    pipe = link.startswith("pipe:")
    kind = "input" if link.startswith("/memfd:inputs") else ("gate" if mode == os.O_RDONLY else "channel")
    if fd > 2 and (pipe or kind == "input"):
      found.setdefault(kind, fd)
  ch = found.get("channel")
  if ch is not None and ch != CHANNEL_FD:
    for kind, fd in found.items():
      if fd == CHANNEL_FD:
        found[kind] = os.dup(fd)
    os.dup2(ch, CHANNEL_FD)
    os.close(ch)
    found["channel"] = CHANNEL_FD
  return found


def read_spec(fd: int) -> dict:
  with os.fdopen(fd, "rb") as f:
    return json.loads(f.read())


def warm_up(spec: dict) -> None:
  """Imports that run no code of the task (pytest, the venv's plugins), done before the gate (the task's
  roots are not on `sys.path` yet) and in every mode, so no run has other modules loaded than another."""
  os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
  import pytest  # noqa: F401

  try:  # pytest's own plugins, which every session imports (a private list: none if it moves)
    from _pytest.config import default_plugins, essential_plugins
  except ImportError:
    default_plugins = essential_plugins = ()
  builtin = [f"_pytest.{name}" for name in (*essential_plugins, *default_plugins)]
  for name in (*builtin, *spec.get("plugins", ())):
    try:
      importlib.import_module(name)
    except Exception:  # noqa: BLE001 (pytest reports it when it loads the plugin)
      pass


def wait_gate(fd: int | None) -> None:
  """Held here until the grader opens the gate (the run before this one has ended); EOF: not to run."""
  if fd is not None:
    opened = os.read(fd, 1)
    os.close(fd)
    if not opened:
      os._exit(5)


def main(argv: list[str]) -> None:
  fds = take_fds()
  spec = read_spec(fds["input"])
  warm_up(spec)
  wait_gate(fds.get("gate"))
  sys.path += [r for r in spec.get("roots", ()) if r not in sys.path]
  codec.LIBRARY.update(spec.get("packages", ()))
  chan, rc = Channel(fds.get("channel")), 3
  try:
    rc = _pytest(spec, chan) if spec["mode"] == "pytest" else _driver(spec, chan)
  finally:
    chan.emit(t="end", rc=rc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no atexit handler of the code under test runs after the end record


if __name__ == "__main__":
  main(sys.argv)
