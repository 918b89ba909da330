"""Kimi-K2.5 / DeepSeek-V3 MoE transformer, used functionally.

from composer_jax import model
params = model.init(cfg, jax.random.key(0), meshes)
logits, aux = model.apply(params, cfg, tokens)
"""

from composer_jax.model.config import ModelConfig, RopeConfig
from composer_jax.model.hf_import import load_hf_checkpoint, save_hf_checkpoint
from composer_jax.model.moe import update_router_bias
from composer_jax.model.transformer import (
  abstract_params,
  apply,
  head,
  init,
  init_cache,
  layer_slot,
  logical_axes,
  stacks,
  trainable_mask,
  unstack_layers,
)

__all__ = [
  "ModelConfig",
  "RopeConfig",
  "abstract_params",
  "apply",
  "head",
  "init",
  "init_cache",
  "layer_slot",
  "logical_axes",
  "stacks",
  "trainable_mask",
  "unstack_layers",
  "update_router_bias",
  "load_hf_checkpoint",
  "save_hf_checkpoint",
]
