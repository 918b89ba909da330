"""The training optimizer: sharded Muon on matrices, AdamW on the rest, nothing on frozen leaves.

Which leaf gets what is read from the model's *logical axes* (never from ndim, which would send
stacked experts to Adam and embeddings to Muon):
- any `vocab` axis (embedding, LM head), any unnamed axis (norms, the router's (embed, None)),
  or fewer than two matrix axes → AdamW;
- `heads`, `expert`, `layers` are batch axes, so attention is orthogonalised per head and experts
  per expert (Moonlight arXiv 2502.16982 §2; Kimi K2 MuonClip); the two remaining axes are
  (reduction, output) in storage order: q_b/kv_b [in, H, hd] → MDN(0, 2), o [H, hd, D] → MDN(1, 2),
  experts [E, in, out] → MDN(1, 2), dense matrices → MDN(0, 1);
- leaves that `model.trainable_mask` marks False (the router bias, moved by its own balancing rule)
  → `optax.set_to_zero`, hence no update and no weight decay.
AdamW decays the leaves with two or more axes besides `layers` (embedding, LM head, router), not the
norms: in the stacked layout a norm is [L, D], so ndim would not tell them apart.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from composer_jax import model, sharding
from composer_jax.configs import OptimizerConfig
from composer_jax.optim.muon import sharded_muon

_BATCH_AXES = ("layers", "expert", "heads")


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


def decay_mask(model_cfg: model.ModelConfig) -> Any:
  """Params-shaped tree: True where AdamW's weight decay applies (see the module doc)."""
  return jax.tree.map(
    lambda ax: sum(a != "layers" for a in ax) >= 2, model.logical_axes(model_cfg), is_leaf=_is_axes
  )


def _path_lookup(tree: Any) -> Any:
  """A mask function for optax: the value of `tree` at each leaf path of the (masked) params."""
  table = {path: v for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  return lambda params: jax.tree_util.tree_map_with_path(lambda path, _: table[path], params)


def _is_dn(x: Any) -> bool:
  return isinstance(x, MuonDimensionNumbers)


def lr_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """Linear warmup 0 → learning_rate, then cosine to learning_rate · min_lr_ratio (both branches).

  `cfg.total_steps` must be set: `configs.optimizer_for(cfg, schedule)` fills it from the stage's step count
  and `cfg.warmup_steps` from its `schedule.warmup_steps`."""
  if cfg.total_steps is None:
    raise ValueError("OptimizerConfig.total_steps is None: resolve it with configs.optimizer_for")
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=cfg.warmup_steps,
    decay_steps=cfg.total_steps,
    end_value=cfg.learning_rate * cfg.min_lr_ratio,
  )


def muon_branch(
  model_cfg: model.ModelConfig, cfg: OptimizerConfig, meshes: sharding.Meshes | None, params: Any = None
) -> optax.GradientTransformation:
  """The Muon half of `build_optimizer` (None dimension numbers pass leaves through untouched).

  `params` (arrays or ShapeDtypeStructs; default: the model's abstract shapes) pick each leaf's sharding
  on `meshes`, by the same rule `model.init` uses."""
  shardings = None
  if meshes is not None:
    params = abstract_params(model_cfg) if params is None else params
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
    ns_dtype=cfg.muon_dtype,
  )


def clip_by_global_norm_where(max_norm: float, where: Any) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm`'s factor, from the norm of *all* gradients, applied only to the leaves
  where `where` (a params-shaped bool tree) is True; the others pass through untouched, so nothing
  computed from them waits for the norm (Muon's Newton–Schulz can start as its gradients are ready)."""

  def update_fn(updates, state, params=None):
    del params
    g_norm = optax.tree.norm(updates)
    trigger = jnp.squeeze(g_norm < max_norm)

    def clip(t, w):
      return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm) if w else t

    return jax.tree.map(clip, updates, where), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def abstract_params(model_cfg: model.ModelConfig) -> Any:
  """The model's parameters as ShapeDtypeStructs (no memory, no compute)."""
  return model.abstract_params(model_cfg)


def build_optimizer(
  model_cfg: model.ModelConfig, cfg: OptimizerConfig, meshes: sharding.Meshes | None, params: Any = None
) -> optax.GradientTransformation:
  """clip → partition {muon: sharded_muon, adam: adamw, frozen: set_to_zero} by logical axes.

  The clip (`grad_clip`, by the global norm of all gradients) scales the AdamW leaves, and the Muon
  leaves too only with `clip_muon`: Muon's update is orthogonalised, so its size does not follow the
  gradient's, and without the clip each Muon group can start as soon as its own gradients exist.

  `model_cfg` supplies the logical axes, the trainable mask and (abstractly) the parameter shapes;
  `params` may give the shapes instead. Call the result's `init` eagerly (see `sharded_muon`).
  """
  if cfg.matrix_optimizer not in ("muon", "adamw"):
    raise ValueError(f"matrix_optimizer must be 'muon' or 'adamw'; got {cfg.matrix_optimizer!r}.")
  schedule = lr_schedule(cfg)
  muon = muon_branch(model_cfg, cfg, meshes, params)
  adam = optax.adamw(
    schedule,
    b1=cfg.adam_b1,
    b2=cfg.adam_b2,
    eps=cfg.adam_eps,
    weight_decay=cfg.weight_decay,
    mask=_path_lookup(decay_mask(model_cfg)),  # embeddings, head, router; not norms
  )
  branches = labels(model_cfg)
  if cfg.matrix_optimizer == "adamw":
    branches = jax.tree.map(lambda b: "adam" if b == "muon" else b, branches)
  tx = optax.partition({"muon": muon, "adam": adam, "frozen": optax.set_to_zero()}, branches)
  if cfg.grad_clip > 0:
    clipped = jax.tree.map(lambda b: b != "muon" or cfg.clip_muon, branches)
    tx = optax.chain(clip_by_global_norm_where(cfg.grad_clip, clipped), tx)
  return tx
