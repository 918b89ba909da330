"""One line describing the machine a benchmark ran on, for the dated sections of RESULTS.md."""

from __future__ import annotations

import os
import platform
import subprocess

import jax


def describe() -> str:
  """CPU model (lscpu), cores, memory, and the XLA platform of device 0."""
  model_name = platform.processor() or "unknown CPU"
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    model_name = next(
      line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
    )
  except (OSError, subprocess.CalledProcessError, StopIteration):
    pass
  mem = ""
  try:
    mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
  except (ValueError, OSError):
    pass
  return f"{model_name}, {os.cpu_count()} cores{mem}; one XLA:{jax.devices()[0].platform.upper()} device"
