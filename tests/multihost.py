"""A multi-host run on one machine: N processes × M CPU devices on localhost through `jax.distributed`
(gloo collectives over TCP), for tests of what must hold on many hosts.

  outs = multihost.run_function("tests.multihost:psum_probe", n_processes=2, devices=2)   # one per process
  procs = multihost.launch(["run.py", ...], n_processes=2)   # any script that calls jax.distributed itself

`run_function` starts each process on this module's `_main`, which sets the device count, initialises
`jax.distributed` and calls `module:function(*args)`; its JSON-able return comes back per process.
`launch` starts a command with the environment run.py reads (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID) and returns the Popen objects. Each process is a fresh interpreter (jax's backend cannot
be re-initialised in the pytest process), so every call pays imports and compiles once per process.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
_RESULT = "MULTIHOST_RESULT "


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def environment(port: int, n_processes: int, process_id: int, extra: dict | None = None) -> dict:
  """The variables run.py (and `_main`) read to join the run as process `process_id` of `n_processes`."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the device count is set per process
  env |= dict(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COORDINATOR_ADDRESS=f"localhost:{port}")
  env |= dict(JAX_NUM_PROCESSES=str(n_processes), JAX_PROCESS_ID=str(process_id))
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
  return env | (extra or {})


def launch(
  argv: list[str], n_processes: int, extra_env: dict | None = None, logs: pathlib.Path | None = None
) -> list[subprocess.Popen]:
  """Starts `python <argv>` once per process (cwd: the repository), joined through one coordinator;
  output to pipes, or with `logs` to `<logs>/process_<i>.log` (stdout and stderr: readable while it runs)."""
  port = free_port()
  procs = []
  for i in range(n_processes):
    out = open(logs / f"process_{i}.log", "w") if logs else subprocess.PIPE  # noqa: SIM115 (the child's)
    procs.append(
      subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=environment(port, n_processes, i, extra_env),
        stdout=out,
        stderr=subprocess.STDOUT if logs else subprocess.PIPE,
        text=True,
      )
    )
    if logs:
      out.close()  # the child holds its own descriptor
  return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
  """Waits for every process (killing all when one overruns), returns their outputs."""
  out = []
  try:
    for p in procs:
      stdout, stderr = p.communicate(timeout=timeout)
      out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    tails = [f"process {i}:\n{(p.communicate()[1] or '')[-2000:]}" for i, p in enumerate(procs)]
    raise TimeoutError(f"not done after {timeout}s (a hang?)\n" + "\n".join(tails)) from None
  return out


def run_function(
  target: str, n_processes: int, devices: int, args: tuple = (), timeout: float = 300
) -> list[Any]:
  """`module:function(*args)` in each of `n_processes` processes with `devices` CPU devices each; the
  returns, in process order. A process that fails raises with its stderr's tail."""
  spec = json.dumps(dict(target=target, devices=devices, args=list(args)))
  done = wait_all(launch([__file__, spec], n_processes), timeout)
  results = []
  for i, p in enumerate(done):
    lines = [line for line in p.stdout.splitlines() if line.startswith(_RESULT)]
    if p.returncode != 0 or not lines:
      raise RuntimeError(f"process {i} of {n_processes} ended with {p.returncode}:\n{p.stderr[-4000:]}")
    results.append(json.loads(lines[-1][len(_RESULT) :]))
  return results


def initialize(devices: int) -> None:
  """This process's share of the run: `devices` CPU devices, then `jax.distributed.initialize` from the
  environment `launch` set (before anything touches a backend)."""
  import jax

  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
    num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
    process_id=int(os.environ["JAX_PROCESS_ID"]),
  )


def psum_probe() -> dict:
  """Device i of process k contributes k·M + i + 1 to a sum over all processes' devices: N·M(N·M + 1)/2."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec

  mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  m = jax.local_device_count()
  local = np.arange(1, m + 1, dtype=np.float32) + jax.process_index() * m
  x = multihost_utils.host_local_array_to_global_array(local, mesh, PartitionSpec("d"))
  total = jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
  return dict(
    process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(), sum=float(total)
  )


def _main(spec: str) -> None:
  import importlib

  s = json.loads(spec)
  initialize(s["devices"])
  module, function = s["target"].split(":")
  result = getattr(importlib.import_module(module), function)(*s["args"])
  print(_RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
  _main(sys.argv[1])
