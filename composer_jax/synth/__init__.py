"""Synthetic coding tasks by feature deletion: sandboxed grading and the reward-hack monitor."""

from composer_jax.synth.monitor import Action, MonitorReport, check
from composer_jax.synth.sandbox import Sandbox, SandboxResult, SandboxUnavailable, available, run, venv_paths

__all__ = [
  "Action",
  "MonitorReport",
  "Sandbox",
  "SandboxResult",
  "SandboxUnavailable",
  "available",
  "check",
  "run",
  "venv_paths",
]
from composer_jax.synth.deletion import Deletion, DeletionRejected, delete_feature, delete_function, statement
from composer_jax.synth.sources import DEFAULT_SOURCES, ChecksumError, Source, fetch, make_venv

__all__ += [
  "DEFAULT_SOURCES",
  "ChecksumError",
  "Deletion",
  "DeletionRejected",
  "Source",
  "delete_feature",
  "delete_function",
  "fetch",
  "make_venv",
  "statement",
]
