"""Environments: exact toy rewards and observations, SFT demonstrations, the sandboxed coding env end to end,
and failures inside a rollout that mark it failed (reward 0) without raising."""

import pathlib

import pytest
from test_synth_tasks import fixture_env

from composer_jax.rl import chat, envs, feedback
from composer_jax.rl.envs import coding, toy
from composer_jax.synth import monitor, sandbox, tasks

TOK = chat.BYTE_TOKENIZER


def scripted(calls):
  """An `act` that emits the given calls (tuples) or raw id lists, one per turn, logprob -1 each."""
  it = iter(calls)

  def act(context):
    assert context[-1] == TOK.special_id("<|assistant|>")
    c = next(it)
    ids = c if isinstance(c, list) else chat.assistant_ids(call=c)
    return ids, [-1.0] * len(ids)

  return act


def gold_calls(p: toy.Problem):
  return [(op, str(a), str(b)) for op, a, b, _ in p.steps] + [("answer", str(p.target))]


def test_problems_deterministic_and_correct():
  cfg = toy.ToyConfig(min_ops=1, max_ops=3, max_operand=12)
  assert toy.make_problem(7, cfg) == toy.make_problem(7, cfg)
  texts = {toy.make_problem(s, cfg).text for s in range(50)}
  assert len(texts) > 40 and any("(" in t for t in texts)
  for s in range(200):
    p = toy.make_problem(s, cfg)
    assert eval(p.text.removeprefix("Compute ")) == p.target and 1 <= len(p.steps) <= 3
    assert 0 <= p.steps[0][1] <= 12 and all(0 <= b <= 12 for _, _, b, _ in p.steps)
    assert all(prev[3] == nxt[1] for prev, nxt in zip(p.steps, p.steps[1:], strict=False))


def test_toy_correct_and_wrong_answers():
  env, p = toy.ToyEnv(), toy.make_problem(11)
  traj = envs.rollout(env, 11, scripted(gold_calls(p)))
  assert (traj.reward, traj.status, traj.info["invalid_calls"]) == (1.0, chat.COMPLETED, 0)
  results = [TOK.decode(traj.turn_tokens(k)) for k, r in enumerate(traj.turn_roles) if r == chat.TOOL]
  assert results == [f"<|tool_result|>{r}<|/tool_result|>" for *_, r in p.steps]
  wrong = gold_calls(p)[:-1] + [("answer", str(p.target + 1))]
  assert envs.rollout(toy.ToyEnv(), 11, scripted(wrong)).reward == 0.0


def test_toy_error_observations_and_penalty():
  assert toy.observe(chat.ToolCall("sum", ("3", "4"))) == (
    "Error: unknown tool 'sum'. Available tools: add, mul, answer.",
    False,
  )
  assert toy.observe(chat.ParseError("truncated"))[0] == (
    "Error: malformed tool call (truncated). Call a tool like: add 3 4"
  )
  assert toy.observe(chat.ToolCall("add", ("3",)))[0] == "Error: add takes 2 integer arguments."
  assert toy.observe(chat.ToolCall("answer", ("x",)))[0] == "Error: answer takes 1 integer argument."
  p = toy.make_problem(3)
  env = toy.ToyEnv(toy.ToyConfig(invalid_penalty=0.1))
  bad = [("sum", "1", "2"), TOK.encode("add 1") + [TOK.special_id("<|end_turn|>")]]
  traj = envs.rollout(env, 3, scripted(bad + gold_calls(p)))
  assert traj.info["invalid_calls"] == 2 and traj.reward == pytest.approx(0.8)
  obs = TOK.decode(traj.turn_tokens(traj.turn_roles.index(chat.TOOL)))
  assert obs == "<|tool_result|>Error: unknown tool 'sum'. Available tools: add, mul, answer.<|/tool_result|>"


def test_toy_max_turns_truncates():
  traj = envs.rollout(toy.ToyEnv(), 0, scripted([("add", "1", "1")] * 10), max_turns=3)
  assert (traj.status, traj.info["turns"], traj.reward) == (chat.TRUNCATED, 3, 0.0)
  traj = envs.rollout(toy.ToyEnv(toy.ToyConfig(max_turns=4)), 0, scripted([("add", "1", "1")] * 10))
  assert (traj.status, traj.info["turns"], traj.reason) == (chat.TRUNCATED, 4, "max_turns 4")


def test_demonstrations_parse_and_contain_hints():
  demos = toy.demonstrations(200, seed=1)
  hint = feedback.hint_ids(feedback.hint_for("unknown_tool", toy.ToyEnv().info()))
  n_hinted = n_mistake = 0
  for d in demos:
    calls = [chat.parse_tool_call(d.turn_tokens(k)) for k in d.assistant_turns()]
    assert all(isinstance(c, chat.ToolCall) for c in calls)
    taught = [
      c for k, c in zip(d.assistant_turns(), calls, strict=True) if any(d.loss_mask[slice(*d.spans[k])])
    ]
    assert all(c.name in toy.TOOLS for c in taught) and taught[-1].name == "answer"
    assert eval(d.info["problem"].removeprefix("Compute ")) == int(taught[-1].args[0])
    mistakes = [c for c in calls if c.name not in toy.TOOLS]
    assert len(mistakes) == int(d.info["mistake"])
    for c in mistakes:  # never taught (mask 0)
      k = d.assistant_turns()[calls.index(c)]
      assert not any(d.loss_mask[slice(*d.spans[k])])
    has_hint = any(d.tokens[i : i + len(hint)] == hint for i in range(len(d)))
    assert has_hint == d.info["hinted"]
    n_hinted += has_hint
    n_mistake += d.info["mistake"]
    if d.info["mistake"] and has_hint:  # error observation, then the hint, then a valid call
      text = TOK.decode(d.tokens)
      err = text.index("Error: unknown tool")
      assert err < text.index("Reminder: available tools are add, mul, answer.", err)
    assert all(lp == 0.0 for lp in d.logprobs) and d.reward == 1.0
  assert n_hinted > 20 and n_mistake > 30 and n_hinted < len(demos)


# ---- coding environment ------------------------------------------------------------------------------

needs_sandbox = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap/prlimit not installed")


@pytest.fixture(scope="module")
def task():
  src, venv = fixture_env()
  return tasks.make_tasks(src, venv=venv, max_tasks=1, runs=2)[0]  # runs=2 drops the flaky test


def gold_writes(task):
  paths = [c.path for c in monitor.parse_diff(task.gold_patch)]
  return [("write_file", p, (pathlib.Path(task.repo_dir) / p).read_text()) for p in paths]


@needs_sandbox
def test_coding_gold_rollout_scores_one(task, tmp_path):
  env = coding.CodingEnv(task, tmp_path, coding.CodingConfig(max_output_chars=300))
  writes = gold_writes(task)
  calls = [("list_files",), ("read_file", writes[0][1]), *writes, ("run_tests",), ("submit",)]
  traj = envs.rollout(env, 0, scripted(calls), max_turns=10)
  assert (traj.status, traj.reward, traj.reason) == (chat.COMPLETED, 1.0, ""), (
    env.grade,
    TOK.decode(traj.tokens),
  )
  assert not env.grade.flags and [a.tool for a in env.actions] == [
    "list_files", "read_file", "write_file", "run_tests",
  ]  # fmt: skip
  obs = [TOK.decode(traj.turn_tokens(k)) for k, r in enumerate(traj.turn_roles) if r == chat.TOOL]
  assert writes[0][1] in obs[0] and f"def {task.feature[0].rsplit('.', 1)[1]}" in obs[1]
  assert "passed" in obs[3] and all(len(o) < 300 + 120 for o in obs)  # truncated outputs
  assert feedback.detect(traj, env.info()) == []


@needs_sandbox
def test_coding_untouched_scores_zero_and_errors_are_observations(task, tmp_path):
  env = coding.CodingEnv(task, tmp_path)
  calls = [("bash", "ls"), ("read_file", "no/such.py"), TOK.encode("I am done, fixed."), ("submit",)]
  traj = envs.rollout(env, 1, scripted(calls), max_turns=10)
  assert (traj.status, traj.reward, traj.info["invalid_calls"]) == (chat.COMPLETED, 0.0, 2)
  text = TOK.decode(traj.tokens)
  assert "Error: unknown tool 'bash'. Available tools: list_files, read_file, write_file" in text
  assert "No such file" in text and "Error: no tool call." in text
  kinds = dict(feedback.detect(traj, env.info()))
  assert sorted(kinds.values()) == ["claimed_success", "unknown_tool"]


class _BrokenBox:
  def run(self, *a, **k):
    raise RuntimeError("sandbox exploded")


@needs_sandbox
def test_coding_sandbox_failure_marks_rollout_failed(task, tmp_path):
  env = coding.CodingEnv(task, tmp_path)
  env.box = _BrokenBox()
  traj = envs.rollout(env, 2, scripted([("read_file", "featpkg/mathx.py"), ("submit",)]))
  assert (traj.status, traj.reward) == (chat.FAILED, 0.0)
  assert "RuntimeError: sandbox exploded" in traj.reason


@needs_sandbox
def test_coding_wall_clock_limit(task, tmp_path):
  env = coding.CodingEnv(task, tmp_path, coding.CodingConfig(wall_clock_s=0.0))
  traj = envs.rollout(env, 3, scripted([("list_files",)]))
  assert traj.status == chat.TRUNCATED and "time limit" in traj.reason


class _Exploding(toy.ToyEnv):
  def __init__(self, where):
    super().__init__()
    self.where = where

  def reset(self, seed):
    if self.where == "reset":
      raise OSError("disk full")
    return super().reset(seed)

  def step(self, call):
    if self.where == "step":
      raise ValueError("bad state")
    return super().step(call)

  def reward(self):
    if self.where == "reward":
      raise TimeoutError("grader hung")
    return super().reward()


@pytest.mark.parametrize("where", ["reset", "step", "reward", "act"])
def test_exceptions_inside_rollout_mark_it_failed(where):
  act = scripted(gold_calls(toy.make_problem(5)))

  def broken_act(ctx):
    raise RuntimeError("sampler died")

  traj = envs.rollout(_Exploding(where), 5, broken_act if where == "act" else act)
  assert (traj.status, traj.reward) == (chat.FAILED, 0.0) and traj.reason.startswith(f"{where}: "), (
    traj.reason
  )
  assert envs.rollout(_Exploding("nowhere"), 5, scripted(gold_calls(toy.make_problem(5)))).reward == 1.0
