"""The planner's view of the two RL programs the `compile` stage builds besides the pretraining step:
the RL step (`compile.step=rl`) and one sampler decode step (`compile.step=decode`).

Each returns the prediction of XLA's `memory_analysis()` fields (`argument`, `output`, `alias`, `temp`,
`peak`) per device, as `Plan.xla` does for the pretraining step, plus the terms it was built from.

- RL step: the pretraining step's model (`core.make_plan`) at the RL batch, problems_per_step ×
  group_size rows of the padded rollout length, plus what RL adds. State: the frozen or EMA teacher's
  copy of the parameters in the optimizer state (`rl.step.teacher_optimizer`) and the RL batch's fields.
  Temporaries: pretraining's backward pass and update, with two phases of its own in place of the
  pretraining loss (read off XLA:TPU's buffer assignment and live ranges of both variants' RL steps):
  "loss", the student's fp32 log-softmax next to the compute-dtype logits ([n, V] each, n tokens per
  device), the LM head gathered whole for them, and the teacher's scores of the flagged tokens [F, N, V]
  (fp32), kept for the divergence; "teacher", the frozen teacher's forward over its rows: its compute-
  dtype weights, the latent cache it encodes the rollout prefix into, the fp32 scores and probabilities
  of that prefix against the cache, and its fp32 logits over the hint + turn [F, L, V].
- Decode step: parameters and the latent cache as arguments, the cache aliased to the output (updated in
  place). Temporaries, the larger of two phases (read off XLA:TPU's buffer assignments of both variants'
  decode steps): the head, the LM head gathered whole in the compute dtype for the [rows, V] logits next
  to the local shard's cast (Moonlight's peak); the layers, every stack's local weights cast to the
  compute dtype at once, which XLA hoists out of the layer loop (Kimi's peak).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from composer_jax import configs, model, sharding
from composer_jax.model.attention_kernels import chunk_count
from composer_jax.plan import core
from composer_jax.plan.layout import derive_layout, leaves, tpu_bytes

_RL_GRID_FIELDS = 5  # tokens, positions, segment_ids (int32), loss_mask, sampler_logprobs (float32)


def rl_shape(rcfg: configs.RLConfig) -> tuple[int, int]:
  """(rows, columns) of the RL step's batch as the compile stage lowers it."""
  from composer_jax.rl.batch import padded_length  # noqa: PLC0415  (the RL package is large)

  return rcfg.problems_per_step * rcfg.group_size, padded_length(rcfg.cache_len, 64, rcfg.batch_multiple)


def _nbytes(shape: tuple[int, ...], dtype: Any, tpu: bool) -> int:
  return tpu_bytes(shape, dtype) if tpu else math.prod(shape) * np.dtype(dtype).itemsize


def feedback_shape(rcfg: configs.RLConfig) -> tuple[int, int, int]:
  """(F teacher rows, N flagged-turn tokens, L teacher tokens = hint + turn) of the RL step's feedback
  branch as the compile stage lowers it: a hint of up to 64 tokens, then the turn."""
  from composer_jax.rl.batch import bucket  # noqa: PLC0415

  rows, _ = rl_shape(rcfg)
  n = bucket(rcfg.max_turn_tokens, 16)
  return rcfg.feedback_rows or rows, n, bucket(64 + n, 64)


def rl_phases(config: configs.Config, plan: core.Plan, rows: int, cols: int) -> dict[str, dict[str, int]]:
  """The RL step's own live temporaries (bytes per device) for micro-batches of `rows` rollouts of `cols`
  tokens: its loss and the teacher's forward. Without remat the teacher runs while the student's
  residuals are live (they are the "passes" phase's)."""
  cfg, r = config.model, config.rl
  deg = plan.layout.degrees
  a, v, d = np.dtype(cfg.dtype).itemsize, cfg.vocab_size, cfg.d_model
  n = rows * (cols // chunk_count(cols, cfg.loss_chunk)) // (deg.batch * deg.seq)  # logits live at once
  if "head" in plan.phases:
    kept = {
      k: plan.phases["head"][k] for k in ("saved_for_backward", "parameter_casts") if k in plan.phases["head"]
    }
  else:
    kept = {"residuals": plan.phases["passes"]["residuals"]}
  loss = kept | {"lm_head_gathered": v * d * a if deg.fsdp > 1 else 0, "logits": n * v * (a + 4)}
  if r.lambda_feedback <= 0:
    return {"loss": loss}
  f, big_n, big_l = feedback_shape(r)
  n_micro = max(rl_shape(r)[0] // rows, 1)
  per_micro = math.ceil(f / n_micro)  # teacher rows per micro-batch (`rl.batch.micro_batched`)
  f_local = math.ceil(per_micro / deg.batch)
  loss["teacher_scores"] = f_local * big_n * v * 4
  slots = cols + big_l
  q_rows = cols // chunk_count(cols, cfg.attention_chunk)  # the teacher's prefix queries at once
  teacher = kept | {
    "weights": plan.phases.get("head", {}).get("parameter_casts", 0),  # its params, cast like the student's
    "cache": f_local * slots * cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * a,
    "prefix_scores": 2 * f_local * (q_rows // deg.seq) * cfg.n_heads * slots * 4,
    "logits": f_local * big_l * v * 4,
  }
  return {"loss": loss, "teacher": teacher}


def rl_step(
  config: configs.Config,
  *,
  tpu: bool = False,
  micro_rows: int | None = None,
  cols: int | None = None,
  rows: int | None = None,
) -> dict[str, Any]:
  """Predicted memory_analysis fields of the RL step, with its terms: `rows` rollouts (default
  problems_per_step × group_size) padded to `cols` tokens (default: the longest, `rl_shape`), updated in
  micro-batches of `micro_rows` rollouts (default: one pass)."""
  r = config.rl
  configured, longest = rl_shape(r)
  rows = rows or configured
  cols = cols or longest
  micro = micro_rows or rows
  train = dataclasses.replace(config.train, batch_size=rows, seq_len=cols, grad_accum=rows // micro)
  plan = core.make_plan(dataclasses.replace(config, train=train), tpu=tpu)
  teacher = sum(plan.memory[m]["params"] for m in ("dense", "expert")) if r.teacher != "live" else 0
  split = plan.layout.degrees
  grid = _RL_GRID_FIELDS * rows * cols * 4 // (split.batch * split.seq)
  phases = {k: t for k, t in plan.phases.items() if k != "head"} | rl_phases(config, plan, micro, cols)
  temp = core.heap_bytes(phases, config.model, tpu)
  state = plan.xla["output"] + teacher
  xla = {"argument": state + grid, "output": state, "alias": state, "temp": temp, "peak": state + grid + temp}
  live = {f"{name}_live": sum(t.values()) for name, t in phases.items()}
  terms = {"train_state": plan.xla["output"], "teacher": teacher, "batch": grid} | live
  return {"xla": xla, "terms": terms, "phases": phases}


def decode_step(config: configs.Config, *, tpu: bool = False) -> dict[str, Any]:
  """Predicted memory_analysis fields of one decode step (`plan.compile.lower_decode_step`)."""
  cfg, r = config.model, config.rl
  rows, _ = rl_shape(r)
  meshes = sharding.abstract_meshes(config.mesh.dense, config.mesh.expert)
  cache = jax.eval_shape(lambda: model.init_cache(cfg, rows, r.cache_len))
  where = sharding.cache_shardings(cache, meshes, decode=True)
  cache_bytes = sum(_nbytes(tuple(where[k].shard_shape(v.shape)), v.dtype, tpu) for k, v in cache.items())
  layout = derive_layout(config.mesh.dense, config.mesh.expert, None, cfg.n_experts)
  layer_leaves = leaves(cfg, layout)
  params = sum(p.local_bytes(tpu) for p in layer_leaves)
  a = np.dtype(cfg.dtype).itemsize
  cast = cfg.dtype != cfg.param_dtype
  fsdp = sharding.degrees(meshes).fsdp
  head = cfg.vocab_size * cfg.d_model * a
  rows_local = max(rows // sharding.degrees(meshes).batch, 1)
  terms = {
    "params": params,
    "cache": cache_bytes,
    "head_gathered": head,
    "head_local_cast": head // fsdp if cast else 0,
    "logits": rows_local * cfg.vocab_size * 4 * 2,  # fp32 logits and their log-softmax
    "stack_casts": sum(p.local_size for p in layer_leaves if p.stack) * a if cast else 0,
  }
  temp = max(terms["head_gathered"] + terms["head_local_cast"] + terms["logits"], terms["stack_casts"])
  out = cache_bytes
  xla = {"argument": params + cache_bytes, "output": out, "alias": out, "temp": temp}
  xla["peak"] = params + cache_bytes + temp
  return {"xla": xla, "terms": terms}
