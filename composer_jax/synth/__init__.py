"""Synthetic coding tasks by feature deletion: sources, deletion, validation, sandboxed grading,
the reward-hack monitor and the curriculum.

from composer_jax import synth
tasks = synth.make_tasks(source_dir, mode="stub", max_tasks=4)
synth.checkout(tasks[0], "work/task0")          # the agent-visible working copy
result = synth.grade(tasks[0], "work/task0")    # reward, passed, failed, flags

The TFDS task dataset lives in `composer_jax.synth.dataset` (imported on use: it loads tfds).
"""

from composer_jax.synth.baseline import Baseline, run_baseline
from composer_jax.synth.curriculum import Curriculum, CurriculumConfig
from composer_jax.synth.deletion import Deletion, DeletionRejected, delete_feature, delete_function, statement
from composer_jax.synth.features import Feature, find_features
from composer_jax.synth.monitor import Action, MonitorReport, check
from composer_jax.synth.sandbox import Sandbox, SandboxResult, SandboxUnavailable, available, run, venv_paths
from composer_jax.synth.scrub import leak_scan, scrub_residues
from composer_jax.synth.sources import DEFAULT_SOURCES, ChecksumError, Source, fetch, make_venv
from composer_jax.synth.tasks import Grade, Task, checkout, grade, make_tasks
from composer_jax.synth.validate import Validation

__all__ = [
  "DEFAULT_SOURCES",
  "Action",
  "Baseline",
  "ChecksumError",
  "Curriculum",
  "CurriculumConfig",
  "Deletion",
  "DeletionRejected",
  "Feature",
  "Grade",
  "MonitorReport",
  "Sandbox",
  "SandboxResult",
  "SandboxUnavailable",
  "Source",
  "Task",
  "Validation",
  "available",
  "check",
  "checkout",
  "delete_feature",
  "delete_function",
  "fetch",
  "find_features",
  "grade",
  "leak_scan",
  "make_tasks",
  "make_venv",
  "run",
  "run_baseline",
  "scrub_residues",
  "statement",
  "venv_paths",
]
