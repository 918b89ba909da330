"""Feedback detectors fire on constructed bad turns, not on good ones; teacher inputs align token by token."""

import numpy as np
import pytest

from composer_jax.rl import chat, feedback
from composer_jax.rl.envs import coding, toy

TOK = chat.BYTE_TOKENIZER
TOY, CODE = toy.ToyEnv().info(), {"tools": coding.TOOLS}


def _traj(turns):
  """turns: ("user", text) | ("tool", text) | (prose, call tuple or None) for an assistant turn."""
  t = chat.Trajectory()
  for a, b in turns:
    if a == "user":
      t.add_message(chat.USER, b)
    elif a == "tool":
      t.add_message(chat.TOOL, b)
    else:
      t.add_assistant_turn(chat.assistant_ids(a, b))
  return t


def test_good_toy_rollout_has_no_detections():
  t = _traj([("user", "Compute 3+4"), ("", ("add", "3", "4")), ("tool", "7"), ("", ("answer", "7"))])
  assert feedback.detect(t, TOY) == []


def test_unknown_malformed_and_repeated():
  t = _traj(
    [
      ("user", "Compute 3+4"),
      ("", ("sum", "3", "4")),  # turn 1
      ("tool", toy.observe(chat.ToolCall("sum", ("3", "4")))[0]),
      ("", ("add", "3", "x")),  # turn 3: valid tool, bad args -> failing observation
      ("tool", toy.observe(chat.ToolCall("add", ("3", "x")))[0]),
      ("", ("add", "3", "x")),  # turn 5: the same failing call again
      ("tool", "Error: add takes 2 integer arguments."),
    ]
  )
  t.add_assistant_turn(TOK.encode("add 3 4") + [TOK.special_id("<|/tool_call|>")])  # turn 7: malformed
  t.add_assistant_turn(chat.assistant_ids("thinking"))  # turn 8: no call (off by default)
  assert feedback.detect(t, TOY) == [(1, "unknown_tool"), (5, "repeated_failure"), (7, "malformed_call")]
  rules = feedback.FeedbackRules(kinds=feedback.KINDS)
  assert feedback.detect(t, TOY, rules)[-1] == (8, "no_call")


def test_claimed_success_needs_test_run():
  claim = [("user", "Fix it"), ("All tests pass, fixed.", ("submit",))]
  assert feedback.detect(_traj(claim), CODE) == [(1, "claimed_success")]
  ran = [("user", "Fix it"), ("", ("run_tests",)), ("tool", "3 passed"), ("All tests pass.", ("submit",))]
  assert feedback.detect(_traj(ran), CODE) == []
  toy_claim = [("user", "Compute 3+4"), ("Done, fixed.", ("answer", "7"))]
  assert feedback.detect(_traj(toy_claim), TOY) == []  # no run_tests tool in the toy env


def test_over_long_explanation():
  rules = feedback.FeedbackRules(max_prose_tokens=20)
  short = _traj([("user", "Fix"), ("Reading the file.", ("read_file", "a.py"))])
  long = _traj([("user", "Fix"), ("Let me explain at length " * 3, ("read_file", "a.py"))])
  assert feedback.detect(short, CODE, rules) == []
  assert feedback.detect(long, CODE, rules) == [(1, "over_long")]
  # The body of a call is not prose.
  big_write = _traj([("user", "Fix"), ("", ("write_file", "a.py", "x = 1\n" * 50))])
  assert feedback.detect(big_write, CODE, rules) == []


def test_hints():
  assert feedback.hint_for("unknown_tool", TOY) == "Reminder: available tools are add, mul, answer."
  assert "add 3 4" in feedback.hint_for("malformed_call", TOY)
  assert "run_tests" in feedback.hint_for("claimed_success", CODE)
  rules = feedback.FeedbackRules(hints=(("over_long", "Be brief. Tools: {tools}"),))
  assert feedback.hint_for("over_long", TOY, rules) == "Be brief. Tools: add, mul, answer"
  for kind in feedback.KINDS:
    assert feedback.hint_for(kind, CODE)
  ids = feedback.hint_ids("Reminder: x")
  assert ids[0] == TOK.special_id("<|user|>") and ids[-1] == TOK.special_id("<|end_turn|>")


def test_teacher_inputs_alignment():
  t = _traj(
    [
      ("user", "Compute (1+2)*3"),
      ("", ("add", "1", "2")),
      ("tool", "3"),
      ("why not ", ("sum", "3", "3")),  # turn 3
      ("tool", "Error: unknown tool 'sum'. Available tools: add, mul, answer."),
      ("", ("mul", "3", "3")),
    ]
  )
  k = 3
  hint = feedback.hint_ids(feedback.hint_for("unknown_tool", TOY))
  ti = feedback.teacher_inputs(t, k, hint)
  s, e = t.spans[k]
  student = np.array(t.tokens)
  # Prefix identical, hint right before turn k's header, then turn k's tokens, nothing after.
  np.testing.assert_array_equal(ti.tokens[:s], student[:s])
  np.testing.assert_array_equal(ti.tokens[ti.hint_start : ti.hint_end], hint)
  assert (ti.hint_start, ti.hint_end) == (s, s + len(hint)) and len(ti.tokens) == s + len(hint) + (e - s)
  assert ti.tokens[ti.hint_end] == TOK.special_id("<|assistant|>")
  # The aligned positions hold identical tokens, exactly the sampled tokens of turn k.
  np.testing.assert_array_equal(ti.tokens[ti.teacher_positions], student[ti.student_positions])
  np.testing.assert_array_equal(student[ti.student_positions], t.sampled_tokens(k))
  assert all(t.turn_ids[p] == k and t.loss_mask[p] for p in ti.student_positions)
  # Without a hint the teacher sequence is the student's prefix through turn k.
  same = feedback.teacher_inputs(t, k, [])
  np.testing.assert_array_equal(same.tokens, student[:e])
  np.testing.assert_array_equal(same.teacher_positions, same.student_positions)


def test_coding_mistakes_edit_tests_and_claimed_success():
  """The coding env's own mistakes go through the same detector -> hint path (kinds it does not declare:
  the default set, which includes edits_tests)."""
  edit = _traj([("user", "Fix"), ("", ("write_file", "tests/test_mathx.py", "def test_x():\n  pass\n"))])
  assert feedback.detect(edit, CODE) == [(1, "edits_tests")]
  for path in ("pkg/test_util.py", "conftest.py", "a/b_test.py", "test/x.py"):
    assert feedback.detect(_traj([("user", "Fix"), ("", ("write_file", path, "x = 1\n"))]), CODE), path
  code = _traj(
    [("user", "Fix"), ("", ("write_file", "pkg/mathx.py", "x = 1\n")), ("tool", "Wrote 6 characters")]
  )
  assert feedback.detect(code, CODE) == []
  assert "do not edit the tests" in feedback.hint_for("edits_tests", CODE)
  bash = _traj([("user", "Fix"), ("", ("bash", "ls"))])
  assert feedback.detect(bash, CODE) == [(1, "unknown_tool")]


def test_env_declared_kinds_and_rule_override():
  t = _traj([("user", "Compute 3+4"), ("", ("sum", "3", "4")), ("tool", "Error: unknown tool 'sum'.")])
  stale_info = {
    "tools": ("add", "mul", "answer"),
    "renamed": (("sum", "add"),),
    "feedback_kinds": ("stale_tool",),
  }
  assert feedback.detect(t, stale_info) == [(1, "stale_tool")]
  assert feedback.detect(t, TOY) == [(1, "unknown_tool")]  # no rename rule: an unknown tool
  only_unknown = feedback.FeedbackRules(kinds=("unknown_tool",))
  assert feedback.detect(t, stale_info, only_unknown) == [(1, "unknown_tool")]
  assert feedback.hint_at(t, 1, "stale_tool", stale_info) == "Note: the tool sum was renamed to add."
  with pytest.raises(ValueError, match="variant"):
    feedback.hint_for("stale_tool", stale_info, variant="bogus")
