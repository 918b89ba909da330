"""Compiler figures of issue 16 (RESULTS.md "issue 16"), from any source tree of this repository.

  python benchmarks/compile_figures.py muon_plan --devices=1024             # planner, kimi_k25_1t
  python benchmarks/compile_figures.py hop                                  # tiny, 8 CPU devices
  python benchmarks/compile_figures.py attention --impls=absorbed,xla       # one kimi layer, T 4096
  python benchmarks/compile_figures.py decode                               # rl.sampler.decode, BENCH
  python benchmarks/compile_figures.py experts                              # moonlight experts, v5p:2x2x1
  python benchmarks/compile_figures.py attention_tpu --seq=4096             # one kimi MLA layer, 1 v5p chip

Run it from the tree to measure (`cd <tree> && python <this file> ...`): the imports come from the
working directory, so one copy of this script compares two commits. Nothing runs on a device: every
figure is XLA's (`cost_analysis`, `memory_analysis`, the optimized HLO) or the planner's.
- muon_plan: `plan.run` on kimi_k25_1t at --devices: Muon NS FLOPs per device ÷ the ideal even split,
  and Muon collective bytes per device and step.
- hop: the tiny experiment's forward (`model.apply` with meshes) and train step (the compile stage's
  `lower_train_step`) on 8 CPU devices: collective counts, FLOPs, bytes accessed, temp.
- attention: one kimi_k25_1t-shaped layer (dense MLP), B 1 × T --seq, forward + backward, XLA:CPU.
- decode: the compiled decode loop at the sampler benchmark's shape: which ops write the whole
  latent cache inside the loop, and the op count of the loop body.
- experts: one moonlight_16b routed-expert block (`expert_parallel.dispatch`: ragged all-to-all there
  and back, the grouped SwiGLU), --tokens over --topology (EP over all chips), forward + backward,
  XLA:TPU, --impls (default ragged,tokamax); and `jax.lax.ragged_dot` alone at one chip's shape.
- attention_tpu: one kimi_k25_1t MLA layer alone (projections + attention, no MLP), B 1 × T --seq,
  forward + backward on one chip of --topology, --impls (default xla,splash); and the kernel alone.
The XLA:TPU figures need libtpu (`.[tpu]`), tokamax's need `.[kernels]`; no TPU is used. FLOPs and
bytes of a Mosaic kernel (custom call "tpu_custom_call") are not measured by XLA: `cost_analysis`
adds what the kernel declares (Pallas `CostEstimate`), tokamax's estimate or XLA's own for the
ragged-dot kernels it emits.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import sys
import tempfile

if "hop" in sys.argv:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from composer_jax import configs, model  # noqa: E402

_COLL = re.compile(
  r"(?<![\w-])((?:ragged-)?all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)(?:-start)?\("
)


def _variant(name: str):
  spec = importlib.util.spec_from_file_location("c25", os.path.join("experiments", "composer25.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(name)


def _collectives(hlo: str) -> dict[str, int]:
  return dict(collections.Counter(_COLL.findall(hlo)))


def _summary(compiled) -> dict:
  hlo = compiled.as_text()
  counts = _collectives(hlo)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  return {
    "collectives": counts,
    "flops": cost.get("flops"),
    "bytes_accessed": cost.get("bytes accessed"),
    "temp": compiled.memory_analysis().temp_size_in_bytes,
  }


def muon_plan(args) -> dict:
  from composer_jax import plan  # noqa: PLC0415

  c = _variant("kimi_k25_1t")
  c.plan.devices = args.devices
  with tempfile.TemporaryDirectory() as d:
    out = plan.run(configs.from_config(c), d)
  mu, dense = out["muon"], out["layout"]["dense"]
  devices = dense[0] * dense[1] * dense[2]
  keys = ("all_to_all_bytes", "all_gather_bytes", "all_reduce_bytes")
  return {
    "layout": out["layout"],
    "ns_flops_per_device": mu["ns_flops_per_device"],
    "ns_flops_per_device_by_mesh": mu["ns_flops_per_device_by_mesh"],
    "per_device_over_ideal": mu["ns_flops_per_device"] / (mu["ns_flops_total"] / devices),
    "muon_collective_bytes": {k: mu.get(k) for k in keys},
    "largest_group_stack_bytes": mu["largest_group_stack_bytes"],
    "peak_gib": out["peak_bytes"] / 2**30,
  }


def hop(args) -> dict:
  from composer_jax import optim, sharding  # noqa: PLC0415
  from composer_jax.plan import compile as stage  # noqa: PLC0415
  from composer_jax.train import state as train_state  # noqa: PLC0415

  config = configs.from_config(_variant("tiny"))
  meshes = sharding.build_meshes(config.mesh.dense, config.mesh.expert, jax.devices())
  cfg, t = config.model, config.train
  tx = optim.build_optimizer(cfg, configs.pretrain_optimizer(config), meshes)
  state = train_state.abstract_state(cfg, tx, meshes)
  tok = stage._abstract_batch({"tokens": ((t.batch_size, t.seq_len), np.int32)}, meshes)["tokens"]
  fwd = jax.jit(lambda p, x: model.apply(p, cfg, x, meshes=meshes)[0]).lower(state.params, tok).compile()
  step = stage.lower_train_step(config, meshes).compile()
  mesh = {"dense": config.mesh.dense, "expert": config.mesh.expert}
  return {
    "mesh": mesh,
    "batch": [t.batch_size, t.seq_len],
    "forward": _summary(fwd),
    "train_step": _summary(step),
  }


def attention(args) -> dict:
  base = configs.from_config(_variant("kimi_k25_1t")).model
  out = {}
  for impl in (args.impls or "absorbed,xla").split(","):
    over = dict(n_layers=1, first_k_dense=1, vocab_size=1024, remat="none")
    if "attention_impl" in {f.name for f in dataclasses.fields(base)}:
      over["attention_impl"] = impl
    cfg = dataclasses.replace(base, **over)
    loss = lambda p, t, cfg=cfg: jnp.mean(model.apply(p, cfg, t)[0].astype(jnp.float32))  # noqa: E731
    tok = jax.ShapeDtypeStruct((1, args.seq), jnp.int32)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(model.abstract_params(cfg), tok).compile()
    out[impl] = _summary(compiled)
  return out


def decode(args) -> dict:
  from model_step import BENCH  # noqa: PLC0415

  from composer_jax.rl import sampler  # noqa: PLC0415

  cfg, B, P, N = BENCH, 8, 32, 224
  params = model.init(cfg, jax.random.key(0))
  prompts, lengths = jnp.ones((B, P), jnp.int32), jnp.full((B,), P, jnp.int32)
  logits, cache = sampler.extend(params, cfg, model.init_cache(cfg, B, P + N), prompts, lengths)
  keys = jax.random.split(jax.random.key(1), B)
  call = (params, cfg, cache, sampler.last_logits(logits, lengths), keys, jnp.full((B,), N, jnp.int32))
  call += tuple(sampler.settings(0.9, 50, 1.0, (), 0))
  compiled = sampler.decode.lower(
    *call, max_new_tokens=N, meshes=None, feed_last=jnp.asarray(False)
  ).compile()
  hlo = compiled.as_text()
  # Ops inside jax's decode while_loop (op_name ".../while/body/...") whose result is the whole latent
  # cache: a full write of it per generated token unless it is an in-place dynamic-update-slice.
  whole = f"f32[{cfg.n_layers},{B},{P + N},{cfg.kv_lora_rank}]"
  writes: dict[str, int] = {}
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
    if not m or not m.group(2).startswith(whole) or "while/body" not in line:
      continue
    kind = m.group(3) if m.group(3) != "fusion" else m.group(1).rsplit(".", 1)[0]
    writes[kind] = writes.get(kind, 0) + 1
  return {"cache": whole, "ops_in_the_loop_writing_the_whole_latent_cache": writes}


def _kernel_summary(compiled) -> dict:
  """XLA:TPU's view of one program: FLOPs and bytes (`cost_analysis`), memory, custom calls by target,
  the Mosaic kernels by name, dots and convolutions (fused computations included), collectives."""
  hlo = compiled.as_text()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  mem = compiled.memory_analysis()
  mosaic = collections.Counter(
    re.sub(r"\.\d+$", "", re.match(r"\s*(?:ROOT )?%?([\w.\-]+) =", line).group(1))
    for line in hlo.splitlines()
    if 'custom_call_target="tpu_custom_call"' in line
  )
  return {
    "flops": cost.get("flops"),
    "bytes_accessed": cost.get("bytes accessed"),
    "temp": mem.temp_size_in_bytes,
    "argument": mem.argument_size_in_bytes,
    "custom_calls": dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))),
    "mosaic_kernels": dict(mosaic),
    "dots": len(re.findall(r" dot\(", hlo)),
    "convolutions": len(re.findall(r" convolution\(", hlo)),
    "collectives": _collectives(hlo),
  }


def _tpu(topology: str):
  """The topology's devices and the versions the figures depend on; tokamax's cache-miss warnings off."""
  from absl import logging  # noqa: PLC0415

  from composer_jax.plan import compile as stage  # noqa: PLC0415

  logging.set_verbosity(logging.ERROR)
  versions = {}
  for package in ("jax", "libtpu", "tokamax"):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  return stage.topology_devices(topology), {"topology": topology, "versions": versions}


def experts(args) -> dict:
  from composer_jax import sharding  # noqa: PLC0415
  from composer_jax.model import expert_parallel  # noqa: PLC0415
  from composer_jax.model import experts as ex  # noqa: PLC0415

  devices, out = _tpu(args.topology)
  n = len(devices)
  meshes = sharding.build_meshes((n, 1, 1), (n, 1), devices)
  base = configs.from_config(_variant("moonlight_16b")).model
  E, D, F, K = base.n_experts, base.d_model, base.moe_mlp_dim, base.top_k
  sds = jax.ShapeDtypeStruct
  tokens = jax.sharding.NamedSharding(meshes.expert, sharding.expert_layout(meshes).token_spec())
  shapes = (((E, D, F), ex.W_GATE_AXES), ((E, D, F), ex.W_UP_AXES), ((E, F, D), ex.W_DOWN_AXES))
  ws = [sds(s, base.param_dtype, sharding=sharding.param_sharding(a, meshes, s)) for s, a in shapes]
  x, ids = (
    sds((args.tokens, D), base.dtype, sharding=tokens),
    sds((args.tokens, K), jnp.int32, sharding=tokens),
  )
  out |= {
    "tokens": args.tokens,
    "chips": n,
    "dispatch": base.dispatch,
    "capacity_factor": base.capacity_factor,
  }
  for impl in (args.impls or "ragged,tokamax").split(","):
    cfg = dataclasses.replace(base, expert_impl=impl)

    def loss(x, ids, *ws, cfg=cfg):
      return jnp.sum(expert_parallel.dispatch(x, ids, ws, cfg, meshes)[0].astype(jnp.float32))

    out[impl] = _kernel_summary(
      jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4))).lower(x, ids, *ws).compile()
    )
  # One chip's grouped matmul: its receive buffer (ragged all-to-all: capacity_factor × its assignments)
  # against its E/n experts' gate|up weights; FLOPs ÷ 2·rows·D·2F (the grouped matmul's own work).
  rows, one = (
    math.ceil(args.tokens // n * K * base.capacity_factor),
    jax.sharding.SingleDeviceSharding(devices[0]),
  )
  a, w, sizes = (
    sds((rows, D), base.dtype, sharding=one),
    sds((E // n, D, 2 * F), base.dtype, sharding=one),
    sds((E // n,), jnp.int32, sharding=one),
  )
  dot = lambda a, w, s: jax.lax.ragged_dot(a, w, s, preferred_element_type=jnp.float32)  # noqa: E731
  alone = {"forward": dot, "weight_gradient": lambda a, w, s: jax.grad(lambda w: jnp.sum(dot(a, w, s)))(w)}
  out["ragged_dot_alone"] = {"rows": rows, "groups": E // n}
  for name, fn in alone.items():
    summary = _kernel_summary(jax.jit(fn).lower(a, w, sizes).compile())
    out["ragged_dot_alone"][name] = summary | {
      "flops_over_grouped": summary["flops"] / (2 * rows * D * 2 * F)
    }
  return out


def attention_tpu(args) -> dict:
  from flax import nnx  # noqa: PLC0415

  from composer_jax.model import attention as mla  # noqa: PLC0415
  from composer_jax.model import attention_kernels, rope  # noqa: PLC0415

  devices, out = _tpu(args.topology)
  one = jax.sharding.SingleDeviceSharding(devices[0])
  base = configs.from_config(_variant("kimi_k25_1t")).model
  T, H, sds = args.seq, base.n_heads, jax.ShapeDtypeStruct
  pos, seg = np.arange(T, dtype=np.int32)[None], np.ones((1, T), np.int32)
  out["shape"] = {"B": 1, "T": T, "heads": H, "qk_head_dim": base.qk_head_dim, "v_head_dim": base.v_head_dim}
  for impl in (args.impls or "xla,splash").split(","):
    cfg = dataclasses.replace(base, attention_impl=impl)
    with nnx.use_eager_sharding(False):
      graphdef, state = nnx.split(nnx.eval_shape(lambda cfg=cfg: mla.MLA(cfg, nnx.Rngs(0))))
    state = jax.tree.map(lambda s: sds(s.shape, s.dtype, sharding=one), state)

    def layer(state, x, graphdef=graphdef, cfg=cfg):
      cos, sin = rope.cos_sin(cfg, pos)
      return jnp.sum(nnx.merge(graphdef, state)(x, cos, sin, pos, seg)[0].astype(jnp.float32))

    x = sds((1, T, cfg.d_model), cfg.dtype, sharding=one)
    out[impl] = _kernel_summary(jax.jit(jax.value_and_grad(layer, argnums=(0, 1))).lower(state, x).compile())

    def kernel(q, k, v, impl=impl):
      y = attention_kernels.attention(impl, q, k, v, base.softmax_scale, pos, pos, seg, seg)[0]
      return jnp.sum(y.astype(jnp.float32))

    qk, v = (
      sds((1, T, H, cfg.qk_head_dim), cfg.dtype, sharding=one),
      sds((1, T, H, cfg.v_head_dim), cfg.dtype, sharding=one),
    )
    grads = jax.jit(jax.value_and_grad(kernel, argnums=(0, 1, 2)))
    out[f"{impl} kernel alone"] = _kernel_summary(grads.lower(qk, qk, v).compile())
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("figure", choices=["muon_plan", "hop", "attention", "decode", "experts", "attention_tpu"])
  ap.add_argument("--devices", type=int, default=1024)
  ap.add_argument(
    "--impls",
    default=None,
    help="default: absorbed,xla (attention), ragged,tokamax (experts), xla,splash (attention_tpu)",
  )
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--topology", default="v5p:2x2x1")
  args = ap.parse_args()
  print(json.dumps(globals()[args.figure](args), indent=1, default=str))


if __name__ == "__main__":
  main()
