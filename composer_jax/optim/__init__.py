"""Optimizers: sharded Muon for matrices, AdamW for the rest.

from composer_jax import optim
tx = optim.build_optimizer(model_cfg, optim.OptimizerConfig(...), meshes)
"""

from composer_jax.configs import OptimizerConfig
from composer_jax.optim.muon import (
  Group,
  MatrixView,
  ShardedMuonState,
  group_views,
  matrix_view,
  sharded_muon,
)
from composer_jax.optim.optimizer import (
  abstract_params,
  build_optimizer,
  decay_mask,
  dimension_numbers,
  labels,
  lr_schedule,
  muon_branch,
)
from composer_jax.optim.qk_clip import clip_factors, qk_clip

__all__ = [
  "Group",
  "MatrixView",
  "OptimizerConfig",
  "ShardedMuonState",
  "abstract_params",
  "build_optimizer",
  "clip_factors",
  "decay_mask",
  "dimension_numbers",
  "group_views",
  "labels",
  "lr_schedule",
  "matrix_view",
  "muon_branch",
  "qk_clip",
  "sharded_muon",
]
