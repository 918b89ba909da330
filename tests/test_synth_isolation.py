"""Red-team, issue 30, class 1: no run of a grade can talk to another or tell which run it is.

The corpus's channel: the suite run (whose tree holds the hidden tests' answers) signals them to the twin
and held-out runs through host-wide counters (open files in /proc/sys/fs/file-nr, memory, load) while
they run beside it. Fixed by structure: the runs of one grade are sequential (each tree dead before the
next starts), host-wide counters are masked (the /proc files, and the system calls that read the same
counters: sysinfo, syslog, the page cache's residency), open files are capped per process, the runner's
spec comes through an fd it closes (no control file), and a tree may use one CPU at a time (cgroup quota).
"""

import errno
import sys
import textwrap
import threading
import time

import pytest
from test_synth_redteam import INIT, TARGET, fixture_tasks

from composer_jax.synth import baseline, bwrap, cgroups, grading, prepare, sandbox, seccomp, tasks

pytestmark = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap/prlimit not installed")
RO = sandbox.venv_paths(sys.prefix)
SIGNAL = """\
import os, time
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(400)]  # the sender: 400 files held open
time.sleep(3)
"""
LISTEN = """\
import time
seen = set()
for _ in range(20):
  try:
    seen.add(open("/proc/sys/fs/file-nr").read().split()[0])
  except OSError:
    seen.add("masked")
  time.sleep(0.1)
print(sorted(seen))
"""
BUSY = """\
import os, time
pid = os.fork()
end = time.monotonic() + 3
while time.monotonic() < end:
  pass
if pid:
  os.waitpid(pid, 0)
"""


def run_py(tmp_path, name: str, code: str, **kw) -> sandbox.SandboxResult:
  d = tmp_path / name
  d.mkdir()
  (d / "probe.py").write_text(textwrap.dedent(code))
  kw.setdefault("timeout_s", 30)
  return sandbox.run([baseline.python(sys.prefix), "probe.py"], task_dir=d, readonly_paths=RO, **kw)


def test_host_counters_are_masked_between_sandboxes(tmp_path):
  sender = threading.Thread(target=run_py, args=(tmp_path, "send", SIGNAL))
  sender.start()
  time.sleep(0.3)
  r = run_py(tmp_path, "listen", LISTEN)
  sender.join()
  assert r.stdout.strip() == "['masked']", (r.stdout, r.stderr)
  r = run_py(
    tmp_path,
    "files",
    """
    import os
    out = {f: open(f).read() for f in ("/proc/loadavg", "/proc/meminfo", "/proc/stat", "/proc/uptime")}
    print(sorted(out.values()), os.listdir("/proc/sys"), "VmRSS" in open("/proc/self/status").read())
    """,
  )
  assert r.stdout.split("\n")[0] == "['', '', '', ''] [] True", (r.stdout, r.stderr)


def test_open_files_capped_per_process(tmp_path):
  r = run_py(
    tmp_path,
    "nofile",
    """
    import os
    n = 0
    try:
      for n in range(5000):
        os.open("/dev/null", os.O_RDONLY)
    except OSError as e:
      print(n, e.errno)
    """,
  )
  n, err = r.stdout.split()
  assert int(n) < sandbox.MAX_OPEN_FILES and int(err) == errno.EMFILE, r.stdout


@pytest.mark.skipif("cpu quota" not in cgroups.backend().note, reason="no cgroup CPU quota on this machine")
@pytest.mark.parametrize("quota", [cgroups.CPU_QUOTA, 0.3])
def test_cpu_quota_holds_under_a_busy_loop(tmp_path, monkeypatch, quota):
  # Two busy processes for 3 s of wall time: the tree gets `quota` CPUs, not the machine's two. (0.3: a
  # quota below what a loaded shared machine leaves anyway, so the check bites under any load.)
  monkeypatch.setattr(cgroups, "CPU_QUOTA", quota)
  r = run_py(tmp_path, "busy", BUSY)
  assert r.returncode == 0 and r.cpu_s <= quota * r.wall_s * 1.1, (r.cpu_s, r.wall_s)


def test_runner_spec_leaves_no_file(tmp_path):
  d = tmp_path / "tree"
  (d / "tests").mkdir(parents=True)
  (d / "tests" / "test_probe.py").write_text(
    "import os\n\ndef test_probe():\n"
    "  assert sorted(os.listdir('/.grader')) == ['codec.py', 'runner.py']\n"
    "  assert not [k for k in os.environ if 'INPUT' in k or 'SPEC' in k]\n"
    "  links = []\n"
    "  for f in os.listdir('/proc/self/fd'):\n"
    "    try:\n"
    "      links.append(os.readlink(f'/proc/self/fd/{f}'))\n"
    "    except OSError:\n"
    "      pass\n"
    "  assert links and not [x for x in links if 'memfd' in x], links\n"
  )
  run = baseline.run_suite(baseline.make_sandbox(sys.prefix), sys.prefix, d)
  assert run.outcomes == {"tests/test_probe.py::test_probe": baseline.PASSED}, run.result.stdout


PROBE = (  # on the result pipe: pytest captures the process's stdout and stderr
  "import os as _o, time as _t\n"
  "_o.write(3, f'IMPORTED {_t.monotonic()}\\n'.encode())\n"  # runner.CHANNEL_FD
)


def test_runs_of_one_grade_never_overlap(tmp_path, monkeypatch):
  """Each run's task code runs only after the run before it has ended (CLOCK_MONOTONIC is shared with
  the sandbox: the library stamps its import time); the next run may only be started and held."""
  task = next(t for t in fixture_tasks() if t.feature[0] == TARGET)
  prepare.prepared(task, baseline.make_sandbox(task.venv))  # preparation (original code only) first
  opened, spans = {}, []
  real_open, real_run = grading._open, grading._run

  def stamp_open(w, gate):
    opened[id(gate)] = time.monotonic()
    real_open(w, gate)

  def stamp_run(box, venv, job, gate=None):
    out = real_run(box, venv, job, gate)
    spans.append((opened[id(gate)], time.monotonic(), out[0].channel.decode(errors="replace")))
    return out

  monkeypatch.setattr(grading, "_open", stamp_open)
  monkeypatch.setattr(grading, "_run", stamp_run)
  view = tasks.checkout(task, tmp_path / "agent")
  (view / INIT).write_text(PROBE + (view / INIT).read_text())
  tasks.grade(task, view)
  assert len(spans) >= 3, spans
  spans.sort()
  for (_, end, _), (start, _, _) in zip(spans, spans[1:], strict=False):
    assert end <= start, spans
  for start, end, err in spans:
    stamps = [float(x.split()[1]) for x in err.splitlines() if x.startswith("IMPORTED ")]
    assert stamps and all(start <= t <= end for t in stamps), (start, end, err[-300:])


@pytest.mark.skipif(not seccomp.supported(), reason="no seccomp filter for this architecture")
def test_host_wide_calls_refused(tmp_path):
  """Counters one sandbox moves and a later one reads (load, uptime, free memory and process count by
  sysinfo, the kernel log, whether a shared read-only file's pages are cached) are refused; reading the
  file, and the interpreter's start-up, work as ever."""
  col = list(seccomp._AUDIT).index(seccomp.machine())
  nr = {name: nums[col] for name, nums in seccomp._NR.items()}
  r = run_py(
    tmp_path,
    "host",
    f"""
    import ctypes, os
    nr = {nr!r}
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(4096)
    fd = os.open("/usr/bin/env", os.O_RDONLY)
    def err(*args):
      return ctypes.get_errno() if libc.syscall(*args) < 0 else 0
    out = dict(
      sysinfo=err(nr["sysinfo"], buf), syslog=err(nr["syslog"], 3, buf, 256),
      cachestat=err(nr["cachestat"], fd, buf, buf, 0), mincore=err(nr["mincore"], buf, 4096, buf),
      io_uring=err(nr["io_uring_setup"], 4, buf),
    )
    try:
      out["loadavg"] = os.getloadavg()
    except OSError:
      out["loadavg"] = "refused"
    try:
      out["nowait"] = os.preadv(fd, [bytearray(8)], 0, os.RWF_NOWAIT)
    except OSError as e:
      out["nowait"] = e.errno
    out["read"], out["host"] = os.preadv(fd, [bytearray(8)], 0), os.uname().nodename
    print(sorted(out.items()))
    """,
  )
  eperm = errno.EPERM
  want = dict(sysinfo=eperm, syslog=eperm, cachestat=eperm, mincore=eperm, io_uring=eperm, nowait=eperm)
  want |= dict(loadavg="refused", read=8, host=bwrap.HOSTNAME)
  assert r.stdout.strip() == str(sorted(want.items())), (r.stdout, r.stderr)
