"""The decoder: embedding → stacked blocks (MLA + dense MLP or MoE), scanned → norm → LM head.

Shape suffixes: B batch, T time, S cache length, D d_model, V vocab, L layers (of one stack), H heads,
K top_k, C kv_lora_rank, R qk_rope_head_dim.

Parameters are a nested dict: `embed`, `final_norm`, `lm_head` and two *stacks*, `dense_layers` (the
first `first_k_dense` layers, dense MLP) and `moe_layers` (the rest), each holding its layers'
parameters with a leading `layers` axis (logical name `layers`, a batch axis for Muon). A stack runs as
one `jax.lax.scan` over that axis (MaxText's `scan_layers`), so tracing and compiling cost one block
whatever the depth; in training the scanned body is rematerialised per `ModelConfig.remat`.
`cfg.scan_layers=False` unrolls the same stacks (one copy of the block per layer in the program).

Modules are Flax NNX and own one block's (or the embedding's) parameters; callers only see pure
pytrees. Inside the scan each layer's slice of the stack is merged into a `Block` (`nnx.merge`), so
the forward jits, grads and vmaps like any pure function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax import backend, sharding
from composer_jax.model import rope
from composer_jax.model.attention import MLA
from composer_jax.model.config import ModelConfig, check_context_balance
from composer_jax.model.layers import MLP, KeyStream, embed, ones, param, project, rms_norm
from composer_jax.model.moe import MoE

DENSE, MOE = "dense_layers", "moe_layers"
_OUTER = "outer"  # the embedding, final norm and LM head


class Block(nnx.Module):
  """One decoder layer: pre-norm MLA, then pre-norm dense SwiGLU MLP or MoE."""

  def __init__(self, cfg: ModelConfig, moe: bool, rngs: KeyStream | nnx.Rngs):
    self.input_norm = ones(cfg, cfg.d_model)
    self.attn = MLA(cfg, rngs)
    self.post_attn_norm = ones(cfg, cfg.d_model)
    self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, cfg.dense_mlp_dim, rngs)
    self.eps = cfg.rms_norm_eps

  def __call__(self, x_BTD, cos, sin, pos_BT, seg_BT, cache, meshes, routed_experts_BTK=None, balanced=False):
    x_norm_BTD = rms_norm(x_BTD, self.input_norm[...], self.eps)
    h_BTD, new_cache, max_logit_H = self.attn(
      x_norm_BTD, cos, sin, pos_BT, seg_BT, cache=cache, meshes=meshes, balanced=balanced
    )
    x_BTD = x_BTD + h_BTD
    h_BTD = rms_norm(x_BTD, self.post_attn_norm[...], self.eps)
    if isinstance(self.mlp, MoE):
      h_BTD, aux = self.mlp(h_BTD, meshes, routed_experts_BTK)
    else:
      h_BTD, aux = self.mlp(h_BTD), None
    out_BTD = sharding.constrain(x_BTD + h_BTD, ("batch", "seq", "act_embed"), meshes)
    return out_BTD, new_cache, aux, max_logit_H


class Outer(nnx.Module):
  """The parameters outside the stacks: token embedding, final norm, LM head (unless tied)."""

  def __init__(self, cfg: ModelConfig, rngs: KeyStream | nnx.Rngs):
    self.embed = nnx.Param(
      jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model)).astype(cfg.param_dtype) * cfg.init_std,
      out_sharding=("vocab", "embed"),
    )
    self.final_norm = ones(cfg, cfg.d_model)
    if not cfg.tie_word_embeddings:
      self.lm_head = param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))


def stacks(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
  """(params key, layer count) of the non-empty stacks, in layer order."""
  return tuple((name, n) for name, n in ((DENSE, cfg.first_k_dense), (MOE, cfg.n_moe_layers)) if n)


def unstack_layers(params: dict, cfg: ModelConfig) -> dict:
  """`params` with each layer stack [L, ...] split into a list of L per-layer trees, which `apply`
  runs layer by layer. For a decode loop: split once before the loop, or every step slices (copies)
  each layer's weights out of the stacks, all expert weights included (XLA:CPU does not hoist them)."""
  out = dict(params)
  for name, n in stacks(cfg):
    out[name] = [jax.tree.map(lambda x, i=i: x[i], params[name]) for i in range(n)]
  return out


def layer_slot(cfg: ModelConfig, layer: int) -> tuple[str, int]:
  """Where decoder layer `layer` (HF's `model.layers.{layer}`) lives: (stack key, index in it)."""
  if not 0 <= layer < cfg.n_layers:
    raise IndexError(f"layer {layer} is outside [0, n_layers={cfg.n_layers}).")
  return (DENSE, layer) if layer < cfg.first_k_dense else (MOE, layer - cfg.first_k_dense)


def _build(cfg: ModelConfig, part: str, rngs: KeyStream) -> nnx.Module:
  return Outer(cfg, rngs) if part == _OUTER else Block(cfg, part == MOE, rngs)


@functools.lru_cache(maxsize=64)
def _abstract(cfg: ModelConfig, part: str):
  """(graphdef, abstract state) of the outer module or of one block of a stack; traced once."""
  with nnx.use_eager_sharding(False):
    module = nnx.eval_shape(lambda: _build(cfg, part, KeyStream(0)))
  return nnx.split(module)


def _per_variable(cfg: ModelConfig, fn) -> dict:
  """A params-shaped tree of fn(variable, stacked) over every parameter."""

  def tree(part: str, stacked: bool) -> dict:
    state = _abstract(cfg, part)[1]
    mapped = jax.tree.map(lambda v: fn(v, stacked), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(mapped)

  out = tree(_OUTER, False)
  for name, _ in stacks(cfg):
    out[name] = tree(name, True)
  return out


def logical_axes(cfg: ModelConfig) -> dict:
  """The params tree with each leaf replaced by its tuple of logical axis names (stacks: `layers` first)."""
  return _per_variable(
    cfg, lambda v, stacked: ("layers",) * stacked + tuple(v.get_metadata()["out_sharding"])
  )


def trainable_mask(cfg: ModelConfig) -> dict:
  """True for leaves the optimizer updates; False for the router bias (moved by its own rule)."""
  return _per_variable(cfg, lambda v, stacked: isinstance(v, nnx.Param))


def _init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  with nnx.use_eager_sharding(False):
    out = nnx.to_pure_dict(nnx.state(Outer(cfg, KeyStream(jax.random.fold_in(key, 0)))))
    for i, (name, n) in enumerate(stacks(cfg)):
      keys = jax.random.split(jax.random.fold_in(key, i + 1), n)
      out[name] = jax.vmap(lambda k, name=name: nnx.to_pure_dict(nnx.state(_build(cfg, name, KeyStream(k)))))(
        keys
      )
  return out


@functools.lru_cache(maxsize=32)
def abstract_params(cfg: ModelConfig) -> dict:
  """The parameter tree as ShapeDtypeStructs: no memory, no compute, cost independent of depth."""
  return jax.eval_shape(functools.partial(_init_params, cfg), jax.random.key(0))


def init(cfg: ModelConfig, rng: jax.Array, meshes: sharding.Meshes | None = None) -> dict:
  """Random parameters, each created directly in its shard (expert mesh or dense mesh)."""
  out_shardings = None
  if meshes is not None:
    out_shardings = sharding.param_shardings(logical_axes(cfg), abstract_params(cfg), meshes)
  return jax.jit(functools.partial(_init_params, cfg), out_shardings=out_shardings)(rng)


_REMAT_POLICIES = {
  "full": None,  # save only each block's input; recompute everything else in the backward pass
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
  "dots_with_batch": jax.checkpoint_policies.dots_saveable,  # also batched (attention) matmuls
}


def _run_stack(cfg, name, stack, x_BTD, ctx, kv, layer0, routed_LBTK, meshes):
  """Scans one stack's layers over x; returns (x, kv, MoE aux, max logits [L, H]).

  kv: None (no cache), or the latent cache of *all* layers, (latent [L_all, B, S, C], rope keys
  [L_all, B, S, R]), carried through the scan: layer layer0 + i writes its new entries in place
  (`dynamic_update_slice` on the loop-carried buffer) and reads its own slice. Nothing stacks or
  concatenates per-layer caches, so a decode step costs no copy of the whole cache.
  """
  graphdef, abstract = _abstract(cfg, name)
  cos, sin, pos_BT, seg_BT, shared_cache, balanced = ctx

  def body(carry, xs):
    x_BTD, i, kv = carry
    layer_params, forced_BTK = xs
    state = jax.tree.map(lambda v: v, abstract)  # fresh Variables to fill
    nnx.replace_by_pure_dict(state, layer_params)
    block = nnx.merge(graphdef, state)
    cache = None if kv is None else (*kv, layer0 + i, *shared_cache)
    x_BTD, kv, aux, max_logit_H = block(x_BTD, cos, sin, pos_BT, seg_BT, cache, meshes, forced_BTK, balanced)
    return (x_BTD, i + 1, kv), (aux, max_logit_H)

  if isinstance(stack, list):  # `unstack_layers`: one layer at a time, no slicing of stacked weights
    carry, ys = (x_BTD, jnp.zeros((), jnp.int32), kv), []
    for i, layer_params in enumerate(stack):
      carry, y = body(carry, (layer_params, None if routed_LBTK is None else routed_LBTK[i]))
      ys.append(y)
    (x_BTD, _, kv), (aux, max_logit_LH) = carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
    return x_BTD, kv, aux, max_logit_LH
  n = jax.tree.leaves(stack)[0].shape[0]
  if kv is None and cfg.remat != "none":  # training: recompute the block in the backward pass
    # A loop keeps XLA from merging the recomputation with the forward pass (CSE), so scanned bodies
    # skip jax's optimisation barrier; XLA removes a loop of one iteration (or an unrolled one), and
    # without the barrier the "recomputed" block reused the forward's buffers: no remat at all.
    barrier = n == 1 or not cfg.scan_layers
    body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=barrier)
  (x_BTD, _, kv), (aux, max_logit_LH) = jax.lax.scan(
    body, (x_BTD, jnp.zeros((), jnp.int32), kv), (stack, routed_LBTK), unroll=1 if cfg.scan_layers else n
  )
  return x_BTD, kv, aux, max_logit_LH


def _forward(params, cfg, tokens_BT, pos_BT, seg_BT, cache, meshes, routed_experts_LBTK, balanced):
  """Logits and aux of `apply` (arguments already checked and defaulted)."""
  x_BTD = embed(params["embed"], tokens_BT, cfg.dtype, meshes)
  x_BTD = sharding.constrain(x_BTD, ("batch", "seq", "act_embed"), meshes)
  cos, sin = rope.cos_sin(cfg, pos_BT)
  shared_cache, kv = (), None
  if cache is not None:
    cache = cache if meshes is None else _on_cache_layout(cache, meshes, tokens_BT.shape[1])
    index = jnp.asarray(cache["index"], jnp.int32)
    k_pos = jax.lax.dynamic_update_slice_in_dim(cache["positions"], pos_BT.astype(jnp.int32), index, 1)
    k_seg = jax.lax.dynamic_update_slice_in_dim(cache["segments"], seg_BT.astype(jnp.int32), index, 1)
    shared_cache, kv = (index, k_pos, k_seg), (cache["latent"], cache["k_rope"])
  ctx = (cos, sin, pos_BT, seg_BT, shared_cache, balanced)
  max_logits, moe_aux, start = [], None, 0
  for name, n in stacks(cfg):
    routed_LBTK = routed_experts_LBTK if name == MOE else None
    x_BTD, kv, aux, max_logit_LH = _run_stack(
      cfg, name, params[name], x_BTD, ctx, kv, start, routed_LBTK, meshes
    )
    max_logits.append(max_logit_LH)
    if aux is not None:
      moe_aux = aux
    start += n
  x_BTD = rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps)
  logits_BTV = head(params, cfg, x_BTD)
  aux = _collect_aux(moe_aux, cfg, tokens_BT.shape)
  aux["hidden"] = x_BTD  # what the head reads: a caller may score a few positions with `head` itself
  # [L, H]: each head's largest attention logit, layers in order
  aux["max_logit"] = jnp.concatenate(max_logits) if max_logits else jnp.zeros((0, cfg.n_heads), jnp.float32)
  if cache is not None:
    new_cache = {
      "index": cache["index"] + tokens_BT.shape[1],
      "positions": shared_cache[1],
      "segments": shared_cache[2],
      "latent": kv[0],
      "k_rope": kv[1],
    }
    # on the layout it came in (rows like the batch), so a donated cache is updated in place
    aux["cache"] = new_cache if meshes is None else _on_cache_layout(new_cache, meshes, tokens_BT.shape[1])
  return logits_BTV, aux


def _on_cache_layout(cache: dict, meshes: sharding.Meshes, new_tokens: int) -> dict:
  where = sharding.cache_shardings(cache, meshes, decode=new_tokens == 1)
  return jax.lax.with_sharding_constraint(cache, where)


def head(params: dict, cfg: ModelConfig, x_BTD: jax.Array) -> jax.Array:
  """float32 logits of final-normed hidden states [..., D] (`apply`'s aux["hidden"])."""
  head_DV = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return project("...d,dv->...v", x_BTD, head_DV, cfg.dtype).astype(jnp.float32)


def _collect_aux(moe_aux: dict | None, cfg: ModelConfig, tokens_shape: tuple[int, int]) -> dict:
  """The MoE stack's per-layer aux ([L, ...] from the scan) as the model's aux metrics."""
  if moe_aux is None:
    zero = jnp.zeros((), jnp.float32)
    return {
      "expert_load": jnp.zeros((0, cfg.n_experts)),
      "overflow": zero,
      "balance_loss": zero,
      "routed_experts": jnp.zeros((0, *tokens_shape, cfg.top_k), jnp.int32),
    }
  return {
    "expert_load": moe_aux["expert_load"],  # [L_moe, E]
    "overflow": jnp.sum(moe_aux["overflow"]),  # dropped assignments, all layers
    "balance_loss": jnp.mean(moe_aux["balance_loss"]),
    "routed_experts": moe_aux["routed_experts"],  # [L_moe, B, T, K]
  }


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
  balanced: bool = False,
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
  `routed_experts` int32 [MoE layers, B, T, top_k] the experts used (replayed or chosen),
  `max_logit` [layers, H] each head's largest attention logit (what QK-clip caps), `hidden` [B, T, D]
  the final-normed states the head reads (unused, it costs nothing: XLA drops it).
  balanced: the rows are in `context_balance.balance_sequence` order over the dense mesh's context shards
  (context load balancing, `ModelConfig.context_load_balance`): the caller reordered tokens, positions
  and segment ids (and routed_experts) alike and gets logits and aux in that order. Positions must be
  given (RoPE and the masks follow them); no cache (decoding never reorders). A no-op without a context
  split.
  """
  tokens = jnp.asarray(tokens)
  _check_tokens(tokens, cfg)
  B, T = tokens.shape
  balanced = balanced and meshes is not None and sharding.degrees(meshes).seq > 1
  if balanced:
    if cache is not None or positions is None:
      raise ValueError(
        "balanced=True is for a training forward (no cache) with its reordered positions given"
      )
    impl = backend.attention_impl(cfg.attention_impl, meshes)
    check_context_balance(impl, sharding.degrees(meshes).seq, T, "the sequence")
  if positions is None:
    start = 0 if cache is None else cache["index"]
    positions = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  if routed_experts is not None:
    want = (cfg.n_moe_layers, B, T, cfg.top_k)
    if tuple(routed_experts.shape) != want:
      raise ValueError(
        f"routed_experts must be [MoE layers, B, T, top_k] = {list(want)}; got {list(routed_experts.shape)}."
      )
  return _forward(params, cfg, tokens, positions, segment_ids, cache, meshes, routed_experts, balanced)


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
