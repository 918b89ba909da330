"""Online per-task pass rates of the current policy, and which tasks to train on next.

Why: a GRPO-style group whose rollouts all pass or all fail has zero advantage and
teaches nothing (DAPO dynamic sampling; 2504.03380: intermediate-accuracy batches learn most). So the
pool keeps tasks with 0 < p < 1, retires the solved and the hopeless, and prefers the harder of the rest.

Estimate. A rollout passes when its reward is exactly 1.0 (`credit="binary"`: the reward is all F2P and
P2P passing, partial credit is not success) or contributes its reward (`credit="mean"`). Per task, each
update decays the old counts by `decay` and adds the new group: `weight <- decay*weight + k`,
`passed <- decay*passed + sum(credit)`, `p = passed / weight`; the policy moves, so old groups should
count less. Raw (undecayed) `attempts` and `passes` are kept for retirement and reporting.

Retirement (permanent; later updates are recorded but do not revive a task):
- solved: `attempts >= min_attempts` and `p >= solved_threshold`;
- unsolvable: `attempts >= unsolvable_attempts` and `p <= unsolvable_threshold` (default 0: never passed).

Sampling. Active tasks are drawn without replacement with weight `(1 - p~) ** (1 / temperature)`, where
`p~ = (passed + a) / (weight + a + b)` is `p` smoothed by a Beta(a, b) prior so that a task seen at 0/8
or 8/8 still gets drawn until it retires; unseen tasks get `unseen_weight` (exploration; the default 1.0
is above every seen task's weight, so new tasks are tried first). Deterministic given the Generator.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

STATE_VERSION = 1


@dataclasses.dataclass
class TaskStats:
  attempts: int = 0  # rollouts seen
  passes: float = 0.0  # sum of credit over all rollouts (a count for binary credit)
  weight: float = 0.0  # decayed rollout count
  passed: float = 0.0  # decayed credit

  @property
  def pass_rate(self) -> float | None:
    """Decayed pass rate; None before the first rollout."""
    return self.passed / self.weight if self.weight > 0 else None


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
  credit: str = "binary"  # "binary": reward == 1.0 passes; "mean": the reward itself is the credit
  decay: float = 0.8  # per update of the task; 1.0 = plain cumulative counts
  min_attempts: int = 8
  solved_threshold: float = 0.9
  unsolvable_attempts: int = 32
  unsolvable_threshold: float = 0.0
  temperature: float = 1.0
  unseen_weight: float = 1.0
  prior: tuple[float, float] = (0.5, 0.5)  # Beta(a, b) smoothing for sampling weights only

  def __post_init__(self):
    if self.credit not in ("binary", "mean"):
      raise ValueError(f"credit must be 'binary' or 'mean', not {self.credit!r}")
    if not 0.0 < self.decay <= 1.0:
      raise ValueError(f"decay must be in (0, 1], got {self.decay}")
    if self.temperature <= 0 or self.unseen_weight <= 0 or min(self.prior) <= 0:
      raise ValueError("temperature, unseen_weight and prior must be positive")
    if self.min_attempts < 1 or self.unsolvable_attempts < 1:
      raise ValueError("min_attempts and unsolvable_attempts must be >= 1")


class Curriculum:
  """Pass-rate tracker and sampler over a pool of task instance ids (order of the pool is kept)."""

  def __init__(self, instance_ids: Iterable[str] = (), config: CurriculumConfig | None = None, **kwargs):
    if config is not None and kwargs:
      raise TypeError("pass either config or keyword options, not both")
    self.config = config or CurriculumConfig(**kwargs)
    self._tasks: dict[str, TaskStats] = {}
    self._retired: dict[str, str] = {}
    self.add(instance_ids)

  # ---- pool -------------------------------------------------------------------------------------------

  def add(self, instance_ids: Iterable[str]) -> None:
    """Add new tasks (unseen); an id already in the pool raises ValueError."""
    ids = list(instance_ids)
    for i in ids:
      if not isinstance(i, str) or not i:
        raise ValueError(f"instance ids must be non-empty strings, got {i!r}")
    dup = sorted({i for i, k in collections.Counter(ids).items() if k > 1 or i in self._tasks})
    if dup:
      raise ValueError(f"duplicate instance ids: {dup[:5]}")
    for i in ids:
      self._tasks[i] = TaskStats()

  def __len__(self) -> int:
    return len(self._tasks)

  def __contains__(self, instance_id: str) -> bool:
    return instance_id in self._tasks

  def active(self) -> list[str]:
    return [i for i in self._tasks if i not in self._retired]

  @property
  def retired(self) -> dict[str, str]:
    """instance id -> "solved" | "unsolvable", in retirement order."""
    return dict(self._retired)

  def stats(self, instance_id: str) -> TaskStats:
    return dataclasses.replace(self._get(instance_id))

  def pass_rate(self, instance_id: str) -> float | None:
    return self._get(instance_id).pass_rate

  def _get(self, instance_id: str) -> TaskStats:
    try:
      return self._tasks[instance_id]
    except KeyError:
      raise KeyError(f"unknown instance id {instance_id!r} (pool has {len(self._tasks)} tasks)") from None

  # ---- updates ----------------------------------------------------------------------------------------

  def update(self, instance_id: str, rewards: Sequence[float]) -> str | None:
    """Record one group of rollout rewards in [0, 1]; returns "solved"/"unsolvable" if this retires it."""
    s = self._get(instance_id)
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
      raise ValueError(f"{instance_id}: rewards must be a non-empty 1-D sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)) or r.min() < 0.0 or r.max() > 1.0:
      raise ValueError(f"{instance_id}: rewards must be finite and in [0, 1], got {r.tolist()}")
    credit = (r == 1.0).astype(np.float64) if self.config.credit == "binary" else r
    c = self.config
    s.attempts += int(r.size)
    s.passes += float(credit.sum())
    s.weight = c.decay * s.weight + float(r.size)
    s.passed = c.decay * s.passed + float(credit.sum())
    if instance_id in self._retired:
      return None  # late rollouts of a retired task: recorded, the task stays retired
    p = s.pass_rate
    if s.attempts >= c.min_attempts and p >= c.solved_threshold:
      self._retired[instance_id] = "solved"
    elif s.attempts >= c.unsolvable_attempts and p <= c.unsolvable_threshold:
      self._retired[instance_id] = "unsolvable"
    return self._retired.get(instance_id)

  # ---- sampling ---------------------------------------------------------------------------------------

  def weights(self) -> dict[str, float]:
    """Unnormalised sampling weight of each active task."""
    a, b = self.config.prior
    out = {}
    for i in self.active():
      s = self._tasks[i]
      if s.attempts == 0:
        out[i] = self.config.unseen_weight
      else:
        p = (s.passed + a) / (s.weight + a + b)
        out[i] = (1.0 - p) ** (1.0 / self.config.temperature)
    return out

  def sample(self, n: int, rng: np.random.Generator, *, replace: bool = False) -> list[str]:
    """`n` active instance ids drawn by weight (distinct unless `replace`)."""
    if not isinstance(rng, np.random.Generator):
      raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    if n < 0:
      raise ValueError(f"n must be >= 0, got {n}")
    w = self.weights()
    if not w:
      raise ValueError(
        f"no active tasks to sample: pool has {len(self._tasks)} tasks, {len(self._retired)} retired"
      )
    if n > len(w) and not replace:
      raise ValueError(f"cannot draw {n} distinct tasks from {len(w)} active ones (pass replace=True)")
    ids, p = list(w), np.array(list(w.values()), dtype=np.float64)
    idx = rng.choice(len(ids), size=n, replace=replace, p=p / p.sum())
    return [ids[k] for k in idx]

  # ---- state ------------------------------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable; floats round-trip exactly through `json`, so a restored curriculum samples alike."""
    cfg = dataclasses.asdict(self.config)
    cfg["prior"] = list(cfg["prior"])
    return {
      "version": STATE_VERSION,
      "config": cfg,
      "tasks": {i: dataclasses.asdict(s) for i, s in self._tasks.items()},
      "retired": dict(self._retired),
    }

  @classmethod
  def from_state_dict(cls, state: dict[str, Any]) -> Curriculum:
    if state.get("version") != STATE_VERSION:
      raise ValueError(f"curriculum state version {state.get('version')!r}, expected {STATE_VERSION}")
    cfg = dict(state["config"])
    cfg["prior"] = tuple(cfg["prior"])
    cur = cls(config=CurriculumConfig(**cfg))
    for i, s in state["tasks"].items():
      stats = TaskStats(**s)
      if stats.attempts < 0 or stats.weight < 0 or not all(map(math.isfinite, (stats.passes, stats.passed))):
        raise ValueError(f"corrupt stats for {i!r}: {s}")
      cur._tasks[i] = stats
    unknown = [i for i in state["retired"] if i not in cur._tasks]
    if unknown:
      raise ValueError(f"retired ids not in the pool: {unknown[:5]}")
    cur._retired = dict(state["retired"])
    return cur

  def save(self, path: str | os.PathLike) -> None:
    """Atomic: write a temp file in the same directory, fsync, then `os.replace` over `path`."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".curriculum.", suffix=".tmp", dir=directory)
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(self.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    except BaseException:
      if os.path.exists(tmp):
        os.unlink(tmp)
      raise

  @classmethod
  def load(cls, path: str | os.PathLike) -> Curriculum:
    with open(path, encoding="utf-8") as f:
      return cls.from_state_dict(json.load(f))
