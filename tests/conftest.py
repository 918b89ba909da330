"""Suite-wide JAX set-up: 8 CPU devices, strict rank promotion, a persistent compilation cache.

Everything here runs at import, before any test touches a backend: `jax_num_cpu_devices` only
takes effect before the CPU backend is initialised (and raises after). This is the suite's one
device-forcing mechanism; test modules must not set device counts themselves.

The compilation cache defaults to `<repo>/.jax_cache` (git-ignored), so the README's plain
`pytest` command reuses compiled programs across runs; `JAX_COMPILATION_CACHE_DIR` overrides it.
"""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (JAX_PLATFORMS must be set before jax reads it)
import pytest  # noqa: E402

from composer_jax import sharding  # noqa: E402

N_DEVICES = 8

jax.config.update("jax_num_cpu_devices", N_DEVICES)
jax.config.update("jax_numpy_rank_promotion", "raise")

_CACHE_DIR = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
  pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"
)
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
# Small CPU programs compile in well under jax's default 1 s threshold; cache them all.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def meshes() -> sharding.Meshes:
  """Dense (replica=4, fsdp=1, context=2) and expert (expert=8, expert_fsdp=1) on 8 CPU devices."""
  assert len(jax.devices()) == N_DEVICES, f"expected {N_DEVICES} devices, got {jax.devices()}"
  return sharding.build_meshes((4, 1, 2), (8, 1))
