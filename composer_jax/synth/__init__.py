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
