"""The few private tokamax modules this package uses, in one place, pinned to one tokamax version.

tokamax's public API covers the GPU grouped matmul (`tokamax.ragged_dot(implementation="triton")`), but
not two things this package needs:
- splash attention with packed-row segment ids, each head's max logit (QK-clip), query shards for context
  parallelism, a load-balanced causal mask and fewer dq buffers: `tokamax.dot_product_attention` takes a
  dense mask and returns the output only;
- the Mosaic TPU grouped matmul when the step is compiled ahead of time on a CPU host (`plan.compile`) or
  interpreted on CPU (tests): the public op asks the host's default device whether it is a TPU and, when
  it is not, quietly runs XLA's ragged_dot instead.
So these come from `tokamax._src`, which may change in any release. The `kernels` extra pins the version
they were written against (`PINNED`); `module` fails in one line naming it when a name is missing, and
tests/test_tokamax_pin.py checks every name below against the installed tokamax.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types

PINNED = "0.0.12"  # = pyproject's `kernels` extra
_SPLASH = "ops.experimental.tpu.splash_attention."
MODULES = {  # short name -> (module under tokamax._src, the names used from it)
  "ragged_dot_mosaic_tpu": ("ops.ragged_dot.pallas_mosaic_tpu", ("PallasMosaicTpuRaggedDot",)),
  "ragged_dot_base": ("ops.ragged_dot.base", ("vjp",)),
  "splash_kernel": (_SPLASH + "splash_attention_kernel", ("SplashConfig", "SegmentIds", "make_splash_mha")),
  "splash_mask": (_SPLASH + "splash_attention_mask", ("CausalMask",)),
  "splash_mask_info": (_SPLASH + "splash_attention_mask_info", ("process_mask",)),
}


def installed() -> str | None:
  """The installed tokamax version, None when it is not installed."""
  try:
    return importlib.metadata.version("tokamax")
  except importlib.metadata.PackageNotFoundError:
    return None


def _unpinned(what: str) -> ImportError:
  return ImportError(
    f"{what}: composer_jax uses private tokamax modules as they are in tokamax {PINNED} "
    f"(installed: {installed() or 'none'}); install that version with `pip install -e '.[kernels]'`"
  )


def module(name: str) -> types.ModuleType:
  """The private tokamax module `MODULES[name]`, with every name this package uses from it present."""
  path, names = MODULES[name]
  full = f"tokamax._src.{path}"
  try:
    found = importlib.import_module(full)
  except ImportError as e:
    raise _unpinned(f"cannot import {full}") from e
  missing = [n for n in names if not hasattr(found, n)]
  if missing:
    raise _unpinned(f"{full} has no {', '.join(missing)}")
  return found
