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


def _cpu_only() -> bool:
  """True when jax will run on CPU: JAX_PLATFORMS=cpu, or unset with no GPU/TPU plugin installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms == "cpu"
  plugins = importlib.util.find_spec("jax_plugins") or importlib.metadata.entry_points(group="jax_plugins")
  return not (plugins or importlib.util.find_spec("libtpu"))


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:  # orbax/tfds log every file operation at INFO
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  if _cpu_only():
    # One CPU device per mesh position, as tests/conftest.py does; must precede backend init.
    jax.config.update("jax_platforms", "cpu")  # skips probing for a TPU.
    jax.config.update("jax_num_cpu_devices", math.prod(config.mesh.dense))
  if not jax.config.jax_compilation_cache_dir:  # JAX_COMPILATION_CACHE_DIR wins; tests share this dir.
    jax.config.update(
      "jax_compilation_cache_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".jax_cache")
    )
  from composer_jax import pipeline  # after the device count: nothing may initialise a backend earlier.

  pipeline.run(config, _WORKDIR.value or config.workdir or os.path.join("runs", config.variant))


if __name__ == "__main__":
  app.run(main)
