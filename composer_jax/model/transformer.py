"""The decoder: embedding → blocks (MLA + dense MLP or MoE) → norm → LM head, used functionally.

Shape suffixes: B batch, T time, S cache length, D d_model, V vocab, L layers, C kv_lora_rank,
R qk_rope_head_dim.

Modules are Flax NNX; callers only see pure pytrees. `init` returns the parameters as a nested
dict of arrays (already sharded over the two meshes); `apply` rebuilds the module from them
inside the trace (`nnx.merge`), so it jits, grads and vmaps like any pure function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax import sharding
from composer_jax.model import rope
from composer_jax.model.attention import MLA
from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import MLP, KeyStream, ones, param, project, rms_norm
from composer_jax.model.moe import MoE


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
    self.input_norm = ones(cfg, cfg.d_model)
    self.attn = MLA(cfg, rngs)
    self.post_attn_norm = ones(cfg, cfg.d_model)
    self.mlp = MoE(cfg, rngs) if cfg.is_moe_layer(layer) else MLP(cfg, cfg.dense_mlp_dim, rngs)
    self.eps = cfg.rms_norm_eps

  def __call__(self, x_BTD, cos, sin, pos_BT, seg_BT, cache, meshes, routed_experts_BTK=None):
    h_BTD, new_cache, max_logit_H = self.attn(
      rms_norm(x_BTD, self.input_norm[...], self.eps), cos, sin, pos_BT, seg_BT, cache=cache, meshes=meshes
    )
    x_BTD = x_BTD + h_BTD
    h_BTD = rms_norm(x_BTD, self.post_attn_norm[...], self.eps)
    if isinstance(self.mlp, MoE):
      h_BTD, aux = self.mlp(h_BTD, meshes, routed_experts_BTK)
    else:
      h_BTD, aux = self.mlp(h_BTD), None
    out_BTD = sharding.constrain(x_BTD + h_BTD, ("batch", "seq", "act_embed"), meshes)
    return out_BTD, new_cache, aux, max_logit_H


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.embed = nnx.Param(
      jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model)).astype(cfg.param_dtype) * cfg.init_std,
      out_sharding=("vocab", "embed"),
    )
    self.layers = nnx.List([Block(cfg, layer, rngs) for layer in range(cfg.n_layers)])
    self.final_norm = ones(cfg, cfg.d_model)
    if not cfg.tie_word_embeddings:
      self.lm_head = param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
    self.cfg = cfg

  def __call__(self, tokens_BT, pos_BT, seg_BT, cache, meshes, routed_experts_LBTK=None):
    cfg = self.cfg
    # Out-of-range ids read NaN rows (never a silently clamped row), so bad data shows in the loss.
    x_BTD = (
      self.embed[...]
      .at[tokens_BT]
      .get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
      .astype(cfg.dtype)
    )
    x_BTD = sharding.constrain(x_BTD, ("batch", "seq", "act_embed"), meshes)
    cos, sin = rope.cos_sin(cfg, pos_BT)
    if cache is not None:
      index = cache["index"]
      k_pos = jax.lax.dynamic_update_slice_in_dim(cache["positions"], pos_BT.astype(jnp.int32), index, 1)
      k_seg = jax.lax.dynamic_update_slice_in_dim(cache["segments"], seg_BT.astype(jnp.int32), index, 1)
    latents, k_ropes, moe_aux, max_logits = [], [], [], []
    for layer, block in enumerate(self.layers):
      forced_BTK = None
      if routed_experts_LBTK is not None and isinstance(block.mlp, MoE):
        forced_BTK = routed_experts_LBTK[len(moe_aux)]
      layer_cache = None
      if cache is not None:
        layer_cache = (cache["latent"][layer], cache["k_rope"][layer], index, k_pos, k_seg)
        x_BTD, new_layer_cache, aux, max_logit_H = block(
          x_BTD, cos, sin, pos_BT, seg_BT, layer_cache, meshes, forced_BTK
        )
      else:  # training: the block may be rematerialised in the backward pass
        x_BTD, new_layer_cache, aux, max_logit_H = _remat(block, cfg.remat)(
          x_BTD, cos, sin, pos_BT, seg_BT, meshes, forced_BTK
        )
      max_logits.append(max_logit_H)
      if new_layer_cache is not None:
        latents.append(new_layer_cache[0])
        k_ropes.append(new_layer_cache[1])
      if aux is not None:
        moe_aux.append(aux)
    x_BTD = rms_norm(x_BTD, self.final_norm[...], cfg.rms_norm_eps)
    head_DV = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
    logits_BTV = project("btd,dv->btv", x_BTD, head_DV, cfg.dtype).astype(jnp.float32)
    aux = _collect_aux(moe_aux, cfg, tokens_BT.shape)
    aux["max_logit"] = jnp.stack(max_logits)  # [L, H]: each head's largest attention logit
    if cache is not None:
      aux["cache"] = {
        "index": index + tokens_BT.shape[1],
        "positions": k_pos,
        "segments": k_seg,
        "latent": jnp.stack(latents),
        "k_rope": jnp.stack(k_ropes),
      }
    return logits_BTV, aux


_REMAT_POLICIES = {
  "full": None,  # save only each block's input; recompute everything else in the backward pass
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
  "dots_with_batch": jax.checkpoint_policies.dots_saveable,  # also batched (attention) matmuls
}


def _remat(block: Block, policy: str):
  """The block as a function of its activations, rematerialised per `ModelConfig.remat`."""

  def run(blk, x_BTD, cos, sin, pos_BT, seg_BT, meshes, routed_experts_BTK):
    return blk(x_BTD, cos, sin, pos_BT, seg_BT, None, meshes, routed_experts_BTK)

  if policy == "none":
    return functools.partial(run, block)
  remat_run = nnx.remat(run, policy=_REMAT_POLICIES[policy], static_argnums=(6,))
  return functools.partial(remat_run, block)


def _collect_aux(moe_aux: list[dict], cfg: ModelConfig, tokens_shape: tuple[int, int]) -> dict:
  if not moe_aux:
    zero = jnp.zeros((), jnp.float32)
    return {
      "expert_load": jnp.zeros((0, cfg.n_experts)),
      "overflow": zero,
      "balance_loss": zero,
      "routed_experts": jnp.zeros((0, *tokens_shape, cfg.top_k), jnp.int32),
    }
  return {
    "expert_load": jnp.stack([a["expert_load"] for a in moe_aux]),  # [L_moe, E]
    "overflow": sum(a["overflow"] for a in moe_aux),  # dropped assignments, all layers
    "balance_loss": jnp.mean(jnp.stack([a["balance_loss"] for a in moe_aux])),
    "routed_experts": jnp.stack([a["routed_experts"] for a in moe_aux]),  # [L_moe, B, T, K]
  }


@functools.lru_cache(maxsize=32)
def _abstract(cfg: ModelConfig):
  """(graphdef, abstract state) of the model; built once per config, no memory allocated."""
  with nnx.use_eager_sharding(False):
    module = nnx.eval_shape(lambda: Transformer(cfg, KeyStream(0)))
  return nnx.split(module)


def logical_axes(cfg: ModelConfig) -> dict:
  """The params tree with each leaf replaced by its tuple of logical axis names."""
  _, state = _abstract(cfg)
  return nnx.to_pure_dict(
    jax.tree.map(
      lambda v: tuple(v.get_metadata()["out_sharding"]), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
  )


def trainable_mask(cfg: ModelConfig) -> dict:
  """True for leaves the optimizer updates; False for the router bias (moved by its own rule)."""
  _, state = _abstract(cfg)
  return nnx.to_pure_dict(
    jax.tree.map(lambda v: isinstance(v, nnx.Param), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )


def init(cfg: ModelConfig, rng: jax.Array, meshes: sharding.Meshes | None = None) -> dict:
  """Random parameters, each created directly in its shard (expert mesh or dense mesh)."""

  def make(key):
    with nnx.use_eager_sharding(False):
      return nnx.to_pure_dict(nnx.state(Transformer(cfg, KeyStream(key))))

  out_shardings = None
  if meshes is not None:
    out_shardings = sharding.param_shardings(logical_axes(cfg), jax.eval_shape(make, rng), meshes)
  return jax.jit(make, out_shardings=out_shardings)(rng)


def apply(
  params: dict,
  cfg: ModelConfig,
  tokens: jax.Array,
  positions: jax.Array | None = None,
  cache: dict | None = None,
  *,
  segment_ids: jax.Array | None = None,
  meshes: sharding.Meshes | None = None,
  routed_experts: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
  """Logits [B, T, V] (float32) and aux metrics.

  positions: [B, T] RoPE positions; default 0..T-1, or continuing from the cache.
  segment_ids: [B, T] packed-document ids; tokens attend only within their segment.
  cache: from `init_cache`; the updated cache is returned as `aux["cache"]`.
  routed_experts: int [MoE layers, B, T, top_k] routing replay (R3, arXiv 2510.11370): every MoE
  layer uses these experts for each token instead of its own top-k, with combine weights from its
  router's scores at those experts (so the router still gets gradient). A token whose ids in a
  layer include a negative one keeps that layer's own choice. None: the model routes itself.
  aux: `expert_load` [MoE layers, E] assignments per expert, `overflow` dropped assignments
  (capacity paths; 0 when dropless), `balance_loss` the sequence-wise balance loss,
  `routed_experts` int32 [MoE layers, B, T, top_k] the experts used (replayed or chosen).
  """
  tokens = jnp.asarray(tokens)
  _check_tokens(tokens, cfg)
  B, T = tokens.shape
  if positions is None:
    start = 0 if cache is None else cache["index"]
    positions = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  graphdef, abstract_state = _abstract(cfg)
  state = jax.tree.map(lambda x: x, abstract_state)  # fresh Variables to fill
  nnx.replace_by_pure_dict(state, params)
  module = nnx.merge(graphdef, state)
  if routed_experts is not None:
    want = (cfg.n_moe_layers, B, T, cfg.top_k)
    if tuple(routed_experts.shape) != want:
      raise ValueError(
        f"routed_experts must be [MoE layers, B, T, top_k] = {list(want)}; got {list(routed_experts.shape)}."
      )
  return module(tokens, positions, segment_ids, cache, meshes, routed_experts)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
  """An empty latent KV cache: C + R numbers per token and layer (MLA's compressed form)."""
  L = cfg.n_layers
  return {
    "index": jnp.zeros((), jnp.int32),
    "positions": jnp.zeros((batch, max_len), jnp.int32),
    "segments": jnp.full((batch, max_len), -1, jnp.int32),  # -1: empty, matches no query
    "latent": jnp.zeros((L, batch, max_len, cfg.kv_lora_rank), cfg.dtype),
    "k_rope": jnp.zeros((L, batch, max_len, cfg.qk_rope_head_dim), cfg.dtype),
  }


@functools.partial(jax.jit, static_argnames=("cfg", "num_tokens", "meshes"))
def greedy_decode(
  params: dict, cfg: ModelConfig, prompt: jax.Array, num_tokens: int, meshes: sharding.Meshes | None = None
) -> jax.Array:
  """Argmax continuation [B, num_tokens] of a prompt [B, T]: one prefill, then a compiled loop."""
  B, T = prompt.shape
  cache = init_cache(cfg, B, T + num_tokens)
  logits, aux = apply(params, cfg, prompt, cache=cache, meshes=meshes)
  first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

  def step(carry, _):
    token_B, cache = carry
    logits, aux = apply(params, cfg, token_B[:, None], cache=cache, meshes=meshes)
    return (jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), aux["cache"]), token_B

  _, tokens = jax.lax.scan(step, (first, aux["cache"]), length=num_tokens)
  return tokens.T


def _check_tokens(tokens: jax.Array, cfg: ModelConfig) -> None:
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(
      f"tokens must be an integer array [batch, time]; got {tokens.dtype}{list(tokens.shape)}."
    )
  if isinstance(tokens, jax.core.Tracer):
    return  # traced: out-of-range ids turn into NaN logits (see Transformer.__call__)
  values = np.asarray(tokens)
  if values.size and (values.min() < 0 or values.max() >= cfg.vocab_size):
    raise ValueError(
      f"token ids must be in [0, vocab_size={cfg.vocab_size}); got min {values.min()}, max {values.max()}."
    )
