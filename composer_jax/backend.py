"""Per-backend choices in one place: which attention kernel and which grouped-matmul (expert) kernel run
on CPU, GPU and TPU, and the XLA flags that let collectives overlap compute.

The platform is the one the program is compiled for: the devices of the meshes when there are meshes
(an XLA:TPU compile on a CPU host targets "tpu"), else jax's default backend. `ModelConfig` fields set to
"auto" resolve here; any other value is used as given (tests force every path on CPU).

| platform | attention (training)                       | routed experts (`expert_impl`)                 |
|----------|--------------------------------------------|------------------------------------------------|
| cpu      | "xla": scores materialised, fp32 softmax   | "blocked" (XLA:CPU runs ragged_dot densely)    |
| gpu      | "cudnn": `jax.nn.dot_product_attention`    | "tokamax" ragged dot if installed, else ragged |
| tpu      | "splash" (tokamax), else "xla"             | "tokamax" if installed, else "ragged" (native) |

The ragged expert dispatch (`dispatch="ragged_all_to_all"`) uses `jax.lax.ragged_all_to_all` where the
platform has it (GPU, TPU) and `cpu_collectives.ragged_all_to_all`, a stand-in built from all_to_all, on
XLA:CPU, which has no ragged-all-to-all (`native_ragged_all_to_all`).

Decoding always uses the absorbed MLA form over the latent cache (attention.py), whatever the kernel.
Shapes decide too: "auto" splash runs only when each query shard and the keys split into 128-row
blocks (`attention_kernels.splash_fits`; else "xla"), and tokamax's Mosaic grouped matmul hands
operands under 128 rows or columns to XLA's ragged_dot (`experts.tokamax_ragged_dot`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import jax

ATTENTION = {"cpu": "xla", "gpu": "cudnn", "tpu": "splash"}
# Platforms whose XLA compiles ragged-all-to-all (XLA:CPU: "not supported by ... ThunkEmitter", jax #34755).
NATIVE_RAGGED_ALL_TO_ALL = frozenset({"gpu", "tpu"})
# Flags for asynchronous collectives that the scheduler can overlap with compute (Muon's all-to-alls under
# other groups' Newton–Schulz matmuls, EP dispatch under expert matmuls). XLA:TPU keeps all-to-all
# synchronous unless asked (verified in the compiled HLO: `all-to-all-start`/`-done` pairs appear only
# with this flag); XLA:GPU's collectives are asynchronous by default but only the latency-hiding
# scheduler moves compute between start and done, and by default one collective at a time is in flight.
OVERLAP_FLAGS = {
  "LIBTPU_INIT_ARGS": ("--xla_tpu_enable_async_all_to_all=true",),
  "XLA_FLAGS": (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
  ),
}


def platform(meshes: Any = None) -> str:
  """ "cpu", "gpu" or "tpu": of the meshes' devices if given, else of jax's default backend."""
  if meshes is not None:
    name = meshes.devices[0].platform
  else:
    name = jax.default_backend()
  return "gpu" if name in ("gpu", "cuda", "rocm") else name


def has_tokamax() -> bool:
  return importlib.util.find_spec("tokamax") is not None


def attention_impl(requested: str, meshes: Any = None) -> str:
  """The training attention kernel: `requested` unless "auto" (splash needs tokamax: "xla" without it)."""
  if requested != "auto":
    return requested
  impl = ATTENTION.get(platform(meshes), "xla")
  return "xla" if impl == "splash" and not has_tokamax() else impl


def expert_impl(requested: str, meshes: Any = None) -> str:
  """The routed-expert kernel: `requested` unless "auto" (see the module table)."""
  if requested != "auto":
    return requested
  where = platform(meshes)
  if where == "cpu":
    return "blocked"
  return "tokamax" if has_tokamax() else "ragged"


def native_ragged_all_to_all(where: str) -> bool:
  """Whether platform `where` ("cpu", "gpu", "tpu": of the mesh's devices) has `jax.lax.ragged_all_to_all`."""
  return where in NATIVE_RAGGED_ALL_TO_ALL


_RECORDING: list[dict[str, set[str]]] = []  # the open `record_kernels` blocks


@contextlib.contextmanager
def record_kernels() -> Iterator[dict[str, set[str]]]:
  """{"attention_impl": {...}, "expert_impl": {...}}: the kernels the model picks while it is traced inside
  the block. What a compiled step runs depends on more than "auto" (shapes, the KV cache, the
  expert-parallel path), so the compile stage records what tracing chose rather than re-deriving it."""
  seen: dict[str, set[str]] = {"attention_impl": set(), "expert_impl": set()}
  _RECORDING.append(seen)
  try:
    yield seen
  finally:
    _RECORDING.remove(seen)


def chosen(kind: str, impl: str) -> str:
  """`impl`, noted as the `kind` kernel ("attention_impl" or "expert_impl") in every open `record_kernels`."""
  for seen in _RECORDING:
    seen[kind].add(impl)
  return impl


def set_overlap_flags(environ: Any = os.environ) -> None:
  """Adds `OVERLAP_FLAGS` to the environment (keeping flags already there); call before jax initialises
  a TPU or GPU backend (run.py does). Harmless on CPU: neither variable is read there."""
  for var, flags in OVERLAP_FLAGS.items():
    have = environ.get(var, "")
    names = {f.split("=", 1)[0] for f in have.split()}
    extra = [f for f in flags if f.split("=", 1)[0] not in names]
    if extra:
      environ[var] = " ".join([have, *extra]).strip()
