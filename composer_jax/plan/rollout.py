"""The planner's view of the two RL programs the `compile` stage builds besides the pretraining step:
the RL step (`compile.step=rl`) and one sampler decode step (`compile.step=decode`).

Each returns the prediction of XLA's `memory_analysis()` fields (`argument`, `output`, `alias`, `temp`,
`peak`) per device, as `Plan.xla` does for the pretraining step, plus the terms it was built from.

- RL step: the pretraining step's model (`core.make_plan`) at the RL batch, problems_per_step ×
  group_size rows of the padded rollout length, plus what RL adds to the state: the frozen or EMA
  teacher's copy of the parameters in the optimizer state (`rl.step.teacher_optimizer`) and the RL
  batch's fields. Its temporaries are the pretraining step's at that shape: the teacher's forward and
  the divergence are not modelled yet (benchmarks/RESULTS.md says by how much that is off).
- Decode step: parameters and the latent cache as arguments, the cache aliased to the output (updated in
  place). Temporaries: the LM head gathered whole in the compute dtype for the [rows, V] logits, next
  to the local shard's cast (read off XLA:TPU's buffer assignment of the moonlight_16b decode step: the
  head is the largest buffer; each layer's weights are cast and gathered one stack at a time, smaller).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from composer_jax import configs, model, sharding
from composer_jax.plan import core
from composer_jax.plan.layout import derive_layout, leaves, tpu_bytes

_RL_GRID_FIELDS = 5  # tokens, positions, segment_ids (int32), loss_mask, sampler_logprobs (float32)


def rl_shape(rcfg: configs.RLConfig) -> tuple[int, int]:
  """(rows, columns) of the RL step's batch as the compile stage lowers it."""
  from composer_jax.rl.batch import bucket  # noqa: PLC0415  (the RL package is large)

  return rcfg.problems_per_step * rcfg.group_size, bucket(rcfg.cache_len, 64)


def _nbytes(shape: tuple[int, ...], dtype: Any, tpu: bool) -> int:
  return tpu_bytes(shape, dtype) if tpu else math.prod(shape) * np.dtype(dtype).itemsize


def rl_step(config: configs.Config, *, tpu: bool = False) -> dict[str, Any]:
  """Predicted memory_analysis fields of the RL step, with its terms."""
  r = config.rl
  rows, cols = rl_shape(r)
  train = dataclasses.replace(config.train, batch_size=rows, seq_len=cols, grad_accum=1)
  plan = core.make_plan(dataclasses.replace(config, train=train), tpu=tpu)
  teacher = sum(plan.memory[m]["params"] for m in ("dense", "expert")) if r.teacher != "live" else 0
  split = sharding.degrees(sharding.abstract_meshes(config.mesh.dense, config.mesh.expert))
  grid = _RL_GRID_FIELDS * rows * cols * 4 // (split.batch * split.seq)
  state = plan.xla["output"] + teacher
  temp = plan.xla["temp"]
  xla = {"argument": state + grid, "output": state, "alias": state, "temp": temp, "peak": state + grid + temp}
  terms = {"train_state": plan.xla["output"], "teacher": teacher, "batch": grid, "train_step_temp": temp}
  return {"xla": xla, "terms": terms}


def decode_step(config: configs.Config, *, tpu: bool = False) -> dict[str, Any]:
  """Predicted memory_analysis fields of one decode step (`plan.compile.lower_decode_step`)."""
  cfg, r = config.model, config.rl
  rows, _ = rl_shape(r)
  meshes = sharding.abstract_meshes(config.mesh.dense, config.mesh.expert)
  cache = jax.eval_shape(lambda: model.init_cache(cfg, rows, r.cache_len))
  where = sharding.cache_shardings(cache, meshes, decode=True)
  cache_bytes = sum(_nbytes(tuple(where[k].shard_shape(v.shape)), v.dtype, tpu) for k, v in cache.items())
  layout = derive_layout(config.mesh.dense, config.mesh.expert, None, cfg.n_experts)
  params = sum(p.local_bytes(tpu) for p in leaves(cfg, layout))
  a = np.dtype(cfg.dtype).itemsize
  fsdp = sharding.degrees(meshes).fsdp
  head = cfg.vocab_size * cfg.d_model * a
  rows_local = max(rows // sharding.degrees(meshes).batch, 1)
  terms = {
    "params": params,
    "cache": cache_bytes,
    "head_gathered": head,
    "head_local_cast": head // fsdp if cfg.dtype != cfg.param_dtype else 0,
    "logits": rows_local * cfg.vocab_size * 4 * 2,  # fp32 logits and their log-softmax
  }
  temp = terms["head_gathered"] + terms["head_local_cast"] + terms["logits"]
  out = cache_bytes
  xla = {"argument": params + cache_bytes, "output": out, "alias": out, "temp": temp}
  xla["peak"] = params + cache_bytes + temp
  return {"xla": xla, "terms": terms}
