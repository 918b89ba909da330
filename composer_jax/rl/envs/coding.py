"""The coding environment over synthetic feature-deletion tasks (`composer_jax.synth`).

Tools (chat.py syntax; every one runs inside `synth.Sandbox` with the checkout mounted at /task):

  list_files [dir]                    files under dir (default .), .git excluded
  read_file path
  write_file path\\n<content>         creates parent dirs, replaces the file
  run_tests [pytest args ...]         the visible tests (the feature's own tests are hidden), run on a
                                      copy in the sandbox's size-capped tmpfs: their side effects never
                                      reach the graded tree, and the host copies nothing of the agent's
  submit                              end the episode

The reward is `synth.grade(task, work_dir, actions=<action log>)`: F2P pass fraction, 0 on any P2P failure
or flag. The grader reads the working copy once (a snapshot) and runs only its library sources; nothing the
agent writes with these tools reaches the grader's own files or processes. Outputs are cut to
`max_output_chars` (head and tail kept). The step limit is enforced by the driver
(`envs.advance(max_turns=...)`), the wall-clock limit here; an exception anywhere (sandbox, grader) marks
the rollout failed with reward 0 through `envs.begin/advance/finish`, never raised.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time

from composer_jax.rl import chat
from composer_jax.rl.envs import Step
from composer_jax.synth import baseline, monitor, sandbox, tasks
from composer_jax.synth.grading import internal_error

TOOLS = ("list_files", "read_file", "write_file", "run_tests", "submit")
_WRITE = (
  "import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True); "
  "p.write_text(sys.argv[2])"
)
_SYSTEM = (
  "You are fixing a Python repository. Tools: list_files [dir], read_file path, write_file path then the "
  "new content on the following lines, run_tests [pytest args], submit."
)


@dataclasses.dataclass(frozen=True)
class CodingConfig:
  max_turns: int = 30
  wall_clock_s: float = 600.0  # per episode, tool time included
  tool_timeout_s: float = 60.0  # per sandboxed command
  grade_timeout_s: float = 300.0
  max_output_chars: int = 4000


def truncate(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  head, tail = text[: limit // 2], text[-(limit // 2) :]
  return f"{head}\n[... {len(text) - len(head) - len(tail)} characters truncated ...]\n{tail}"


class CodingEnv:
  """One task; each `reset(seed)` checks out a fresh working copy under `work_root/episode-<seed>`."""

  def __init__(self, task: tasks.Task, work_root: str | pathlib.Path, cfg: CodingConfig = CodingConfig()):
    self.task, self.cfg = task, cfg
    self.work_root = pathlib.Path(work_root)
    self.box = baseline.make_sandbox(task.venv, timeout_s=cfg.tool_timeout_s)
    self.work: pathlib.Path | None = None
    self.actions: list[monitor.Action] = []
    self.started = 0.0
    self.timed_out = False
    self._reward: float | None = None
    self.grade: tasks.Grade | None = None

  @property
  def max_turns(self) -> int:
    return self.cfg.max_turns

  def info(self) -> dict:
    return {"tools": TOOLS, "example": "read_file path/to/file.py", "test_tool": "run_tests"}

  def reset(self, seed: int) -> list[tuple[int, str]]:
    work = self.work_root / f"episode-{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.parent.mkdir(parents=True, exist_ok=True)
    self.work = tasks.checkout(self.task, work)
    self.actions, self._reward, self.grade, self.timed_out = [], None, None, False
    self.started = time.monotonic()
    return [(chat.SYSTEM, _SYSTEM), (chat.USER, self.task.statement)]

  def _run(self, cmd: list[str], **kw) -> str:
    left = self.cfg.wall_clock_s - (time.monotonic() - self.started)
    r = self.box.run(cmd, self.work, timeout_s=max(1.0, min(self.cfg.tool_timeout_s, left)), **kw)
    out = r.stdout + (f"\n{r.stderr}" if r.stderr.strip() else "")
    if r.timed_out:
      out += f"\n[timed out after {r.wall_s:.0f}s]"
    elif r.returncode:
      out += f"\n[exit code {r.returncode}]"
    return truncate(out.strip(), self.cfg.max_output_chars)

  def step(self, call: chat.ToolCall | chat.ParseError) -> Step:
    if time.monotonic() - self.started > self.cfg.wall_clock_s:
      self.timed_out = True
      return Step("Error: episode time limit reached.", True, truncated=True)
    tools = ", ".join(TOOLS)
    if isinstance(call, chat.ParseError):
      if call.kind == "no_call":
        return Step(f"Error: no tool call. Available tools: {tools}.", False, ok=False)
      return Step(
        f"Error: malformed tool call ({call.kind}). Call a tool like: read_file a.py", False, ok=False
      )
    if call.name not in TOOLS:
      return Step(f"Error: unknown tool '{call.name}'. Available tools: {tools}.", False, ok=False)
    py = baseline.python(self.task.venv)
    a = call.args
    if call.name == "submit":
      return Step("", True)
    if call.name == "list_files":
      if len(a) > 1:
        return Step("Error: list_files takes at most 1 argument.", False, ok=False)
      self.actions.append(monitor.Action("list_files", {"path": a[0] if a else "."}))
      cmd = ["find", a[0] if a else ".", "-path", "*/.git", "-prune", "-o", "-type", "f", "-print"]
      return Step(self._run(cmd, tree_limits=False), False)
    if call.name == "read_file":
      if len(a) != 1:
        return Step("Error: read_file takes 1 argument: a path.", False, ok=False)
      self.actions.append(monitor.Action("read_file", {"path": a[0]}))
      return Step(self._run(["cat", "--", a[0]], tree_limits=False), False)
    if call.name == "write_file":
      if len(a) != 2:
        return Step("Error: write_file takes a path, then the content on the next lines.", False, ok=False)
      self.actions.append(monitor.Action("write_file", {"path": a[0], "content": a[1]}))
      out = self._run([py, "-I", "-c", _WRITE, a[0], a[1]], tree_limits=False)  # -I: no module of /task runs
      return Step(out or f"Wrote {len(a[1])} characters to {a[0]}.", False)
    self.actions.append(monitor.Action("run_tests", {"args": " ".join(a)}))
    # On a copy inside the sandbox (copy_in): files the tests write (state files, caches) must not enter
    # the graded tree, where the monitor would read them as test-surface edits.
    return Step(self._run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *a], copy_in=True), False)

  def reward(self) -> float:
    """The grade's reward; an error in grading is reward 0 with a named flag in `self.grade`, never raised."""
    if self._reward is None:
      try:
        g = tasks.grade(self.task, self.work, actions=self.actions, timeout_s=self.cfg.grade_timeout_s)
      except sandbox.SandboxUnavailable:
        raise
      except Exception as err:  # noqa: BLE001 (grade is total already; this keeps a training loop alive regardless)
        g = tasks.Grade(0.0, (), (*self.task.fail_to_pass, *self.task.pass_to_pass), (internal_error(err),))
      self.grade, self._reward = g, float(g.reward)
    return self._reward
