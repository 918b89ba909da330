"""The scale planner against XLA's compiled memory analysis, hand-computed collectives, mesh derivation.

One compile: the tiny variant's real train step, built by the compile stage's own code
(`plan.compile.compile_config`: `train.step.make_step` with `optim.build_optimizer`, lowered from
abstract state) on the 8 CPU devices; the persistent compilation cache makes reruns cheap. The same
comparison on XLA:TPU is tests/test_compile.py.
"""

import dataclasses
import importlib.util
import json
import math
import pathlib

import jax
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers

from composer_jax import configs, model, optim, plan, sharding
from composer_jax.model.config import ModelConfig
from composer_jax.optim import muon as muon_lib
from composer_jax.optim import newton_schulz
from composer_jax.plan import compile as compile_stage

_EXPERIMENT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "composer25.py"


def _config_dict(variant: str):
  spec = importlib.util.spec_from_file_location("composer25", _EXPERIMENT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def _config(variant: str) -> configs.Config:
  return configs.from_config(_config_dict(variant))


@pytest.fixture(scope="module")
def tiny_compiled():
  """The compile stage's result for the tiny variant on XLA:CPU (8 devices)."""
  return compile_stage.compile_config(_config("tiny"), jax.devices())


def test_memory_matches_xla_memory_analysis(tiny_compiled):
  """Per-device plan (`Plan.xla`) vs XLA:CPU's buffer assignment of the tiny train step, each within 10%.

  plan quantity                                        memory_analysis field
  params + optimizer state + step + batch          ↔   argument_size_in_bytes
  params + optimizer state + step                  ↔   alias_size_in_bytes (the donated state)
  params + optimizer state + step                  ↔   output_size_in_bytes (+ ~1 KB of metrics)
  max(forward residuals, update buffers)           ↔   temp_size_in_bytes

  Why the residuals are the temp: the step's peak is the end of the forward pass (all residuals
  live, no gradient yet). XLA copies the donated state into temp buffers and reuses the argument
  buffers as scratch, which cancels; what remains is the residuals plus heap fragmentation.
  """
  mem, predicted = tiny_compiled["memory"], tiny_compiled["plan"]
  report = {k: (predicted[k], mem[k], predicted[k] / mem[k]) for k in ("argument", "alias", "output", "temp")}
  print(json.dumps(report, indent=1))
  for name, (plan_b, xla_b, ratio) in report.items():
    assert abs(ratio - 1) <= 0.10, f"{name}: plan {plan_b} vs XLA {xla_b} bytes (ratio {ratio:.3f})"
  assert tiny_compiled["collectives"].get("all-to-all", 0) > 0  # EP dispatch and Muon really communicate


def _leaf(shape, axes, layout) -> plan.Leaf:
  """A float32 Muon matrix (reduction axis 0, output axis 1) placed by the codebase's rules."""
  where = sharding.param_sharding(axes, layout.meshes(), shape)
  return plan.Leaf("w", shape, np.dtype(np.float32), axes, where, "muon", MuonDimensionNumbers(0, 1))


def test_collectives_small_case_by_hand():
  """One fp32 [8, 16] dense matrix on dense (replica=2, fsdp=2, context=1): rows split over fsdp."""
  layout = plan.Layout((2, 2, 1), (4, 1))
  w = _leaf((8, 16), ("embed", "mlp"), layout)
  assert w.local_size == 4 * 16
  cfg = ModelConfig(n_layers=1, first_k_dense=1)  # no MoE layer: no expert traffic
  rows = {"received_rows": 0, "assignments": 0}
  got = plan.collective_bytes(cfg, layout, [w], grad_accum=1, rows=rows)
  full = 8 * 16 * 4
  assert got["fsdp_all_gather"] == full // 2  # ring: (2-1)/2 of the gathered matrix, forward only
  assert got["fsdp_reduce_scatter"] == full // 2
  assert got["hsdp_all_reduce"] == 2 * (full // 2) // 2  # 2·(r-1)/r of the local shard, r = 2 replicas
  remat = plan.collective_bytes(dataclasses.replace(cfg, remat="full"), layout, [w], 1, rows)
  assert remat["fsdp_all_gather"] == full  # gathered again for the recomputed forward
  accum = plan.collective_bytes(cfg, layout, [w], grad_accum=3, rows=rows)
  assert accum["hsdp_all_reduce"] == 3 * got["hsdp_all_reduce"]

  # Sharded Muon, 1 matrix: rows over fsdp (2 devices), too few matrices for the 2 replica copies to
  # split ⇒ padded to 2 local [2, 8/2, 16] stacks; all-to-all over fsdp there and back (1/2 each way);
  # every device orthogonalises 1 whole matrix (its replica twin the same one); no all-gather.
  m = plan.muon_work([w], ns_steps=5)
  stack = 2 * 4 * 16 * 4
  assert m["largest_group_stack_bytes"] == stack
  assert m["all_to_all_bytes"] == 2 * stack // 2
  assert m["all_gather_bytes"] == m["all_reduce_bytes"] == 0
  assert m["ns_flops_per_device"] == m["ns_flops_total"] == newton_schulz.flops(8, 16, 5)
  # 4 matrices: the 2 replicas split them. Each keeps its slice of 2, makes them whole by all-to-all
  # (1 of its 2 shards leaves, and comes back), orthogonalises 1 and all-gathers the other replica's
  # results: splitting costs no more bytes than recomputing (which would all-to-all all 4).
  w4 = dataclasses.replace(_leaf((4, 8, 16), (None, "embed", "mlp"), layout), dn=MuonDimensionNumbers(1, 2))
  m4 = plan.muon_work([w4], ns_steps=5)
  shard = 4 * 16 * 4
  assert m4["ns_flops_per_device"] == newton_schulz.flops(8, 16, 5)
  assert m4["all_to_all_bytes"] == 2 * (2 * shard) // 2
  assert m4["all_gather_bytes"] == 4 * shard // 2  # the other replica's half of the 4 results
  assert plan.muon_work([w4], ns_steps=5, ns_dtype="bfloat16")["all_gather_bytes"] == shard  # bf16: half
  # 8 per-head matrices, whole on their device (heads over fsdp): splitting them between the replicas
  # would save 4 NS of 25,600 FLOPs but send 1 KB (at 4,096 FLOPs per byte on an accelerator, 41× the
  # saving): both replicas orthogonalise their 4 heads, nothing is sent.
  heads = _leaf((16, 8, 8), ("q_lora", "heads", "head_dim"), layout)
  heads = dataclasses.replace(heads, dn=MuonDimensionNumbers(0, 2))
  mh = plan.muon_work([heads], ns_steps=5)
  assert mh["collective_bytes"] == 0
  assert mh["ns_flops_per_device"] == 4 * newton_schulz.flops(16, 8, 5)


def test_expert_all_to_all_of_the_tiny_variant_by_hand():
  """EP=8, 1 expert per device, 8·128 tokens over 8 devices: 128 tokens × top-2 = 256 assignments;
  "all_to_all" buffers hold 8 × ceil(256/8 · 4.0) = 1024 rows of D = 128 fp32 + an int32 id each,
  7/8 of which leave the device; dispatch + combine, forward + backward, 1 MoE layer."""
  p = plan.make_plan(_config("tiny"))
  one_way = 7 / 8 * 1024 * (128 * 4 + 4)
  assert p.collectives["ep_all_to_all"] == int(1 * 2 * 2 * one_way)


def test_derived_meshes_and_errors():
  assert plan.derive_layout((16, 16, 4), (128, 8), None, 384) == plan.Layout((16, 16, 4), (128, 8))
  lay = plan.derive_layout((16, 16, 4), (128, 8), 512, 384)
  assert (lay.dense, lay.expert, lay.derived) == ((8, 16, 4), (64, 8), True) and "derived" in lay.note
  with pytest.raises(ValueError, match="not a multiple of fsdp·context"):
    plan.derive_layout((16, 16, 4), (128, 8), 1000, 384)
  with pytest.raises(ValueError, match="n_experts=384 is not divisible by expert parallelism 256"):
    plan.derive_layout((16, 16, 4), (128, 8), 2048, 384)
  with pytest.raises(ValueError, match="cover different device counts"):
    plan.derive_layout((4, 1, 2), (4, 1), None, 8)
  config = _config_dict("moonlight_16b")
  config.train.batch_size = 32  # rows split over replica·fsdp = 64
  with pytest.raises(ValueError, match="not divisible by replica·fsdp"):
    plan.make_plan(config)


def _ideal_ns_flops(cfg: ModelConfig, steps: int) -> int:
  """Σ over Muon leaves of (matrices in the leaf) × NS FLOPs of one matrix (benchmarks/train_step.py)."""
  shapes = jax.tree.leaves(model.abstract_params(cfg))
  is_dn = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # noqa: E731
  total = 0
  for leaf, dn in zip(shapes, jax.tree.leaves(optim.dimension_numbers(cfg), is_leaf=is_dn), strict=True):
    if dn is not None:
      fan_in, fan_out = muon_lib.fans(leaf.shape, dn)
      total += math.prod(leaf.shape) // (fan_in * fan_out) * newton_schulz.flops(fan_in, fan_out, steps)
  return total


@pytest.mark.parametrize("variant,params_b", [("moonlight_16b", 15.96), ("kimi_k25_1t", 1026.4)])
def test_full_scale_plans_run(variant, params_b, tmp_path):
  config = _config_dict(variant)
  config.plan.devices = 512 if variant == "kimi_k25_1t" else None
  out = plan.run(configs.from_config(config), str(tmp_path))
  assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(json.dumps(out))
  assert out["params_total"] / 1e9 == pytest.approx(params_b, abs=0.01)
  cfg = configs.from_config(config).model
  m = out["muon"]
  assert m["ns_flops_total"] == _ideal_ns_flops(cfg, config.optim.ns_steps)
  devices = out["layout"]["dense"][0] * out["layout"]["dense"][1] * out["layout"]["dense"][2]
  assert m["ns_flops_per_device"] >= m["ns_flops_total"] / devices  # padding never helps
  assert m["ns_seconds"] == pytest.approx(m["ns_flops_per_device"] / float(config.train.peak_flops))
  assert out["peak_bytes"] > 0 and all(v >= 0 for v in out["collectives"].values())


def test_a_plan_that_does_not_fit_says_so_in_one_line(tmp_path, caplog):
  """A config over its budget is a result (fits: false), with one line naming the biggest items and
  the knob to turn."""
  config = _config_dict("moonlight_16b")
  config.plan.hbm_gib = 8.0
  with caplog.at_level("WARNING"):
    out = plan.run(configs.from_config(config), str(tmp_path))
  assert out["fits"] is False and out["hbm_bytes"] == int(8 * 2**30 * 0.75)  # jax's GPU preallocation
  lines = [r.getMessage() for r in caplog.records if "DOES NOT FIT" in r.getMessage()]
  assert len(lines) == 1 and "biggest:" in lines[0] and "to turn:" in lines[0], lines


def test_the_knob_offered_is_one_not_already_turned():
  """With remat already full the advice for activations is not "set remat='full'"; for the RL and decode
  steps it names the rollout batch."""
  from composer_jax.plan import report

  items = [("activations", 90 * 2**30), ("params", 2**30)]
  assert "model.remat='full'" in report.does_not_fit(100 * 2**30, 95 * 2**30, items, remat="none")
  full = report.does_not_fit(100 * 2**30, 95 * 2**30, items, remat="full")
  assert "set model.remat='full'" not in full and "train.grad_accum" in full, full
  rl = report.does_not_fit(100 * 2**30, 95 * 2**30, [("temp", 99 * 2**30)], remat="full", step="rl")
  assert "rl.problems_per_step" in rl and "grad_accum" not in rl, rl
