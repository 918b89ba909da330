"""Entry point: flags → config → `pipeline.run`. Launch commands: experiments/composer25.py."""

import importlib.metadata
import importlib.util
import math
import os

import jax
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", "experiments/composer25.py", "Experiment file, optionally `:variant`.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Outputs; default: config.workdir, else runs/<variant>.")
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed",
  None,
  "Multi-process: jax.distributed.initialize() before anything touches a device (docs/cluster.md). "
  "Default: on when JAX_COORDINATOR_ADDRESS is set.",
)


def _cpu_only() -> bool:
  """True when jax will run on CPU: JAX_PLATFORMS=cpu, or unset with no GPU/TPU plugin installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms == "cpu"
  plugins = importlib.util.find_spec("jax_plugins") or importlib.metadata.entry_points(group="jax_plugins")
  return not (plugins or importlib.util.find_spec("libtpu"))


def _initialize_distributed() -> int | None:
  """`jax.distributed.initialize()`; returns the process count when it is known without a backend.

  JAX_NUM_PROCESSES and JAX_PROCESS_ID, when set, are passed on (jax itself reads only
  JAX_COORDINATOR_ADDRESS): a hand-made launch, e.g. several CPU processes on one machine. Otherwise
  jax detects the cluster (Cloud TPU, SLURM, Open MPI, Kubernetes) and fills in what is unset.
  """
  if "JAX_NUM_PROCESSES" in os.environ:
    n = int(os.environ["JAX_NUM_PROCESSES"])
    jax.distributed.initialize(num_processes=n, process_id=int(os.environ["JAX_PROCESS_ID"]))
    return n
  jax.distributed.initialize()
  return None


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:  # orbax/tfds log every file operation at INFO
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  cpu = _cpu_only()
  if cpu:
    jax.config.update("jax_platforms", "cpu")  # skips probing for a TPU.
  distributed = _DISTRIBUTED.value
  if distributed is None:
    distributed = "JAX_COORDINATOR_ADDRESS" in os.environ
  n_processes = _initialize_distributed() if distributed else 1  # before any backend exists
  if cpu:
    # One CPU device per mesh position, as tests/conftest.py does (split over the processes of a
    # multi-process CPU run); must precede backend init.
    if n_processes is None or math.prod(config.mesh.dense) % n_processes:
      raise app.UsageError(
        f"Several CPU processes need JAX_NUM_PROCESSES (and JAX_PROCESS_ID) set, dividing the "
        f"{math.prod(config.mesh.dense)} devices of the mesh; got {n_processes}."
      )
    jax.config.update("jax_num_cpu_devices", math.prod(config.mesh.dense) // n_processes)
  if not jax.config.jax_compilation_cache_dir:  # JAX_COMPILATION_CACHE_DIR wins; tests share this dir.
    jax.config.update(
      "jax_compilation_cache_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".jax_cache")
    )
  print(
    f"[run] process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local "
    f"of {jax.device_count()} {jax.default_backend()} devices",
    flush=True,
  )
  from composer_jax import pipeline  # after the device count: nothing may initialise a backend earlier.

  pipeline.run(config, _WORKDIR.value or config.workdir or os.path.join("runs", config.variant))


if __name__ == "__main__":
  app.run(main)
