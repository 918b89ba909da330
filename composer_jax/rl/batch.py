"""Trajectories → the padded arrays of one RL step, with the teacher's inputs for flagged turns.

Shape suffixes: B batch (rollouts), T time (trajectory tokens), F flagged rows, L teacher tokens
(hint + turn), N tokens of the flagged turn.

  batch = rl_batch(trajs, group_ids, infos, with_feedback=True, rules=rules)   # an RLBatch
  batch = rl_batch(trajs, group_ids, infos, with_penalty=True, rules=rules)    # + flagged tokens [B, T]

Shapes are bucketed to powers of two (`bucket`), so a run compiles a handful of step programs, or padded
to multiples of `rl.batch_multiple` (`padded_length`). A batch
without flagged turns has `feedback=None`: another tree structure, so the same jitted step compiles a
program without the teacher for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import struct

from composer_jax.configs import RLConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat, feedback

_RULES = feedback.FeedbackRules()


@struct.dataclass
class FeedbackBatch:
  """The teacher's inputs for the flagged rows (see `feedback_arrays`)."""

  fb_rows: Any  # int32 [F]: the batch row each teacher row belongs to (padding rows: 0)
  teacher_tokens: Any  # int32 [F, L]: hint + turn k, right-padded
  teacher_lengths: Any  # int32 [F]: 0 for padding rows
  hint_start: Any  # int32 [F]: student slots at positions ≥ it are hidden from the teacher
  fb_cols: Any  # int32 [F, N]: student column t = p - 1 of each sampled token p of turn k
  teacher_cols: Any  # int32 [F, N]: the teacher extension's column aligned with it
  fb_mask: Any  # float32 [F, N]


@struct.dataclass
class RLBatch:
  """One RL step's trajectories, padded to [B, T]."""

  tokens: Any  # int32 [B, T]
  positions: Any  # int32 [B, T]
  segment_ids: Any  # int32 [B, T]
  loss_mask: Any  # float32 [B, T]: 1 on the model's sampled tokens
  sampler_logprobs: Any  # float32 [B, T]: the sampler's log π of those tokens
  rewards: Any  # float32 [B]
  group_ids: Any  # int32 [B]
  routed_experts: Any = None  # int16 [B, T, MoE layers, top_k] (routing replay), -1 where unknown
  feedback: FeedbackBatch | None = None  # the teacher's inputs; None: no flagged turn (or λ = 0)
  flagged: Any = None  # float32 [B, T]: 1 on the first flagged turn's sampled tokens (arm "penalty")
  # Whole-batch terms (`rl.loss.whole_batch_terms`), set inside the step before it splits the batch:
  advantages: Any = None  # float32 [B]: group-relative advantages (groups may span micro-batches)
  keep: Any = None  # float32 [B]: 1 for the rollouts in the policy loss
  # The update runs in this many micro-batches, row p in micro-batch p % n (`micro_batched`); the teacher
  # rows' fb_rows are then rows of their micro-batch. Static: each count is its own program.
  micro_batches: int = struct.field(pytree_node=False, default=1)


def bucket(n: int, minimum: int) -> int:
  """The smallest power of two ≥ max(n, minimum): a handful of shapes, so a handful of compilations."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def padded_length(n: int, minimum: int, multiple: int = 0) -> int:
  """A batch's padded length for its longest rollout of `n` tokens: `bucket(n, minimum)`, or with
  `multiple` > 0 the smallest multiple of it ≥ max(n, minimum) (at most multiple − 1 padded columns per row
  instead of up to n − 1, at the cost of one compiled program per multiple reached)."""
  if multiple <= 0:
    return bucket(n, minimum)
  return max(minimum, -(-n // multiple) * multiple)


def feedback_rules(rcfg: RLConfig) -> feedback.FeedbackRules:
  """The detectors to act on: `rcfg.feedback_kinds` (comma-separated), or the environment's own."""
  kinds = tuple(k for k in rcfg.feedback_kinds.split(",") if k)
  return feedback.FeedbackRules(kinds=kinds) if kinds else _RULES


def without_feedback(batch: RLBatch) -> RLBatch:
  """The batch for the step without the teacher (λ = 0, or no turn was flagged)."""
  return batch.replace(feedback=None)


def feedback_arrays(
  trajs: Sequence[chat.Trajectory],
  infos: Sequence[dict],
  pad_to: int,
  rules: feedback.FeedbackRules = _RULES,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
  *,
  variant: str = "task",
  rows_cap: int = 0,
) -> FeedbackBatch:
  """Teacher inputs for the flagged rows only: F = bucket(#flagged, 16) teacher rows, padding rows empty;
  with `rows_cap` > 0 exactly F = rows_cap (flagged rows beyond it are left out, the first ones kept), so
  the step compiles once per sequence bucket (each compilation costs ~30 s on 2 cores).

  fb_rows [F] (the batch row each teacher row belongs to; padding: 0), teacher_tokens [F, L] (hint +
  turn k, right-padded), teacher_lengths [F] (0: padding), hint_start [F] (student slots ≥ it are hidden
  from the teacher; `pad_to` hides nothing), fb_cols [F, N] (student column t = p - 1 of each sampled
  token p of turn k), teacher_cols [F, N] (the extension column aligned with it), fb_mask [F, N].
  The teacher and the divergence then cost F·(L + N) positions instead of B·T. `variant`: the hint
  inserted (`feedback.hint_for`: "task", or "null" for the null-hint control arm).
  """
  rows = []
  for b, (traj, info) in enumerate(zip(trajs, infos, strict=True)):
    found = feedback.detect(traj, info, rules, tok) if traj.status != chat.FAILED else []
    if not found:
      continue
    k, kind = found[0]
    text = feedback.hint_at(traj, k, kind, info, rules, variant=variant, tok=tok)
    t = feedback.teacher_inputs(traj, k, feedback.hint_ids(text, tok))
    if len(t.student_positions):
      rows.append((b, t))
  # Few shapes, few compilations: F fixed (or from 16), L from 64 (a hint and one turn).
  rows = rows[:rows_cap] if rows_cap else rows
  F = rows_cap or bucket(len(rows), 16)
  L = bucket(max([len(t.tokens) - t.hint_start for _, t in rows], default=1), 64)
  N = bucket(max([len(t.student_positions) for _, t in rows], default=1), 16)
  out = {
    "fb_rows": np.zeros((F,), np.int32),
    "teacher_tokens": np.zeros((F, L), np.int32),
    "teacher_lengths": np.zeros((F,), np.int32),
    "hint_start": np.full((F,), pad_to, np.int32),
    "fb_cols": np.zeros((F, N), np.int32),
    "teacher_cols": np.zeros((F, N), np.int32),
    "fb_mask": np.zeros((F, N), np.float32),
  }
  for f, (b, t) in enumerate(rows):
    ext = t.tokens[t.hint_start :]
    n = len(t.student_positions)
    out["fb_rows"][f] = b
    out["teacher_tokens"][f, : len(ext)] = ext
    out["teacher_lengths"][f] = len(ext)
    out["hint_start"][f] = t.hint_start
    out["fb_cols"][f, :n] = t.student_positions - 1
    out["teacher_cols"][f, :n] = t.teacher_positions - 1 - t.hint_start
    out["fb_mask"][f, :n] = 1.0
  return FeedbackBatch(**out)


def first_flagged(
  trajs: Sequence[chat.Trajectory],
  infos: Sequence[dict],
  rules: feedback.FeedbackRules = _RULES,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> list[int | None]:
  """Each trajectory's first turn the detectors flag (None: none), the turn the teacher would correct."""
  out = []
  for traj, info in zip(trajs, infos, strict=True):
    found = feedback.detect(traj, info, rules, tok) if traj.status != chat.FAILED else []
    out.append(found[0][0] if found else None)
  return out


def flagged_tokens(trajs: Sequence[chat.Trajectory], turns: Sequence[int | None], pad_to: int) -> np.ndarray:
  """float32 [B, pad_to]: 1 on the sampled tokens (loss mask 1) of each row's flagged turn, else 0."""
  out = np.zeros((len(trajs), pad_to), np.float32)
  for b, (traj, k) in enumerate(zip(trajs, turns, strict=True)):
    if k is not None:
      s, e = traj.spans[k]
      out[b, s:e] = traj.loss_mask[s:e]
  return out


def rl_batch(
  trajs: Sequence[chat.Trajectory],
  group_ids: Sequence[int],
  infos: Sequence[dict] | None = None,
  *,
  with_feedback: bool = False,
  with_penalty: bool = False,
  rules: feedback.FeedbackRules = _RULES,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
  variant: str = "task",
  rows_cap: int = 0,
  min_len: int = 64,
  multiple: int = 0,
) -> RLBatch:
  """`chat.to_arrays` (padded to a power of two, at least `min_len`, or to a multiple of `multiple`:
  `padded_length`) + group ids (+ `feedback_arrays`, + `flagged_tokens` of the first flagged turns with
  `with_penalty`).

  Trajectories that carry `routed_experts` (collected with routing_replay) add routed_experts
  [B, T, MoE layers, top_k] int16, -1 on padding and wherever unknown (the forward routes those itself).
  """
  pad_to = padded_length(max(len(t) for t in trajs), min_len, multiple)
  a = chat.to_arrays(trajs, pad_to, tok.pad_id)
  keys = ("tokens", "positions", "segment_ids", "loss_mask", "sampler_logprobs", "rewards")
  batch = RLBatch(**{k: a[k] for k in keys}, group_ids=np.asarray(group_ids, np.int32))
  recorded = [t.routed_experts for t in trajs if t.routed_experts is not None]
  if recorded:
    routed_BTLK = np.full((len(trajs), pad_to, *recorded[0].shape[1:]), -1, np.int16)
    for b, t in enumerate(trajs):
      if t.routed_experts is not None:
        routed_BTLK[b, : len(t.routed_experts)] = t.routed_experts
    batch = batch.replace(routed_experts=routed_BTLK)
  if with_feedback:
    fb = feedback_arrays(trajs, infos, pad_to, rules, tok, variant=variant, rows_cap=rows_cap)
    batch = batch.replace(feedback=fb)
  if with_penalty:
    turns = first_flagged(trajs, infos, rules, tok)
    batch = batch.replace(flagged=flagged_tokens(trajs, turns, pad_to))
  return batch


def micro_rows(rows: int, length: int, update_tokens: int, multiple: int = 1) -> int:
  """Rollouts per micro-batch of an update of `rows` rollouts padded to `length` tokens under a budget of
  `update_tokens` tokens per micro-batch (0: no budget, one pass): the most that fit and divide `rows`,
  preferring multiples of `multiple` (the devices the batch is split over). At least one rollout."""
  if update_tokens <= 0 or rows * length <= update_tokens:
    return rows
  fits = [r for r in range(1, rows + 1) if rows % r == 0 and r * length <= update_tokens]
  aligned = [r for r in fits if r % multiple == 0]
  return max(aligned or fits or [1])


def micro_batched(batch: RLBatch, n: int) -> RLBatch:
  """The batch arranged for an update in `n` micro-batches (the step takes row p into micro-batch p % n):
  rows permuted so that the rows with a teacher row come first (spread round-robin over the micro-batches),
  each teacher row's `fb_rows` renumbered within its micro-batch, and the teacher rows padded to n·⌈F/n⌉
  so every micro-batch has the same number. The loss is a sum over rows with whole-batch advantages
  (`rl.loss.whole_batch_terms`), so the order of rows changes it only by float order."""
  if n <= 1:
    return batch
  B = batch.tokens.shape[0]
  if B % n:
    raise ValueError(f"{B} rollouts do not split into {n} micro-batches")
  fb = batch.feedback
  kept = np.zeros(0, np.int64) if fb is None else np.flatnonzero(np.asarray(fb.teacher_lengths) > 0)
  first = np.zeros(0, np.int64) if fb is None else np.asarray(fb.fb_rows)[kept]  # their batch rows, in order
  order = np.concatenate([first, np.setdiff1d(np.arange(B), first)])
  rows_leading = {k for k, v in vars(batch).items() if k != "feedback" and v is not None and np.ndim(v) >= 1}
  out = batch.replace(**{k: np.asarray(getattr(batch, k))[order] for k in rows_leading}, micro_batches=n)
  if fb is None:
    return out
  k, slots = len(kept), n * -(-max(int(fb.fb_rows.shape[0]), len(kept)) // n)
  # Padding teacher rows: empty, and hiding nothing from the teacher (hint_start at the padded length).
  fills = {"hint_start": int(batch.tokens.shape[1])}

  def padded(name: str) -> np.ndarray:
    x = np.asarray(getattr(fb, name))
    new = np.full((slots, *x.shape[1:]), fills.get(name, 0), x.dtype)
    new[:k] = x[kept]
    return new

  fb_rows = np.zeros(slots, np.int32)
  fb_rows[:k] = np.arange(k) // n  # teacher row q sits in micro-batch q % n, at its row q // n
  teacher = {name: padded(name) for name in vars(fb) if name != "fb_rows"}
  return out.replace(feedback=fb.replace(**teacher, fb_rows=fb_rows))


def synthetic_batch(rows: int, length: int, flagged: int, seed: int = 0) -> RLBatch:
  """Made-up rollouts of the RL step's shapes, for memory and speed checks that must not depend on what a
  policy writes: `rows` rollouts of 75-100 % of `length` tokens (the padded length), the model's tokens in
  their second half, groups of 8, rewards 0 or 1, and `flagged` of them (evenly spaced) with a teacher row
  (a 40-token hint + turn, 16 of the turn's tokens aligned with the student's from the middle)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3 * length // 4, length + 1, rows)
  live = np.arange(length)[None] < lengths[:, None]
  n, big_l, start = 16, 64, length // 2
  fb = FeedbackBatch(
    fb_rows=(np.arange(flagged) * (rows // max(flagged, 1))).astype(np.int32),
    teacher_tokens=rng.integers(1, 256, (flagged, big_l)).astype(np.int32),
    teacher_lengths=np.full((flagged,), 40, np.int32),
    hint_start=np.full((flagged,), start, np.int32),
    fb_cols=(start + np.arange(n))[None].repeat(flagged, 0).astype(np.int32),
    teacher_cols=(24 + np.arange(n))[None].repeat(flagged, 0).astype(np.int32),
    fb_mask=np.ones((flagged, n), np.float32),
  )
  return RLBatch(
    tokens=np.where(live, rng.integers(1, 256, (rows, length)), 0).astype(np.int32),
    positions=np.where(live, np.arange(length)[None], 0).astype(np.int32),
    segment_ids=live.astype(np.int32),
    loss_mask=(live & (np.arange(length)[None] >= start)).astype(np.float32),
    sampler_logprobs=np.full((rows, length), -1.0, np.float32),
    rewards=rng.choice([0.0, 1.0], rows).astype(np.float32),
    group_ids=(np.arange(rows) // 8).astype(np.int32),
    feedback=fb if flagged else None,
  )
