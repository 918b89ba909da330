"""What only a GPU can measure, in one prepared run (issue 33): ≤ 8 minutes on one H100/H200, one JSON.

  python benchmarks/device_check.py --out=device_check.json            # on the GPU machine
  python benchmarks/device_check.py --dry_run --out=<tmp>/dry.json     # CPU, tiny shapes, seconds

Sections (each records its own error and the run goes on, so one unsupported kernel costs one entry):
- `train`: forward + backward (`value_and_grad` of the next-token loss, no optimizer) of a
  moonlight_16b-shaped model cut to 2 layers (1 dense + 1 MoE: d 2048, 16 heads MLA without q-LoRA,
  64 experts top-6 + 2 shared, vocab 163,840, bf16 compute, fp32 params), for attention ∈ {xla, cudnn}
  × experts ∈ {ragged (`jax.lax.ragged_dot`), tokamax (grouped matmul kernel)}: tokens/s (median of
  --steps timed steps after one compile-and-warm-up step) and MFU = model FLOPs
  (`plan.compile.model_flops`: 6 · active params · tokens + causal attention) ÷ time ÷ the card's bf16
  dense peak (`PEAK_FLOPS`).
- `attention_parity`: logits and gradients of the same model and batch with attention "cudnn" vs
  "xla": max |Δ| relative to max |xla| (bf16 compute on both).
- `newton_schulz`: `optim.newton_schulz.orthogonalize` (5 quintic steps, bf16) on a stack of Kimi K2.5
  routed-expert matrices (2048 × 7168): TFLOP/s by `newton_schulz.flops`.
- `decode`: `rl.sampler.sample` with the 2-layer model (prefill + --new_tokens sampled tokens per row,
  one compiled loop): generated tokens/s over the whole call after a compile call.
--budget_s (default 420) starts no section past that many seconds, so the run stays within 8 minutes
on one card; the parity check reuses the train section's compiled steps.
--dry_run swaps in tiny widths (d 64, 4 experts, vocab 256, 2 × 32 tokens) so CPU finishes in seconds;
sections needing a GPU kernel (cudnn) record their error there. tests/test_device_check.py runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from composer_jax import model  # noqa: E402
from composer_jax.optim import newton_schulz  # noqa: E402
from composer_jax.plan.compile import model_flops  # noqa: E402
from composer_jax.rl import sampler as rl_sampler  # noqa: E402
from composer_jax.train import losses  # noqa: E402

# bf16 dense FLOP/s (no sparsity) by device_kind substring: NVIDIA H100 / H200 SXM data sheets.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
# Gpu shapes: (batch, seq) of the train step, decode (batch, prompt, new tokens), NS stack.
GPU = {"batch": 4, "seq": 2048, "decode": (32, 128, 128), "ns": (16, 2048, 7168)}
DRY = {"batch": 2, "seq": 32, "decode": (2, 8, 8), "ns": (2, 16, 56)}
TINY_WIDTHS = dict(
  vocab_size=256, d_model=64, n_heads=2, dense_mlp_dim=128, moe_mlp_dim=32, n_experts=4, top_k=2,
  n_shared_experts=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
)  # fmt: skip


def moonlight_2_layers(dry_run: bool) -> model.ModelConfig:
  """experiments/composer25.py:moonlight_16b's model with 2 layers (tiny widths for --dry_run)."""
  path = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "composer25.py"
  )
  spec = importlib.util.spec_from_file_location("composer25", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.moonlight_16b().model
  cfg = dataclasses.replace(cfg, n_layers=2, remat="none", scan_layers=False)
  return dataclasses.replace(cfg, **TINY_WIDTHS) if dry_run else cfg


def _timed(fn, steps: int) -> tuple[float, float]:
  """(seconds of the first call: compile + run, median seconds of `steps` further calls)."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - start
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return first, statistics.median(times)


def _batch(cfg: model.ModelConfig, batch: int, seq: int) -> jax.Array:
  return jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)


@functools.cache  # the parity check reuses the train section's compiled steps
def _grad_fn(cfg: model.ModelConfig):
  def loss(params, tokens):
    logits, _ = model.apply(params, cfg, tokens)
    total, count = losses.next_token_loss(logits, tokens, jnp.ones_like(tokens))
    return total / count

  return jax.jit(jax.value_and_grad(loss))


def train(cfg, params, shapes: dict, steps: int, peak: float | None) -> dict:
  """tokens/s and MFU of forward + backward per (attention, experts) pair."""
  tokens = _batch(cfg, shapes["batch"], shapes["seq"])
  flops = model_flops(cfg, shapes["batch"], shapes["seq"])
  out = {}
  for attention in ("xla", "cudnn"):
    for experts in ("ragged", "tokamax"):
      run_cfg = dataclasses.replace(cfg, attention_impl=attention, expert_impl=experts)
      step = _grad_fn(run_cfg)

      def one(step=step):
        return step(params, tokens)

      out[f"{attention}+{experts}"] = _section(lambda one=one: _rate(one, steps, tokens.size, flops, peak))
  return out


def _rate(fn, steps: int, n_tokens: int, flops: float, peak: float | None) -> dict:
  first, seconds = _timed(fn, steps)
  mfu = flops / seconds / peak if peak else None
  return {"first_call_s": first, "step_s": seconds, "tokens_per_s": n_tokens / seconds, "mfu": mfu}


def attention_parity(cfg, params, shapes: dict) -> dict:
  """cudnn vs xla attention: logits and gradients, max |Δ| ÷ max |xla|."""
  tokens = _batch(cfg, shapes["batch"], shapes["seq"])
  results = {}
  for impl in ("xla", "cudnn"):
    run_cfg = dataclasses.replace(cfg, attention_impl=impl, expert_impl="ragged")
    logits = jax.jit(lambda p, t, c=run_cfg: model.apply(p, c, t)[0])(params, tokens)
    _, grads = _grad_fn(run_cfg)(params, tokens)
    results[impl] = (
      np.asarray(logits, np.float32),
      [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)],
    )
  (lx, gx), (lc, gc) = results["xla"], results["cudnn"]
  rel = lambda a, b: float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))  # noqa: E731
  return {
    "logits_rel_err": rel(lx, lc),
    "grads_rel_err_max": max(rel(a, b) for a, b in zip(gx, gc, strict=True)),
  }


def ns_rate(shape: tuple[int, int, int], steps: int, peak: float | None) -> dict:
  """Newton–Schulz on a [N, M, K] bf16 stack of expert matrices: TFLOP/s and the fraction of peak."""
  n, m, k = shape
  coeffs, scale = newton_schulz.coefficients("quintic", 5)
  x = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
  fn = jax.jit(lambda x: newton_schulz.orthogonalize(x, coeffs, scale))
  first, seconds = _timed(lambda: fn(x), steps)
  flops = n * newton_schulz.flops(m, k, 5)
  rate = {"tflop_per_s": flops / seconds / 1e12, "of_peak": flops / seconds / peak if peak else None}
  return {"shape": list(shape), "first_call_s": first, "seconds": seconds} | rate


def decode(cfg, params, shape: tuple[int, int, int], steps: int) -> dict:
  """Generated tokens/s of `rl.sampler.sample` (prefill + sampling loop), after one compile call."""
  batch, prompt, new = shape
  prompts = _batch(cfg, batch, prompt)
  lengths = jnp.full((batch,), prompt, jnp.int32)

  def rollout():
    return rl_sampler.sample(params, cfg, prompts, lengths, jax.random.key(3), max_new_tokens=new).tokens

  first, seconds = _timed(rollout, steps)
  return {
    "shape": [batch, prompt, new],
    "first_call_s": first,
    "seconds": seconds,
    "tokens_per_s": batch * new / seconds,
  }


_DEADLINE = [float("inf")]  # perf_counter() past which sections are skipped (--budget_s)


def _section(fn) -> dict:
  if time.perf_counter() > _DEADLINE[0]:
    return {"error": "skipped: past --budget_s"}
  try:
    return fn()
  except Exception as e:  # noqa: BLE001  (a kernel missing on this platform is a result, not a crash)
    return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
            "where": traceback.format_exc().strip().splitlines()[-3][:200]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON to write")
  p.add_argument("--dry_run", action="store_true", help="tiny shapes on any backend (CPU: seconds)")
  p.add_argument("--steps", type=int, default=None, help="timed calls per figure (default 5; dry run 1)")
  p.add_argument("--budget_s", type=float, default=420.0, help="start no section after this many seconds")
  args = p.parse_args(argv)
  shapes, steps = (DRY, 1) if args.dry_run else (GPU, 5)
  steps = args.steps or steps
  device = jax.devices()[0]
  peak = next((v for k, v in PEAK_FLOPS.items() if k in device.device_kind), None)
  cfg = moonlight_2_layers(args.dry_run)
  params = model.init(cfg, jax.random.key(0))
  t0 = time.perf_counter()
  _DEADLINE[0] = t0 + args.budget_s
  result = {
    "device": device.device_kind,
    "platform": device.platform,
    "jax": jax.__version__,
    "peak_flops": peak,
  }
  result |= {
    "dry_run": args.dry_run,
    "shapes": {k: list(v) if isinstance(v, tuple) else v for k, v in shapes.items()},
  }
  result["train"] = train(cfg, params, shapes, steps, peak)
  result["attention_parity"] = _section(lambda: attention_parity(cfg, params, shapes))
  result["newton_schulz"] = _section(lambda: ns_rate(shapes["ns"], steps, peak))
  result["decode"] = _section(lambda: decode(cfg, params, shapes["decode"], steps))
  result["seconds"] = time.perf_counter() - t0
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
