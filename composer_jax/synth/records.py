"""The task record and the grade: plain data shared by building (tasks.py) and grading (grading.py)."""

import dataclasses
import json
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class Task:
  instance_id: str
  source: dict  # name, version, sha256
  feature: tuple[str, ...]  # deleted qualified names, target first
  mode: str  # "stub" | "remove"
  patch: str  # pristine -> agent view
  gold_patch: str  # agent view -> pristine (non-test files)
  fail_to_pass: tuple[str, ...]
  pass_to_pass: tuple[str, ...]
  hidden_tests: tuple[str, ...]  # repo-relative test files hidden during the episode
  statement: str
  created_at: str  # ISO 8601 UTC
  repo_dir: str  # pristine source tree
  venv: str
  test_files: dict  # path -> pristine content of the hidden test files

  def to_record(self) -> dict:
    return {
      "instance_id": self.instance_id,
      "source": {k: str(self.source.get(k) or "") for k in ("name", "version", "sha256")},
      "feature": list(self.feature),
      "mode": self.mode,
      "patch": self.patch,
      "gold_patch": self.gold_patch,
      "FAIL_TO_PASS": list(self.fail_to_pass),
      "PASS_TO_PASS": list(self.pass_to_pass),
      "hidden_tests": list(self.hidden_tests),
      "statement": self.statement,
      "created_at": self.created_at,
      "repo_dir": self.repo_dir,
      "venv": self.venv,
      "test_files_json": json.dumps(self.test_files, sort_keys=True),
    }

  @classmethod
  def from_record(cls, d: Mapping) -> "Task":
    def strs(x: Iterable) -> tuple[str, ...]:
      return tuple(v.decode() if isinstance(v, bytes) else str(v) for v in x)

    def s(x) -> str:
      return x.decode() if isinstance(x, bytes) else str(x)

    return cls(
      instance_id=s(d["instance_id"]),
      source={k: s(v) for k, v in dict(d["source"]).items()},
      feature=strs(d["feature"]),
      mode=s(d["mode"]),
      patch=s(d["patch"]),
      gold_patch=s(d["gold_patch"]),
      fail_to_pass=strs(d["FAIL_TO_PASS"]),
      pass_to_pass=strs(d["PASS_TO_PASS"]),
      hidden_tests=strs(d["hidden_tests"]),
      statement=s(d["statement"]),
      created_at=s(d["created_at"]),
      repo_dir=s(d["repo_dir"]),
      venv=s(d["venv"]),
      test_files=json.loads(s(d["test_files_json"])),
    )


@dataclasses.dataclass(frozen=True)
class Grade:
  reward: float  # in [0, 1]: F2P pass fraction; 0 if any P2P fails or any flag
  passed: tuple[str, ...]
  failed: tuple[str, ...]
  flags: tuple[str, ...]


def removed_lines(patch: str) -> str:
  """The lines a unified diff removes (for a task's patch: the deleted original code)."""
  return "\n".join(ln[1:] for ln in patch.splitlines() if ln.startswith("-") and not ln.startswith("---"))
