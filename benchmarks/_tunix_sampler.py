"""The Tunix side of `sampler.py`: Tunix's KV-cache `Sampler` on a random-init Qwen3-MoE, one CPU device.

Run by `sampler.py --tunix_python=<tunix venv>/bin/python` as a long-lived subprocess of that venv
(`pip install google-tunix`; not a dependency of this repository):

  <tunix venv>/bin/python benchmarks/_tunix_sampler.py '<json spec>'

The spec (JSON, built by `sampler.py`) gives the shape (layers, d_model, heads, head_dim, vocab,
experts, top-k, expert width), the prompts as token ids (real tokens only), new tokens, temperature,
top-k and seed. The model is `tunix.models.qwen3.Qwen3` (GQA attention with q/k-norm, 8 KV heads =
no grouping here, a routed-only MoE: Qwen3-MoE has no shared expert), fp32, initialised by Tunix's
own initialisers; no checkpoint.

Protocol, one JSON object per stdout line: after building the model and two untimed rollouts
(compilation), `{"ready": ..., "params": ..., "active_params": ..., "versions": ..., "compile_s": ...}`;
then for every line `run` on stdin one timed rollout, `{"seconds": ..., "cpu_seconds": ...,
"new_tokens": [...]}` (wall time, and CPU time of the process, all its threads); `quit`
(or EOF) ends it. A rollout is one `Sampler.__call__` (host tokenisation of the prompts, prefill,
compiled decode loop, host detokenisation of the outputs), timed around the call; its result is on
the host when the call returns.

Tokenizer: the prompts arrive as ids, so the tokenizer maps the string "5 17 3" to [5, 17, 3] and
back. Pad id 0: real prompt tokens equal to 0 are sent as 1 (Tunix treats id 0 as padding). There
is no BOS, and the stop token is `vocab_size`, an id the model never samples, so every row generates
all its tokens, as on our side.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import sys
import time


class IdTokenizer:
  """Token ids written as a space-separated string; the minimal interface Tunix's adapter accepts."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str, **kwargs) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs) -> str:
    return " ".join(str(int(t)) for t in ids)

  def bos_id(self):
    return None  # Tunix prepends a BOS only when this is truthy

  def eos_id(self) -> int:
    return self.vocab_size  # never sampled (logits cover 0..vocab_size-1)

  def pad_id(self) -> int:
    return 0


def build(spec: dict):
  import jax.numpy as jnp
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3

  s = spec["shape"]
  config = qwen3.ModelConfig(
    num_layers=s["n_layers"],
    vocab_size=s["vocab_size"],
    embed_dim=s["d_model"],
    hidden_dim=s["moe_mlp_dim"],  # the expert width when num_experts is set
    num_heads=s["n_heads"],
    head_dim=s["head_dim"],
    num_kv_heads=s["n_heads"],
    rope_theta=s["rope_theta"],
    norm_eps=s["rms_norm_eps"],
    use_tied_embedding=False,
    num_experts=s["n_experts"],
    num_experts_per_tok=s["top_k"],
    dtype=jnp.float32,
    param_dtype=jnp.float32,
  )
  return config, qwen3.Qwen3(config, rngs=nnx.Rngs(params=spec["seed"]))


def count_params(model, config) -> tuple[int, int]:
  """Total parameters, and those one token uses with top-k routing (routed experts counted k of E)."""
  from flax import nnx

  total = expert = 0
  for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shape = leaf.get_value().shape
    n = math.prod(shape)
    total += n
    if path[-1] in ("gate_proj", "up_proj", "down_proj") and "mlp" in path and len(shape) == 3:
      expert += n
  return total, total - expert + expert * config.num_experts_per_tok // config.num_experts


def main():
  spec = json.loads(sys.argv[1])
  import jax
  from tunix.generate import sampler as sampler_lib

  config, model = build(spec)
  prompts = [" ".join(str(t if t != 0 else 1) for t in row) for row in spec["prompts"]]
  P = max(len(row) for row in spec["prompts"])
  N = spec["new_tokens"]
  sampler = sampler_lib.Sampler(
    model,
    IdTokenizer(config.vocab_size),
    sampler_lib.CacheConfig(
      cache_size=P + N,
      num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim,
    ),
  )

  def rollout():
    return sampler(
      prompts,
      max_generation_steps=N,
      max_prompt_length=P,  # fixed, so every call reuses the compiled prefill and decode
      temperature=spec["temperature"],
      top_p=1.0,  # top-p mode with p = 1 is Tunix's top-k sampling
      top_k=spec["top_k"],
      seed=spec["seed"],
      eos_tokens=[config.vocab_size],
    )

  t0 = time.perf_counter()
  out = rollout()
  compile_s = time.perf_counter() - t0
  out = rollout()  # the second call still compiles a few small host-side ops; keep them untimed too
  total, active = count_params(model, config)
  versions = {p: importlib.metadata.version(p) for p in ("google-tunix", "jax", "jaxlib", "flax")}
  ready = {
    "ready": True,
    "params": total,
    "active_params": active,
    "versions": versions,
    "compile_s": compile_s,
    "devices": [str(d) for d in jax.devices()],
    "new_tokens": [len(t) for t in out.tokens],
  }
  print(json.dumps(ready), flush=True)
  for line in sys.stdin:
    cmd = line.strip()
    if cmd == "quit":
      break
    if cmd != "run":
      continue
    t0, c0 = time.perf_counter(), time.process_time()
    out = rollout()
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - c0
    print(
      json.dumps({"seconds": seconds, "cpu_seconds": cpu, "new_tokens": [len(t) for t in out.tokens]}),
      flush=True,
    )


if __name__ == "__main__":
  main()
