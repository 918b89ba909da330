"""Rollout tokens/s: the KV-cache sampler vs naive full recompute, same model, same sampling, CPU.

  python benchmarks/sampler.py                                     # benchmark shape (as in notes/peers.md)
  python benchmarks/sampler.py --out benchmarks/RESULTS.md         # append a dated section
  python benchmarks/sampler.py --tiny --new 16 --rounds 1          # smoke test, seconds

Model: `model_step.BENCH` (d_model 256, 4 layers, 8 heads, MLA no q-LoRA, 8 experts top-2 + 1
shared, vocab 1024, fp32), random init. Rollout: 8 sequences, right-padded prompts of 17–32
tokens, 224 new tokens each, temperature 0.9, top-k 50 (the Tunix rollout of notes/peers.md); no
stop tokens, so every row generates all 224 and tokens/s = 8 · 224 / wall time of the call,
prefill included.

Sides:
- **kv cache**: `rl.sampler.sample` — one prefill, then a compiled `while_loop`, one token per step.
- **naive**: the same `select` (same keys, so the same tokens up to float noise) on logits from a
  full forward over a fixed [B, P + N] buffer for every new token. Also one compiled loop, so the
  ratio measures the cache, not Python dispatch. The buffer has a fixed width (one compile); its
  not-yet-written columns are invisible to earlier ones by causality.
Rounds alternate sides; the table reports the median round. One CPU device.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from machine import describe as machine  # noqa: E402
from model_step import BENCH  # noqa: E402

from composer_jax import model  # noqa: E402
from composer_jax.rl import sampler  # noqa: E402

TINY = dataclasses.replace(
  BENCH, vocab_size=128, d_model=64, n_layers=2, n_heads=2, dense_mlp_dim=128, moe_mlp_dim=64,
  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens"))
def naive_sample(params, cfg, prompts_BP, lengths_B, keys_B, temperature, top_k, top_p, *, max_new_tokens):
  """Sampling by re-running the whole prefix each step (no cache): the baseline."""
  B, P = prompts_BP.shape
  N = max_new_tokens
  real_BP = jnp.arange(P)[None, :] < lengths_B[:, None]
  buf_BT = jnp.pad(jnp.where(real_BP, prompts_BP, 0), ((0, 0), (0, N)))
  rows_B = jnp.arange(B)

  def step(t, carry):
    buf_BT, out_BN = carry
    logits_BTV, _ = model.apply(params, cfg, buf_BT)
    logits_BV = logits_BTV[rows_B, lengths_B + t - 1]
    keys_t = jax.vmap(jax.random.fold_in, (0, None))(keys_B, t)
    token_B, _, _ = sampler.select(logits_BV, keys_t, temperature, top_k, top_p)
    return buf_BT.at[rows_B, lengths_B + t].set(token_B), out_BN.at[:, t].set(token_B)

  _, out_BN = jax.lax.fori_loop(0, N, step, (buf_BT, jnp.zeros((B, N), jnp.int32)))
  return out_BN


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=32, help="longest prompt; lengths spread over [P/2+1, P]")
  ap.add_argument("--new", type=int, default=224)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--temperature", type=float, default=0.9)
  ap.add_argument("--top_k", type=int, default=50)
  ap.add_argument("--tiny", action="store_true", help="a small model, for a quick correctness run")
  ap.add_argument("--out", default=None, help="append a dated markdown section to this file")
  args = ap.parse_args()
  cfg = TINY if args.tiny else BENCH
  B, P, N = args.batch, args.prompt, args.new

  params = model.init(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  lengths_B = rng.integers(P // 2 + 1, P + 1, B).astype(np.int32)
  lengths_B[0] = P
  prompts_BP = np.where(np.arange(P)[None] < lengths_B[:, None], rng.integers(0, cfg.vocab_size, (B, P)), 0)
  prompts_BP, lengths_B = jnp.asarray(prompts_BP, jnp.int32), jnp.asarray(lengths_B)
  keys_B = jax.random.split(jax.random.key(1), B)
  temperature, top_k, top_p = jnp.float32(args.temperature), jnp.int32(args.top_k), jnp.float32(1.0)

  def kv():
    out = sampler.sample(
      params,
      cfg,
      prompts_BP,
      lengths_B,
      keys_B,
      max_new_tokens=N,
      temperature=args.temperature,
      top_k=args.top_k,
    )
    return jax.block_until_ready(out.tokens)

  def naive():
    out = naive_sample(
      params, cfg, prompts_BP, lengths_B, keys_B, temperature, top_k, top_p, max_new_tokens=N
    )
    return jax.block_until_ready(out)

  sides = {"kv cache (rl.sampler)": kv, "naive full recompute": naive}
  tokens = {}
  for name, fn in sides.items():
    start = time.perf_counter()
    tokens[name] = np.asarray(fn())
    print(f"{name}: first call (compile + run) {time.perf_counter() - start:.1f}s", flush=True)
  a, b = tokens.values()
  first_diff = np.argmax(np.concatenate([a != b, np.ones((B, 1), bool)], 1), 1)  # N: none
  agree = float(np.mean(first_diff)) / N
  times = {name: [] for name in sides}
  for _ in range(args.rounds):  # alternate sides every round
    for name, fn in sides.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)

  naive_med = statistics.median(times["naive full recompute"])
  lines = ["| side | s/rollout (median) | tok/s | × naive | rounds (s) |", "|---|---|---|---|---|"]
  for name, ts in times.items():
    med = statistics.median(ts)
    rounds = ", ".join(f"{t:.2f}" for t in ts)
    lines.append(f"| {name} | {med:.2f} | {B * N / med:.0f} | {naive_med / med:.1f} | {rounds} |")
  lines.append(
    f"- same tokens on both sides: {agree:.1%} of each row before the first difference (float noise)"
  )
  table = "\n".join(lines)
  print("\n" + table)

  if args.out:
    shape = "tiny smoke model" if args.tiny else "benchmark shape (`model_step.BENCH`)"
    section = [
      f"\n## Sampler: KV cache vs naive full recompute ({datetime.date.today().isoformat()})\n",
      f"- **Machine**: {machine()}; jax {jax.__version__}",
      f"- **Command**: `python benchmarks/sampler.py {' '.join(sys.argv[1:])}`",
      f"- **Shape**: {shape}, fp32, `expert_impl={cfg.expert_impl}`; {B} sequences, prompts "
      f"{int(lengths_B.min())}–{P} tokens (right-padded), {N} new tokens each, "
      f"temperature {args.temperature}, top-k {args.top_k}, no stop tokens; "
      f"tokens/s = {B}·{N} / wall time of one rollout (prefill included); "
      f"{args.rounds} alternating rounds, median.",
      "",
      table,
      "",
    ]
    with open(args.out, "a") as f:
      f.write("\n".join(section))
    print(f"appended to {args.out}")


if __name__ == "__main__":
  main()
