"""The `compile` stage: the real train step compiled ahead of time for an accelerator topology, judged
by the compiler itself (MaxText's `train_compile` is the model).

  python run.py --config=experiments/composer25.py:moonlight_16b --config.stages=compile \
      --config.compile.topology=v5p:4x4x4

XLA:TPU ships in libtpu (`pip install -e '.[tpu,kernels]'`) and runs on a CPU host:
`jax.experimental.topologies` describes a pod's chips without any being present, `sharding.build_meshes`
lays both meshes over them, and `jit(step).lower(abstract state, abstract batch).compile()` returns the
compiler's buffer assignment (`memory_analysis()`), FLOPs (`cost_analysis()`) and the optimized HLO of
the sharded program. Nothing is allocated: the state is `ShapeDtypeStruct`s with the shardings
`create_state` gives.

`<workdir>/compile.json` holds the topology, devices, compile time, XLA's per-device memory (argument,
output, alias, temp and peak = argument + temp + output − alias), the planner's prediction of the same
fields (`Plan.xla`), the chip's HBM, whether it fits, FLOPs per device and the HLO's collective ops by
name, the attention and expert kernels the step runs ("backend": `attention_impl`, `expert_impl`, as
tracing chose them for these meshes and shapes), and under "estimate" the step time by XLA's cost model
with every `while` body weighted by its trip count (`plan.estimate`: the scanned layers would otherwise
count once): corrected FLOPs and bytes per device, step seconds, MFU against the model's FLOPs (6 ·
active params · tokens + causal attention), collective bytes by kind and the Muon update's own seconds
(ops in its named scopes). `flops_per_device` is the corrected figure; XLA's raw one is
`estimate.xla_raw.flops`.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import pathlib
import re
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from composer_jax import backend, configs, model, optim, sharding
from composer_jax.plan import core, estimate, report, rollout
from composer_jax.train import pretrain
from composer_jax.train import state as train_state
from composer_jax.train import step as step_lib
from composer_jax.train.batch import TokenBatch

LIBTPU_HINT = (
  "the compile stage needs XLA:TPU from libtpu: `pip install -e '.[tpu,kernels]'` (jax[tpu] at the project's "
  "jax version, and the kernels the step runs on TPU; it runs on a CPU host, no TPU needed)"
)
# HBM per chip by `device_kind` (Google Cloud TPU system architecture pages).
HBM_BYTES = {
  "TPU v4": 32 * 2**30,
  "TPU v5": 95 * 2**30,  # v5p
  "TPU v5 lite": 16 * 2**30,  # v5e
  "TPU v6 lite": 32 * 2**30,  # v6e (Trillium)
}
# HLO collective ops counted in the optimized program; async forms count as their op.
_COLLECTIVE = re.compile(
  r"(?<![\w-])((?:ragged-)?all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)(?:-start)?\("
)


def topology_devices(topology: str, num_slices: int = 1) -> list[jax.Device]:
  """The abstract devices of a TPU topology name (e.g. `v5p:4x4x4`), `num_slices` slices of it."""
  if importlib.util.find_spec("libtpu") is None:
    raise RuntimeError(LIBTPU_HINT)
  # libtpu takes a host-wide lock meant for real chips; compiling needs none, and without this a second
  # compiling process (a test run next to a stage) fails with "libtpu multi-process lockfile".
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # noqa: PLC0415  (only with libtpu)

  desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, num_slices=num_slices)
  return list(desc.devices)


def collectives(hlo_text: str) -> dict[str, int]:
  """{HLO collective op: count} of an optimized module's text (a loop body's ops count once)."""
  return dict(sorted(collections.Counter(_COLLECTIVE.findall(hlo_text)).items()))


def _abstract_batch(fields: dict[str, tuple[tuple[int, ...], Any]], meshes: sharding.Meshes) -> dict:
  """ShapeDtypeStructs of a batch: [B, T] fields split like tokens, [B] fields over the batch axes."""
  rows = sharding.activation_sharding(("batch",), meshes)
  grid = sharding.activation_sharding(("batch", "seq"), meshes)
  return {
    k: jax.ShapeDtypeStruct(shape, dtype, sharding=grid if len(shape) == 2 else rows)
    for k, (shape, dtype) in fields.items()
  }


def lower_train_step(config: configs.Config, meshes: sharding.Meshes) -> jax.stages.Lowered:
  """The pretraining step as the pretrain stage builds it, lowered from abstract state and batch."""
  cfg, tcfg = config.model, config.train
  ocfg = configs.pretrain_optimizer(config)
  tx = optim.build_optimizer(cfg, ocfg, meshes)
  state = train_state.abstract_state(cfg, tx, meshes)
  shape = (tcfg.batch_size, tcfg.seq_len)
  batch = TokenBatch(
    **_abstract_batch({k: (shape, np.int32) for k in ("tokens", "segment_ids", "positions")}, meshes)
  )
  step = step_lib.make_step(
    step_lib.next_token_loss(cfg, meshes), tx, cfg, schedule=optim.lr_schedule(ocfg), meshes=meshes,
    state_sharding=jax.tree.map(lambda x: x.sharding, state),
    batch_sharding=jax.tree.map(lambda x: x.sharding, batch), router_bias_rate=tcfg.router_bias_rate,
    qk_clip_tau=ocfg.qk_clip_tau, grad_accum=tcfg.grad_accum,
  )  # fmt: skip
  return step.lower(state, batch)


def lower_rl_step(
  config: configs.Config, meshes: sharding.Meshes, micro_rows: int | None = None
) -> jax.stages.Lowered:
  """The RL step of the variant's model as the rl stage builds it, lowered for problems_per_step ×
  group_size rollouts padded to the power of two ≥ rl.cache_len tokens. With rl.lambda_feedback > 0 it
  carries the feedback branch: the teacher (frozen or EMA: a second copy of the params in the optimizer
  state) encodes `rl.feedback_rows` flagged rows, extends them by a 64-token hint + turn, and the
  divergence runs on up to max_turn_tokens tokens of each (a 64-token hint + turn). `micro_rows`: the
  update in micro-batches of that many rollouts (`rl.batch.micro_batched`'s layout)."""
  from composer_jax.rl import batch as rl_batch  # noqa: PLC0415  (the RL package is large)
  from composer_jax.rl import step as rl_step  # noqa: PLC0415
  from composer_jax.rl.loss import LossSettings  # noqa: PLC0415

  cfg, r = config.model, config.rl
  ocfg = configs.stage_optimizer(config.optim, r.schedule, lr=r.lr, min_lr_ratio=1.0)
  tx = rl_step.teacher_optimizer(optim.build_optimizer(cfg, ocfg, meshes), r)
  state = train_state.abstract_state(cfg, tx, meshes)
  step = step_lib.make_step(
    rl_step.loss_fn(cfg, LossSettings.of(r), meshes), tx, cfg, schedule=optim.lr_schedule(ocfg),
    meshes=meshes, state_sharding=jax.tree.map(lambda x: x.sharding, state),
    router_bias_rate=r.router_bias_rate,
  )  # fmt: skip
  rows, cols = rollout.rl_shape(r)
  grid = {k: ((rows, cols), np.int32) for k in ("tokens", "positions", "segment_ids")}
  grid |= {k: ((rows, cols), np.float32) for k in ("loss_mask", "sampler_logprobs")}
  per_row = {"rewards": ((rows,), np.float32), "group_ids": ((rows,), np.int32)}
  n = rows // (micro_rows or rows)
  batch = rl_batch.RLBatch(**_abstract_batch(grid | per_row, meshes), micro_batches=n)
  if r.lambda_feedback > 0:
    F, N, L = rollout.feedback_shape(r)
    F = n * -(-F // n)
    fb = {k: ((F,), np.int32) for k in ("fb_rows", "teacher_lengths", "hint_start")}
    fb |= {"teacher_tokens": ((F, L), np.int32), "fb_cols": ((F, N), np.int32)}
    fb |= {"teacher_cols": ((F, N), np.int32), "fb_mask": ((F, N), np.float32)}
    batch = batch.replace(feedback=rl_batch.FeedbackBatch(**_abstract_batch(fb, meshes)))
  return step.lower(state, batch)


def lower_decode_step(config: configs.Config, meshes: sharding.Meshes) -> jax.stages.Lowered:
  """One token of the sampler's decode loop as the rl stage's engine runs it (`rl.sampler._feed`): every
  rollout row (problems_per_step × group_size) feeds its last sampled token through the policy's weights
  (the training state's params and shardings) against a full latent cache of rl.cache_len slots, whose
  rows are split over the dense mesh (`sharding.cache_shardings`); the cache is updated in place (donated, as
  it is the decode loop's carried state) and the next token's logits come back."""
  from composer_jax.rl import sampler  # noqa: PLC0415

  cfg, r = config.model, config.rl
  rows, _ = rollout.rl_shape(r)
  params = train_state.abstract_params(cfg, meshes)
  cache = jax.eval_shape(lambda: model.init_cache(cfg, rows, r.cache_len))
  where = sharding.cache_shardings(cache, meshes, decode=True)
  cache = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=where[k]) for k, v in cache.items()}
  tokens = jax.ShapeDtypeStruct((rows, 1), np.int32, sharding=sharding.batch_sharding((rows, 1), meshes))
  lengths = jax.ShapeDtypeStruct((rows,), np.int32, sharding=sharding.batch_sharding((rows,), meshes))
  dcfg = sampler.decode_config(cfg)

  def step(params, cache, tokens, lengths):
    return sampler.extend(params, dcfg, cache, tokens, lengths, meshes=meshes)

  return jax.jit(step, donate_argnums=1).lower(params, cache, tokens, lengths)


STEPS = {"train": lower_train_step, "rl": lower_rl_step, "decode": lower_decode_step}

# Ops of the Muon update carry these named scopes (optim/muon.py): their share of the step's time.
MUON_SCOPES = {"muon": r"muon_group\d+|newton_schulz"}


def model_flops(cfg: model.ModelConfig, batch: int, seq: int) -> float:
  """Training FLOPs of one step by the usual count: 6 · active params (`pretrain.active_params`) · tokens,
  plus causal attention, 3 (forward + backward) · T²/2 · heads · (qk + v head dims) · 2 per layer and
  sequence (PaLM appendix B, halved for the causal mask)."""
  attention = 3 * seq * seq * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) * cfg.n_layers
  return 6.0 * pretrain.active_params(cfg) * batch * seq + float(attention) * batch


def analyse(
  compiled: jax.stages.Compiled, device_kind: str = "TPU v5", scopes: dict[str, str] | None = None
) -> dict[str, Any]:
  """XLA's per-device memory, FLOPs (corrected for loop trip counts), collective counts and the cost
  model's estimate (`plan.estimate.estimate`) of a compiled step."""
  mem = compiled.memory_analysis()
  out = {
    "argument": int(mem.argument_size_in_bytes),
    "output": int(mem.output_size_in_bytes),
    "alias": int(mem.alias_size_in_bytes),
    "temp": int(mem.temp_size_in_bytes),
  }
  out["peak"] = out["argument"] + out["temp"] + out["output"] - out["alias"]
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  hlo = compiled.as_text()
  est = estimate.estimate(hlo, cost, device_kind, scopes)
  return {"memory": out, "flops_per_device": est["flops"], "collectives": collectives(hlo), "estimate": est}


_OOM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")


def _compile(lowered: jax.stages.Lowered) -> tuple[Any, dict[str, Any] | None]:
  """(compiled, None), or (None, {"error": ..., "temp": bytes}) when XLA gives up for lack of HBM:
  XLA:TPU refuses a program whose temporaries exceed the chip ("RESOURCE_EXHAUSTED: Ran out of memory
  on HBM, the total memory required for HLO temporaries (3.68T) exceeds available HBM (95.74G)")."""
  try:
    return lowered.compile(), None
  except jax.errors.JaxRuntimeError as e:
    message = str(e)
    if "RESOURCE_EXHAUSTED" not in message:
      raise
    found = _OOM.search(message)
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    temp = int(float(found.group(1)) * scale[found.group(2)]) if found else None
    return None, {"error": message.strip().splitlines()[-1][:300], "temp": temp}


def _add_mfu(est: dict[str, Any], config: configs.Config, devices: int) -> None:
  """Model FLOPs per device and MFU at the estimated step time (the train step only: the RL step's
  work is not 6 · N · tokens)."""
  est["muon_seconds"] = est["scope_seconds"].get("muon", 0.0)
  if config.compile.step == "decode":  # one token for every rollout row
    (rows, _), seconds = rollout.rl_shape(config.rl), est["step_seconds"]
    est["tokens_per_second"] = rows / seconds if seconds > 0 else None
  if config.compile.step != "train":
    est["model_flops_per_device"] = est["mfu"] = None
    return
  per_device = model_flops(config.model, config.train.batch_size, config.train.seq_len) / devices
  est["model_flops_per_device"] = per_device
  est["compiled_over_model_flops"] = est["flops"] / per_device
  seconds = est["step_seconds"]
  est["mfu"] = per_device / (est["peak_flops"] * seconds) if seconds > 0 else None


def compile_config(config: configs.Config, devices: list[jax.Device]) -> dict[str, Any]:
  """Lowers and compiles `config.compile.step` on `devices`; the analysis next to the plan's."""
  meshes = sharding.build_meshes(config.mesh.dense, config.mesh.expert, devices)
  lower = STEPS[config.compile.step]
  t0, cpu0 = time.perf_counter(), time.process_time()
  with backend.record_kernels() as kernels:
    lowered = lower(config, meshes)
  compiled, failure = _compile(lowered)
  seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
  tpu = devices[0].platform == "tpu"
  plan = core.make_plan(config, tpu=tpu)
  kind = devices[0].device_kind
  hbm = HBM_BYTES.get(kind) or plan.hbm_bytes
  result = {
    "variant": config.variant,
    "step": config.compile.step,
    "devices": len(devices),
    "device_kind": kind,
    "backend": {k: sorted(v) for k, v in kernels.items()},  # the kernels the traced step runs
  }
  # wall time, and CPU time of all this process's threads (a loaded host stretches the wall time)
  result |= {"compile_seconds": seconds, "compile_cpu_seconds": cpu_seconds}
  if failure is None:
    result |= analyse(compiled, kind, MUON_SCOPES)
    result["fits"] = result["memory"]["peak"] <= hbm if hbm else None
    _add_mfu(result["estimate"], config, len(devices))
  else:  # XLA's own verdict: too big for the chip; only its temporaries are known
    result |= {"memory": {"temp": failure["temp"]}, "fits": False, "error": failure["error"]}
  result["hbm_bytes"] = hbm
  if config.compile.step == "train":
    result |= {"plan": plan.xla, "biggest_plan_terms": report.biggest_terms(plan)}
  else:  # the planner's RL-step and decode-step models (plan/rollout.py)
    other = {"rl": rollout.rl_step, "decode": rollout.decode_step}[config.compile.step](config, tpu=tpu)
    terms = sorted(other["terms"].items(), key=lambda kv: -kv[1])
    result |= {"plan": other["xla"], "plan_terms": other["terms"], "biggest_plan_terms": terms[:3]}
  return result


def run(config: configs.Config, workdir: str) -> dict[str, Any]:
  """The `compile` stage body: compiles for `config.compile.topology`, logs a table (also returned
  under "report"), writes `<workdir>/compile.json` and returns it. A step that does not fit is a result
  (`fits: false`, one line with its biggest items and the knob to turn), also when XLA refuses it."""
  config = configs.from_config(config)
  c = config.compile
  if c.step not in STEPS:
    raise ValueError(f"compile.step={c.step!r}: must be one of {', '.join(STEPS)}.")
  devices = topology_devices(c.topology, c.num_slices)
  result = {"topology": c.topology, "num_slices": c.num_slices} | compile_config(config, devices)
  if "error" in result:  # XLA refused the program: only its temporaries are known
    lines = [f"compile {config.variant} on {c.topology}: {result['error']}"]
  else:
    lines = [report.format_compile(result)]
  if result["fits"] is False:
    temp = result["memory"]["temp"] or 0
    items = [("temp", temp)] + [tuple(t) for t in result["biggest_plan_terms"]]
    lines.append(
      report.does_not_fit(
        result["memory"].get("peak", temp), result["hbm_bytes"], items, remat=config.model.remat, step=c.step
      )
    )
  result["report"] = "\n".join(lines)
  logging.info("%s", result["report"])
  if result["fits"] is False:
    logging.warning("%s", lines[-1])
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / "compile.json").write_text(json.dumps(result, indent=1))
  return result
