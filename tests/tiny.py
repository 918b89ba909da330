"""The tiny model configuration shared by the model and sharding tests (one compile each)."""

import pathlib

import numpy as np

from composer_jax.model import ModelConfig, RopeConfig

# capacity_factor = n_experts: every expert has a slot per assignment (capacity path and EP send
# buffers never overflow), so outputs don't depend on which other tokens share the batch and the
# expert-parallel path computes exactly what the local path does.
TINY = ModelConfig(
  vocab_size=64,
  d_model=32,
  n_layers=2,
  n_heads=2,
  dense_mlp_dim=64,
  moe_mlp_dim=16,
  n_experts=8,
  top_k=2,
  n_group=4,
  topk_group=2,
  routed_scaling_factor=2.5,
  first_k_dense=1,
  q_lora_rank=16,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=4,
  v_head_dim=8,
  max_position_embeddings=64,
  capacity_factor=8.0,
  rope=RopeConfig(kind="yarn", factor=4.0, original_max_position=16, mscale=1.0, mscale_all_dim=1.0),
)


def write_corpus(root: pathlib.Path) -> str:
  """Six train files and two validation files of Python-looking text under `root` (the split hashes the
  path), for the tests that build the pretraining corpus."""
  from composer_jax.data import corpus

  want, i = {"train": 6, "validation": 2}, 0
  rng = np.random.default_rng(0)
  while any(want.values()):
    name, i = f"mod_{i}.py", i + 1
    split = corpus.split_of(name)
    if want[split]:
      want[split] -= 1
      body = "".join(f"def f{j}(x):\n  return x * {int(rng.integers(10))}\n\n" for j in range(20))
      (root / name).write_text(f'"""Module {name}."""\n\n' + body)
  return str(root)


def load_script(relative: str):
  """A repository script (e.g. "benchmarks/rl_feedback.py") imported as a module, for its functions."""
  import importlib.util  # noqa: PLC0415

  path = pathlib.Path(__file__).resolve().parents[1] / relative
  spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
