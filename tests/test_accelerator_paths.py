"""Paths only an accelerator takes, reached from this CPU host (docs/model.md, "What only an accelerator
runs"): tokamax's Mosaic TPU kernels (the grouped matmul and splash attention) compiled by XLA:TPU
(libtpu, ahead of time for a v5p topology), the XLA overlap flags (`backend.set_overlap_flags`) and what
the TPU one changes in a compiled program, and the "auto" kernel choice on a GPU or TPU mesh.

Their numerics on CPU (Pallas interpret mode) are tests/test_moe.py and tests/test_attention_kernels.py;
compiling is what interpret mode does not check (Mosaic's own lowering and XLA:TPU's handling of its
custom calls, forward and backward).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import backend

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _topology_mesh():
  pytest.importorskip("libtpu", reason="XLA:TPU (libtpu) is not installed: pip install -e '.[tpu,kernels]'")
  from composer_jax.plan import compile as compile_stage

  return Mesh(np.array(compile_stage.topology_devices("v5p:2x2x1")[:1]), ("one",))


def _tpu_custom_calls(fn, *shapes) -> int:
  """How many Mosaic kernels (`tpu_custom_call`) XLA:TPU's compiled `fn` runs, traced for one v5p chip."""
  mesh = _topology_mesh()
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes]
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # Mosaic reads the chip it lowers for
    hlo = jax.jit(fn).lower(*args).compile().as_text()
  return len(re.findall(r'custom_call_target="tpu_custom_call"', hlo))


def test_mosaic_grouped_matmul_compiles_for_tpu_forward_and_backward():
  """expert_impl="tokamax" on TPU: the forward and both gradients are Mosaic kernels XLA:TPU compiles."""
  pytest.importorskip("tokamax", reason="tokamax is not installed (extra `kernels`)")
  from composer_jax.model import experts

  kernel = experts.tokamax_ragged_dot("tpu")

  def loss(x, w, sizes):
    return jnp.sum(kernel(x, w, sizes, preferred_element_type=jnp.float32))

  bf16 = jnp.bfloat16
  grads = jax.value_and_grad(loss, argnums=(0, 1))
  assert _tpu_custom_calls(grads, ((256, 128), bf16), ((4, 128, 128), bf16), ((4,), jnp.int32)) == 3


def test_splash_attention_compiles_for_tpu_forward_and_backward():
  pytest.importorskip("tokamax", reason="tokamax is not installed (extra `kernels`)")
  from composer_jax.model import attention_kernels

  def loss(q, k, v, pos, seg):
    out, _ = attention_kernels.splash(q, k, v, 0.1, pos, pos, seg, seg)
    return jnp.sum(out.astype(jnp.float32))

  qkv, rows = ((1, 256, 2, 128), jnp.bfloat16), ((1, 256), jnp.int32)
  assert _tpu_custom_calls(jax.grad(loss, argnums=(0, 1, 2)), qkv, qkv, qkv, rows, rows) >= 2


def test_overlap_flags_are_added_to_what_is_set():
  env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"}
  backend.set_overlap_flags(env)
  backend.set_overlap_flags(env)  # twice: nothing doubles
  assert env["LIBTPU_INIT_ARGS"] == "--xla_tpu_enable_async_all_to_all=true"
  assert env["XLA_FLAGS"].split() == [
    "--xla_gpu_enable_latency_hiding_scheduler=false",  # the user's value stays
    "--xla_dump_to=/tmp/x",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
  ]


_ALL_TO_ALL = """
import sys
from composer_jax import backend
if sys.argv[1] == "on":
  backend.set_overlap_flags()
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from composer_jax.plan import compile as compile_stage
mesh = Mesh(compile_stage.topology_devices("v5p:2x2x1"), ("x",))
f = jax.shard_map(lambda x: 2 * jax.lax.all_to_all(x, "x", 0, 0, tiled=True), mesh=mesh, in_specs=P("x"),
                  out_specs=P("x"))
x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
hlo = jax.jit(f).lower(x).compile().as_text()
print("async" if "all-to-all-start" in hlo else "sync" if "all-to-all(" in hlo else "none")
"""


def test_the_tpu_overlap_flag_makes_all_to_all_asynchronous():
  """libtpu reads LIBTPU_INIT_ARGS once, when it loads: each compile runs in a fresh process."""
  pytest.importorskip("libtpu", reason="XLA:TPU (libtpu) is not installed: pip install -e '.[tpu,kernels]'")
  env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"} | {"JAX_PLATFORMS": "cpu"}
  runs = {
    flag: subprocess.Popen(
      [sys.executable, "-c", _ALL_TO_ALL, flag],
      cwd=_ROOT,
      env=env,
      stdout=subprocess.PIPE,
      text=True,
      stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for flag in ("on", "off")
  }
  got = {flag: p.communicate(timeout=300)[0].strip().splitlines()[-1] for flag, p in runs.items()}
  assert got == {"on": "async", "off": "sync"}


def _meshes_on(platform: str):
  """A stand-in for `sharding.Meshes` whose devices are of `platform` (only `backend.platform` reads it)."""
  return types.SimpleNamespace(devices=[types.SimpleNamespace(platform=platform)])


@pytest.mark.parametrize(
  "platform, attention, experts", [("cuda", "cudnn", "tokamax"), ("tpu", "splash", "tokamax")]
)
def test_auto_picks_the_fused_kernels_on_an_accelerator_mesh(platform, attention, experts):
  tokamax = importlib.util.find_spec("tokamax") is not None
  meshes = _meshes_on(platform)
  want_attention = attention if tokamax or attention == "cudnn" else "xla"
  assert backend.attention_impl("auto", meshes) == want_attention
  assert backend.expert_impl("auto", meshes) == (experts if tokamax else "ragged")
  assert backend.native_ragged_all_to_all(backend.platform(meshes))
  assert backend.attention_impl("xla", meshes) == "xla"  # a named kernel is used as given
