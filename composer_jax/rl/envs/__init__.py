"""Tool environments and the rollout driver that turns sampled turns into a `Trajectory`.

Interface every environment implements (`Env`):

  env.reset(seed) -> list[(role, text)]     prompt messages (chat.SYSTEM / chat.USER)
  env.step(call)  -> Step(observation, done, ok)   call: chat.ToolCall or chat.ParseError
  env.reward()    -> float                   once done (or truncated)
  env.info()      -> {"tools": (...), ...}   what feedback hints may restate
  env.max_turns                              assistant turns before the driver truncates

Driving a batch in lockstep (what the RL loop does; `rollout` is the one-sequence version):

  traj = begin(env, seed)                    # prompt tokens, mask 0
  while active: ids, logprobs = <sample from traj.tokens + [<|assistant|>]>, stop at chat.stop_ids()
                done = advance(env, traj, ids, logprobs, max_turns=...)
  finish(env, traj)                          # reward (0 and status "failed" on any exception)

`begin`/`advance`/`finish` never raise: an exception in the environment, the sandbox or the grader marks
that trajectory failed (reward 0, `traj.reason` says why) and the rest of the batch goes on.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Sequence
from typing import Protocol

from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat


@dataclasses.dataclass(frozen=True)
class Step:
  observation: str
  done: bool
  ok: bool = True  # False for an invalid call (unknown tool, malformed, bad arguments)
  truncated: bool = False  # done because a limit (e.g. wall clock) was hit, not by the agent


class Env(Protocol):
  def reset(self, seed: int) -> list[tuple[int, str]]: ...

  def step(self, call: chat.ToolCall | chat.ParseError) -> Step: ...

  def reward(self) -> float: ...

  def info(self) -> dict: ...

  @property
  def max_turns(self) -> int: ...


def _why(e: BaseException) -> str:
  tb = traceback.extract_tb(e.__traceback__)
  where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
  return f"{type(e).__name__}: {str(e)[:300]}{where}"


def begin(env: Env, seed: int, tok: Tokenizer = chat.BYTE_TOKENIZER) -> chat.Trajectory:
  traj = chat.Trajectory(info={"seed": seed, "calls": {}, "invalid_calls": 0, "turns": 0})
  try:
    for role, text in env.reset(seed):
      traj.add_message(role, text, tok)
  except Exception as e:  # noqa: BLE001 -- one bad rollout must not stop the loop
    traj.fail(f"reset: {_why(e)}")
  return traj


def advance(
  env: Env,
  traj: chat.Trajectory,
  ids: Sequence[int],
  logprobs: Sequence[float] | None = None,
  *,
  max_turns: int | None = None,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> bool:
  """Append one sampled assistant turn, execute its call, append the observation. Returns done.

  `max_turns` defaults to `env.max_turns` (8 if the env has none); reaching it marks the trajectory
  truncated."""
  if traj.status == chat.FAILED:
    return True
  max_turns = max_turns or getattr(env, "max_turns", 8)
  try:
    k = traj.add_assistant_turn(ids, logprobs, tok)
    call = chat.parse_tool_call(ids, tok)
    traj.info["calls"][k] = call
    traj.info["turns"] += 1
    step = env.step(call)
    traj.info["invalid_calls"] += int(not step.ok)
    if step.observation:
      traj.add_message(chat.TOOL, step.observation, tok)
    if step.done:
      if step.truncated:
        traj.status, traj.reason = chat.TRUNCATED, step.observation or "env limit"
      return True
    if traj.info["turns"] >= max_turns:
      traj.status, traj.reason = chat.TRUNCATED, f"max_turns {max_turns}"
      return True
    return False
  except Exception as e:  # noqa: BLE001
    traj.fail(f"step: {_why(e)}")
    return True


def finish(env: Env, traj: chat.Trajectory) -> chat.Trajectory:
  if traj.status != chat.FAILED:
    try:
      traj.reward = float(env.reward())
    except Exception as e:  # noqa: BLE001
      traj.fail(f"reward: {_why(e)}")
  return traj


def rollout(
  env: Env,
  seed: int,
  act: Callable[[list[int]], tuple[Sequence[int], Sequence[float] | None]],
  *,
  max_turns: int | None = None,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> chat.Trajectory:
  """One episode; `act(context_ids)` returns the sampled ids (and logprobs) of the next assistant turn,
  given the context ending in the <|assistant|> header. Never raises."""
  traj = begin(env, seed, tok)
  header = chat.role_token_id(chat.ASSISTANT, tok)
  done = traj.status == chat.FAILED
  while not done:
    try:
      ids, logprobs = act(traj.tokens + [header])
    except Exception as e:  # noqa: BLE001
      traj.fail(f"act: {_why(e)}")
      break
    done = advance(env, traj, ids, logprobs, max_turns=max_turns, tok=tok)
  return finish(env, traj)
