"""Compiler figures of issue 16 (RESULTS.md "issue 16"), from any source tree of this repository.

  python benchmarks/compile_figures.py muon_plan --devices=1024             # planner, kimi_k25_1t
  python benchmarks/compile_figures.py hop                                  # tiny, 8 CPU devices
  python benchmarks/compile_figures.py attention --impls=absorbed,xla       # one kimi layer, T 4096
  python benchmarks/compile_figures.py decode                               # rl.sampler.decode, BENCH

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
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
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


def _summary(compiled) -> dict:
  hlo = compiled.as_text()
  counts: dict[str, int] = {}
  for op in _COLL.findall(hlo):
    counts[op] = counts.get(op, 0) + 1
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

  config = configs.from_config(_variant("tiny"))
  meshes = sharding.build_meshes(config.mesh.dense, config.mesh.expert, jax.devices())
  cfg, t = config.model, config.train
  tx = optim.build_optimizer(cfg, configs.pretrain_optimizer(config), meshes)
  state = stage.abstract_train_state(cfg, tx, meshes)
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
  for impl in args.impls.split(","):
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


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("figure", choices=["muon_plan", "hop", "attention", "decode"])
  ap.add_argument("--devices", type=int, default=1024)
  ap.add_argument("--impls", default="absorbed,xla")
  ap.add_argument("--seq", type=int, default=4096)
  args = ap.parse_args()
  print(json.dumps(globals()[args.figure](args), indent=1, default=str))


if __name__ == "__main__":
  main()
