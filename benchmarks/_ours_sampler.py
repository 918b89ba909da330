"""Our sampler from another source tree (e.g. the previous commit), as a side of benchmarks/sampler.py.

  python benchmarks/_ours_sampler.py '<json spec>'     # run by sampler.py with PYTHONPATH=<that tree>

Builds the benchmark model of *that* tree (`model_step.BENCH`, or `sampler.TINY` with the spec's "tiny"),
compiles `rl.sampler.sample` on the spec's prompts (first call, reported), then answers each `run` line
on stdin with one JSON line: the seconds of one timed rollout. Same protocol as `_tunix_sampler.py`.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from model_step import BENCH  # noqa: E402
from sampler import TINY  # noqa: E402  (that tree's benchmarks/sampler.py)

from composer_jax import model  # noqa: E402
from composer_jax.rl import sampler as rl_sampler  # noqa: E402


def main() -> None:
  spec = json.loads(sys.argv[1])
  cfg = TINY if spec["tiny"] else BENCH
  params = model.init(cfg, jax.random.key(0))
  prompts = jnp.asarray(spec["prompts"], jnp.int32)
  lengths = jnp.asarray(spec["lengths"], jnp.int32)
  keys = jax.random.split(jax.random.key(1), prompts.shape[0])

  def rollout():
    out = rl_sampler.sample(
      params,
      cfg,
      prompts,
      lengths,
      keys,
      max_new_tokens=spec["new_tokens"],
      temperature=spec["temperature"],
      top_k=spec["top_k"],
    )
    return np.asarray(jax.block_until_ready(out.tokens))

  start = time.perf_counter()
  tokens = rollout()
  info = {"compile_s": time.perf_counter() - start, "source": model.__file__, "tokens": tokens.tolist()}
  print(json.dumps(info), flush=True)
  for line in sys.stdin:
    if line.strip() != "run":
      break
    start, cpu = time.perf_counter(), time.process_time()
    rollout()
    print(
      json.dumps({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}),
      flush=True,
    )


if __name__ == "__main__":
  main()
