"""Entry point: flags → config → `pipeline.run`. Launch commands: experiments/composer25.py.

A problem the user can fix (an unknown config key or stage, a missing config file, an unusable or busy
workdir, an unusable number, an incompatible checkpoint) ends in one line on stderr and exit status 2; a
failure the run cannot go past (a full disk, a failed gate before rl, divergence) in one line and status 1;
an interrupt (Ctrl-C, SIGTERM) after the stage saved, in one line and status 130.
"""

import signal
import sys


def _interrupted_early(signum, frame) -> None:
  """Until the pipeline starts, SIGINT/SIGTERM end the process at once (nothing was done yet). `os._exit`,
  not an exception: one raised in a signal handler can land in a gc callback, where Python drops it."""
  import os

  print("run.py: interrupted before any stage started; rerun the same command to start", file=sys.stderr)
  sys.stderr.flush()
  os._exit(130)


def _redeliver_swallowed_interrupt(unraisable) -> None:
  """A KeyboardInterrupt that Python could not raise (it landed in a gc or weakref callback) is sent
  again from another thread a moment later, so that the main thread raises it where the program can
  handle it (raising it here would only be dropped again); anything else is reported as usual."""
  if isinstance(unraisable.exc_value, KeyboardInterrupt):
    import os
    import threading

    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
  else:
    sys.__unraisablehook__(unraisable)


signal.signal(signal.SIGINT, _interrupted_early)  # also during the imports below (jax takes seconds)
signal.signal(signal.SIGTERM, _interrupted_early)
sys.unraisablehook = _redeliver_swallowed_interrupt

import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_DEFAULT_CONFIG = "experiments/composer25.py"


def _fail(message: str, status: int = 2) -> None:
  """One line, then exit at once: whatever a stage had to save is saved by the time its error reaches
  here, and an interpreter teardown would only add third-party noise (never-awaited coroutines of a failed
  async save, closed event loops) after the line the user should read last."""
  print(f"run.py: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(status)


def _config_problem(e: BaseException) -> str:
  """One line for a config file that is missing or raises, or an override of a key it lacks."""
  from composer_jax import configs

  spec = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")), _DEFAULT_CONFIG)
  path = spec.split(":", 1)[0]
  if not os.path.isfile(path):
    return f"config file {path!r} not found (--config=FILE[:variant], e.g. --config={_DEFAULT_CONFIG})"
  for arg in sys.argv[1:]:
    if arg.startswith("--config."):
      try:
        configs.check_path(arg[len("--config.") :].split("=", 1)[0])
      except configs.ConfigError as bad:
        return str(bad)
  lines = [line.strip() for line in str(e).replace("\\n", "\n").splitlines() if line.strip()]
  return f"bad --config {spec}: {lines[-1] if lines else type(e).__name__}"


def _define_config_flag():
  """`--config`: ml_collections loads the file and applies `--config.x=` overrides already here, at
  definition time, so its errors are caught here (else: a traceback at import)."""
  try:
    return config_flags.DEFINE_config_file(
      "config", _DEFAULT_CONFIG, "Experiment file, optionally `:variant`.", lock_config=True
    )
  except (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError, ImportError) as e:
    _fail(_config_problem(e))


_CONFIG = _define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Outputs; default: config.workdir, else runs/<variant>.")
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed",
  None,
  "Multi-process: jax.distributed.initialize() before anything touches a device (docs/cluster.md). "
  "Default: on when JAX_COORDINATOR_ADDRESS is set.",
)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with config-file problems (an unknown key, a bad value, a file that is missing
  or raises) reported in one line instead of a traceback."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(_config_problem(e) if "config file" in str(e) else str(e).splitlines()[0])
  except (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError, ImportError) as e:
    _fail(_config_problem(e))
  return []


def _cpu_only() -> bool:
  """True when jax will run on CPU: JAX_PLATFORMS=cpu, or unset with no accelerator to drive.

  An installed plugin is not enough: libtpu (the `tpu` extra, also used to compile for TPUs on a CPU
  host) or a CUDA plugin may be present on a machine without the chip, where probing it would fail.
  """
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms == "cpu"
  plugins = importlib.util.find_spec("jax_plugins") or importlib.metadata.entry_points(group="jax_plugins")
  gpu = bool(plugins) and pathlib.Path("/dev/nvidiactl").exists()
  tpu = bool(importlib.util.find_spec("libtpu")) and (
    any(pathlib.Path("/dev").glob("accel*"))
    or pathlib.Path("/dev/vfio").exists()
    or "TPU_ACCELERATOR_TYPE" in os.environ
  )
  return not (gpu or tpu)


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


def _usable_workdir(path: str) -> str:
  """Creates the workdir and checks that files can be written there (one line if not)."""
  p = pathlib.Path(path)
  try:
    p.mkdir(parents=True, exist_ok=True)
    probe = p / ".write_test"
    probe.write_text("")
    probe.unlink()
  except OSError as e:
    _fail(f"--workdir {path} is not a writable directory ({e.strerror or e}); choose another --workdir")
  return str(p)


def _devices(config) -> None:
  """Platform and device count, before any backend exists (and the overlap flags of `backend`)."""
  from composer_jax import backend

  backend.set_overlap_flags()
  cpu = _cpu_only()
  if cpu:
    jax.config.update("jax_platforms", "cpu")  # skips probing for a TPU.
  distributed = _DISTRIBUTED.value
  if distributed is None:
    distributed = "JAX_COORDINATOR_ADDRESS" in os.environ
  n_processes = _initialize_distributed() if distributed else 1
  if cpu:
    # One CPU device per mesh position, as tests/conftest.py does (split over the processes of a
    # multi-process CPU run); must precede backend init.
    if n_processes is None or math.prod(config.mesh.dense) % n_processes:
      _fail(
        f"several CPU processes need JAX_NUM_PROCESSES (and JAX_PROCESS_ID) set, dividing the "
        f"{math.prod(config.mesh.dense)} devices of the mesh; got {n_processes}"
      )
    jax.config.update("jax_num_cpu_devices", math.prod(config.mesh.dense) // n_processes)
  if not jax.config.jax_compilation_cache_dir:  # JAX_COMPILATION_CACHE_DIR wins; tests share this dir.
    jax.config.update(
      "jax_compilation_cache_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".jax_cache")
    )


def _sigterm_as_interrupt(signum, frame) -> None:
  """Outside a training loop (which turns signals into a clean stop), SIGTERM acts like Ctrl-C."""
  raise KeyboardInterrupt


def main(argv):
  del argv
  from composer_jax import configs, console

  if not flags.FLAGS["verbosity"].present:
    console.setup()
  console.quiet_teardown()
  try:
    try:  # strict: any unknown key fails here, before any work
      config = configs.from_config(_CONFIG.value)
    except (OSError, ImportError, SyntaxError) as e:  # the file could not be loaded
      _fail(_config_problem(e))
    _devices(config)  # before anything may initialise a backend
    from composer_jax import pipeline

    pipeline.parse_stages(config.stages)
    workdir = _usable_workdir(_WORKDIR.value or config.workdir or os.path.join("runs", config.variant))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on an interrupt is reported
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # per stage (training loops save first)
    logging.info(
      "[run] process %d of %d: %d local of %d %s devices",
      jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
      jax.default_backend(),
    )  # fmt: skip
    pipeline.run(config, workdir)
    for sig in (signal.SIGINT, signal.SIGTERM):  # done: a late signal must not turn exit 0 into a crash
      signal.signal(sig, signal.SIG_IGN)
  except configs.ConfigError as e:
    _fail(str(e))
  except KeyboardInterrupt:  # outside the stages (before the first, or while the summary was printed)
    _fail("interrupted; what finished is recorded: rerun the same command to resume", 130)
  except Exception as e:  # noqa: BLE001 -- the run's own failure kinds end in one line, the rest raise
    _fail(*_known_failure(e))


def _known_failure(e: Exception) -> tuple[str, int]:
  """(one line, exit status) for the failures a user can act on; re-raises anything else."""
  from composer_jax import pipeline
  from composer_jax.stages import Interrupted
  from composer_jax.train import loop

  if isinstance(e, Interrupted):
    return f"{e}; what finished and what the stage saved are kept: rerun the same command to resume", 130
  if isinstance(e, loop.Diverged | pipeline.GateFailed | loop.OutOfMemory):
    return str(e), 1
  if (oom := loop.out_of_memory(e, "run", 0)) is not None:  # outside a training step (e.g. rollouts)
    return str(oom).replace("[run] step 0 ran", "ran"), 1
  if type(e).__name__ in ("MissingUpstream", "MeshMismatch"):  # what to run first; the mesh to set
    return str(e), 2
  if type(e).__name__ in ("CheckpointError", "CheckpointSaveError"):  # orbax: imported by the stages
    return str(e).replace("\n", " "), 2 if type(e).__name__ == "CheckpointError" else 1
  full = _disk_full(e)
  if full:
    return f"{full}; what finished and the checkpoints saved before are kept: free space and rerun", 1
  raise e


def _disk_full(e: BaseException) -> str | None:
  """`No space left on device (<what failed>)` when ENOSPC or a disk quota is anywhere in the chain of
  `e` (an OSError, or a library's error that quotes it), else None."""
  import errno

  chain: list[BaseException] = []
  while e is not None and all(e is not c for c in chain):
    chain.append(e)
    e = e.__cause__ or e.__context__
  for c in chain:
    os_full = isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)
    if os_full or "No space left on device" in str(c) or "Disk quota exceeded" in str(c):
      what = f"{c.filename}" if isinstance(c, OSError) and c.filename else str(c).splitlines()[0][:160]
      return f"{os.strerror(c.errno) if os_full else 'No space left on device'} ({what})"
  return None


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
