"""The training optimizer: sharded Muon on matrices, AdamW on the rest, nothing on frozen leaves.

Which leaf gets what is read from the model's *logical axes* (never from ndim, which would send
stacked experts to Adam and embeddings to Muon — notes/muon.md §1):
- any `vocab` axis (embedding, LM head), any unnamed axis (norms, the router's (embed, None)),
  or fewer than two matrix axes → AdamW;
- `heads`, `expert`, `layers` are batch axes, so attention is orthogonalised per head and experts
  per expert (Moonlight arXiv 2502.16982 §2; Kimi K2 MuonClip); the two remaining axes are
  (reduction, output) in storage order: q_b/kv_b [in, H, hd] → MDN(0, 2), o [H, hd, D] → MDN(1, 2),
  experts [E, in, out] → MDN(1, 2), dense matrices → MDN(0, 1);
- leaves that `model.trainable_mask` marks False (the router bias, moved by its own balancing rule)
  → `optax.set_to_zero`, hence no update and no weight decay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from composer_jax import model, sharding
from composer_jax.optim.muon import sharded_muon

_BATCH_AXES = ("layers", "expert", "heads")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Hyper-parameters of `build_optimizer` (one learning rate for both branches: with Moonlight's
  0.2·sqrt(max(m, n)) scale Muon's update RMS matches AdamW's, so lr and wd transfer)."""

  learning_rate: float = 3e-4  # peak of the warmup + cosine schedule
  warmup_steps: int = 100  # linear 0 → peak
  total_steps: int = 10_000  # cosine decay horizon (includes warmup)
  min_lr_ratio: float = 0.1  # schedule ends at learning_rate · min_lr_ratio
  weight_decay: float = 0.1  # decoupled, × lr; Muon matrices and Adam matrices (not norms)
  muon_beta: float = 0.95
  ns_steps: int = 5
  ns_coeffs: str = "quintic"  # or "polar_express"
  rms_scale: str = "moonlight"  # or "jordan"
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  adam_eps: float = 1e-8
  grad_clip: float = 1.0  # global norm over all gradients; 0 disables
  matrix_optimizer: str = "muon"  # "adamw": AdamW on the matrices too (the ablation / benchmark peer)
  qk_clip_tau: float = 100.0  # QK-clip threshold on the max attention logit (Kimi K2); 0 disables


def _rule(axes: tuple) -> MuonDimensionNumbers | None:
  if len(axes) < 2 or "vocab" in axes or None in axes:
    return None
  matrix = [i for i, name in enumerate(axes) if name not in _BATCH_AXES]
  if len(matrix) != 2:
    return None
  return MuonDimensionNumbers(reduction_axis=matrix[0], output_axis=matrix[1])


def _is_axes(x: Any) -> bool:
  return isinstance(x, tuple)


def dimension_numbers(model_cfg: model.ModelConfig) -> Any:
  """Params-shaped tree: Muon dimension numbers per matrix leaf, None for Adam and frozen leaves."""
  axes = model.logical_axes(model_cfg)
  trainable = model.trainable_mask(model_cfg)
  rules = jax.tree.map(_rule, axes, is_leaf=_is_axes)
  return jax.tree.map(
    lambda r, t: r if t else None, rules, trainable, is_leaf=lambda x: x is None or _is_dn(x)
  )


def labels(model_cfg: model.ModelConfig) -> Any:
  """Params-shaped tree of 'muon' | 'adam' | 'frozen'."""
  axes = model.logical_axes(model_cfg)
  trainable = model.trainable_mask(model_cfg)

  def label(ax, t):
    if not t:
      return "frozen"
    return "adam" if _rule(ax) is None else "muon"

  return jax.tree.map(label, axes, trainable, is_leaf=_is_axes)


def _is_dn(x: Any) -> bool:
  return isinstance(x, MuonDimensionNumbers)


def lr_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """Linear warmup 0 → learning_rate, then cosine to learning_rate · min_lr_ratio (both branches)."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=cfg.warmup_steps,
    decay_steps=cfg.total_steps,
    end_value=cfg.learning_rate * cfg.min_lr_ratio,
  )


def muon_branch(
  cfg: OptimizerConfig, params: Any, meshes: sharding.Meshes | None, *, model_cfg: model.ModelConfig
) -> optax.GradientTransformation:
  """The Muon half of `build_optimizer` (None dimension numbers pass leaves through untouched)."""
  shardings = None
  if meshes is not None:
    shardings = sharding.param_shardings(model.logical_axes(model_cfg), params, meshes)
  return sharded_muon(
    lr_schedule(cfg),
    dimension_numbers=dimension_numbers(model_cfg),
    meshes=meshes,
    shardings=shardings,
    ns_coeffs=cfg.ns_coeffs,
    ns_steps=cfg.ns_steps,
    beta=cfg.muon_beta,
    nesterov=True,
    weight_decay=cfg.weight_decay,
    rms_scale=cfg.rms_scale,
  )


def build_optimizer(
  cfg: OptimizerConfig, params: Any, meshes: sharding.Meshes | None, *, model_cfg: model.ModelConfig
) -> optax.GradientTransformation:
  """clip → partition {muon: sharded_muon, adam: adamw, frozen: set_to_zero} by logical axes.

  `params` (arrays or ShapeDtypeStructs) give the shapes that pick each leaf's sharding on `meshes`
  (the same rule `model.init` uses). `model_cfg` supplies the logical axes and the trainable mask.
  Call the result's `init` eagerly (see `sharded_muon`).
  """
  if cfg.matrix_optimizer not in ("muon", "adamw"):
    raise ValueError(f"matrix_optimizer must be 'muon' or 'adamw'; got {cfg.matrix_optimizer!r}.")
  schedule = lr_schedule(cfg)
  muon = muon_branch(cfg, params, meshes, model_cfg=model_cfg)
  adam = optax.adamw(
    schedule,
    b1=cfg.adam_b1,
    b2=cfg.adam_b2,
    eps=cfg.adam_eps,
    weight_decay=cfg.weight_decay,
    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),  # decay embeddings/head/router, not norms
  )
  branches = labels(model_cfg)
  if cfg.matrix_optimizer == "adamw":
    branches = jax.tree.map(lambda b: "adam" if b == "muon" else b, branches)
  tx = optax.partition({"muon": muon, "adam": adam, "frozen": optax.set_to_zero()}, branches)
  if cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
  return tx
