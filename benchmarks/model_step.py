"""Forward+backward tokens/s: our JAX model vs HF transformers DeepseekV3 (PyTorch eager), CPU.

  python benchmarks/model_step.py                         # ours fp32, ours bf16 compute, HF fp32
  python benchmarks/model_step.py --expert_impl=capacity --capacity_factor=1.25 --no_bf16

Same tiny DeepSeek config on both sides (d_model 256, 4 layers, 8 heads, 8 experts top-2, 1 shared,
vocab 1024, seq 256, batch 8, q_lora off), same weights (ours are exported to HF format), same loss
(next-token cross-entropy). Rounds alternate sides; each round times `--steps` steps after
warm-up; reports the median round. One device; each framework uses its default threads (both
use the 2 cores here).
bf16 compute keeps fp32 parameters and accumulates matmuls in fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from composer_jax import model  # noqa: E402

BENCH = model.ModelConfig(
  vocab_size=1024,
  d_model=256,
  n_layers=4,
  n_heads=8,
  dense_mlp_dim=512,
  moe_mlp_dim=512,
  n_experts=8,
  top_k=2,
  n_shared_experts=1,
  n_group=1,
  topk_group=1,
  first_k_dense=0,
  q_lora_rank=0,
  kv_lora_rank=64,
  qk_nope_head_dim=32,
  qk_rope_head_dim=16,
  v_head_dim=32,
  routed_scaling_factor=2.5,
)
BATCH, SEQ = 8, 256


def cross_entropy(logits_BTV, tokens_BT):
  logp = jax.nn.log_softmax(logits_BTV[:, :-1], axis=-1)
  return -jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1).mean()


def jax_step_fn(cfg):
  def loss(params, tokens):
    logits, _ = model.apply(params, cfg, tokens)
    return cross_entropy(logits, tokens)

  return jax.jit(jax.value_and_grad(loss))


def torch_step_fn(params, cfg, tmp):
  import torch
  import transformers

  from composer_jax.model import hf_import

  hf_import.save_hf_checkpoint(params, cfg, tmp)
  hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
    tmp, attn_implementation="sdpa", dtype=torch.float32
  )
  hf.train()

  def step(tokens):
    hf.zero_grad(set_to_none=True)
    logits = hf(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(
      logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    return loss

  return step


def time_round(fn, steps):
  start = time.perf_counter()
  for _ in range(steps):
    fn()
  return (time.perf_counter() - start) / steps


def jax_side(cfg, params, tokens):
  step = jax_step_fn(cfg)
  params = jax.tree.map(lambda x: x, params)
  tokens = jnp.asarray(tokens)

  def run():
    jax.block_until_ready(step(params, tokens))

  start = time.perf_counter()
  run()
  print(f"compiled jax {cfg.dtype} ({cfg.expert_impl}) in {time.perf_counter() - start:.1f}s", flush=True)
  return run


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--expert_impl", default=None, choices=["blocked", "ragged", "capacity"])
  ap.add_argument("--capacity_factor", type=float, default=None)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--no_torch", action="store_true")
  ap.add_argument("--no_bf16", action="store_true")
  args = ap.parse_args()
  overrides = {
    k: v for k, v in (("expert_impl", args.expert_impl), ("capacity_factor", args.capacity_factor)) if v
  }
  cfg = dataclasses.replace(BENCH, **overrides)
  params = model.init(cfg, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, SEQ), dtype=np.int32)
  _, aux = jax.jit(lambda p, t: model.apply(p, cfg, t))(params, jnp.asarray(tokens))
  total = BATCH * SEQ * cfg.top_k * cfg.n_layers
  print(f"{cfg.expert_impl=} dropped assignments {int(aux['overflow'])} of {total}")

  sides = {"jax fp32": jax_side(cfg, params, tokens)}
  if not args.no_bf16:
    sides["jax bf16 compute"] = jax_side(dataclasses.replace(cfg, dtype="bfloat16"), params, tokens)
  if not args.no_torch:
    import torch

    torch_step = torch_step_fn(params, cfg, tempfile.mkdtemp())
    torch_tokens = torch.from_numpy(tokens.astype(np.int64))
    sides["HF torch eager fp32"] = lambda: torch_step(torch_tokens)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
  for fn in sides.values():
    fn()  # warm-up
  times = {name: [] for name in sides}
  for _ in range(args.repeats):  # alternate sides every round
    for name, fn in sides.items():
      times[name].append(time_round(fn, args.steps))
  reference = statistics.median(times.get("HF torch eager fp32", times["jax fp32"]))
  print("\n| side | ms/step (median) | tok/s | × HF eager | rounds (ms) |\n|---|---|---|---|---|")
  for name, ts in times.items():
    med = statistics.median(ts)
    rounds = ", ".join(f"{t * 1e3:.0f}" for t in ts)
    print(f"| {name} | {med * 1e3:.0f} | {BATCH * SEQ / med:.0f} | {reference / med:.2f} | {rounds} |")


if __name__ == "__main__":
  main()
