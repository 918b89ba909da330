"""Softmax attention over per-head keys and values (MLA's expanded training form), one function per kernel.

Shape suffixes: B batch, T query time, S key time, H heads, K q·k head dim, V value head dim, C chunk.

Every kernel returns the output [B, T, H, V] and each head's largest visible logit [H] (scale included,
no gradient): what QK-clip caps (Kimi K2 MuonClip). `backend.attention_impl` picks the kernel per
platform:
- "xla": scores materialised in float32 with the exact visibility rule of `attention.attend` (same
  segment and key position ≤ query position); the CPU path, and the reference of the others.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` (flash attention in cuDNN) with
  `is_causal` and a same-segment mask; V is zero-padded to K (cuDNN wants one head dim for K and V).
  The max logits come from a separate pass over query chunks (`chunked_max_logits`): cuDNN returns only
  the log-sum-exp, an upper bound of the max that is up to ln(S) too high.
- "splash": tokamax's splash attention (Pallas TPU kernel, block-sparse causal mask, segment ids), which
  also returns each query row's max logit; `interpret=True` runs it on CPU (tests).
The fused kernels mask by *index* order (causal) and segment ids; that equals the position rule when
positions increase along every segment, as in packed training rows (the tests check both agree). With
context load balancing (`layout.balanced`) splash's causal mask reads each query row's natural index.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax import context_balance
from composer_jax.model import tokamax_private

_MASKED = -1e30  # finite, so a query with no visible key (padding) gives zeros, not NaN
_MAX_LOGIT_CHUNK = 512  # query rows per step of `chunked_max_logits`


def visible(q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS) -> jax.Array:
  """[B, T, S]: query t sees key s iff same segment and pos_s ≤ pos_t."""
  return (k_pos_BS[:, None, :] <= q_pos_BT[:, :, None]) & (k_seg_BS[:, None, :] == q_seg_BT[:, :, None])


def chunk_count(t: int, chunk: int) -> int:
  """The fewest chunks n that divide `t` positions into chunks of at most `chunk` (1: no chunking)."""
  if chunk <= 0 or t <= chunk:
    return 1
  return next(n for n in range(-(-t // chunk), t + 1) if t % n == 0)


def split_columns(x_BT: jax.Array, n: int) -> jax.Array:
  """[B, T, ...] → [n, B, T/n, ...], chunk j holding columns i·n + j: an axis split over devices in
  contiguous blocks stays split inside every chunk."""
  B, T = x_BT.shape[:2]
  return jnp.moveaxis(x_BT.reshape(B, T // n, n, *x_BT.shape[2:]), 2, 0)


def join_columns(x_nBC: jax.Array) -> jax.Array:
  """The inverse of `split_columns`: [n, B, C, ...] → [B, n·C, ...]."""
  n, B, C = x_nBC.shape[:3]
  return jnp.moveaxis(x_nBC, 0, 2).reshape(B, n * C, *x_nBC.shape[3:])


def by_query_chunks(fn, q_side: tuple, chunk: int):
  """`fn(*q_side) -> (out [B, T, ...], max_logit [H])` over chunks of at most `chunk` query positions.

  Each query row's softmax is over all of its keys either way, so the result is the whole-T one up to the
  matmuls' float order; the keys and values `fn` closes over are shared by every chunk. Each chunk runs
  under `jax.checkpoint`, so the backward pass recomputes its scores: one chunk's [B, C, H, S] fp32 scores
  live at a time, memory linear in T instead of quadratic. Chunk j takes columns i·n + j (n chunks), so a
  query axis split over context devices in contiguous blocks stays split inside every chunk."""
  n = chunk_count(q_side[0].shape[1], chunk)
  if n == 1:
    return fn(*q_side)
  one = jax.checkpoint(lambda xs: fn(*xs))
  out_nBC, max_nH = jax.lax.map(one, tuple(split_columns(x, n) for x in q_side))
  return join_columns(out_nBC), jnp.max(max_nH, axis=0)


def xla(q_BTHK, k_BSHK, v_BSHV, scale, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, *, chunk: int = 0):
  """Reference kernel: fp32 scores [B, T, H, S], additive mask, fp32 softmax; with `chunk` > 0 over
  query chunks (`by_query_chunks`)."""
  if chunk_count(q_BTHK.shape[1], chunk) > 1:
    whole = lambda q, qp, qs: xla(q, k_BSHK, v_BSHV, scale, qp, k_pos_BS, qs, k_seg_BS)  # noqa: E731
    return by_query_chunks(whole, (q_BTHK, q_pos_BT, q_seg_BT), chunk)
  bias_BT1S = jnp.where(visible(q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS), 0.0, _MASKED)[:, :, None, :]
  scores_BTHS = jnp.einsum("bthk,bshk->bths", q_BTHK, k_BSHK, preferred_element_type=jnp.float32) * scale
  probs_BTHS = jax.nn.softmax(scores_BTHS + bias_BT1S, axis=-1).astype(v_BSHV.dtype)
  out_BTHV = jnp.einsum("bths,bshv->bthv", probs_BTHS, v_BSHV, preferred_element_type=jnp.float32)
  max_logit_H = jnp.max(jax.lax.stop_gradient(scores_BTHS) + bias_BT1S, axis=(0, 1, 3))
  return out_BTHV.astype(v_BSHV.dtype), max_logit_H


def chunked_max_logits(q_BTHK, k_BSHK, scale, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS) -> jax.Array:
  """Each head's largest visible logit [H] without holding all [B, T, H, S] scores: a scan over query
  chunks (one extra Q·Kᵀ of forward FLOPs, no gradient)."""
  q_BTHK, k_BSHK = jax.lax.stop_gradient(q_BTHK), jax.lax.stop_gradient(k_BSHK)
  B, T = q_pos_BT.shape
  c = min(_MAX_LOGIT_CHUNK, T)
  if T % c:
    c = T
  split = lambda x: jnp.moveaxis(x.reshape(B, T // c, c, *x.shape[2:]), 1, 0)  # noqa: E731

  def step(best_H, xs):
    q_BCHK, pos_BC, seg_BC = xs
    s_BCHS = jnp.einsum("bchk,bshk->bchs", q_BCHK, k_BSHK, preferred_element_type=jnp.float32) * scale
    seen_BC1S = visible(pos_BC, k_pos_BS, seg_BC, k_seg_BS)[:, :, None, :]
    return jnp.maximum(best_H, jnp.max(jnp.where(seen_BC1S, s_BCHS, _MASKED), axis=(0, 1, 3))), None

  init = jnp.full((q_BTHK.shape[2],), _MASKED, jnp.float32)
  return jax.lax.scan(step, init, (split(q_BTHK), split(q_pos_BT), split(q_seg_BT)))[0]


def cudnn(q_BTHK, k_BSHK, v_BSHV, scale, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS):
  """cuDNN flash attention (GPU): causal by index, a same-segment mask, V padded to K."""
  K, V = q_BTHK.shape[-1], v_BSHV.shape[-1]
  v_BSHK = jnp.pad(v_BSHV, ((0, 0), (0, 0), (0, 0), (0, K - V))) if K > V else v_BSHV
  same_B1TS = (q_seg_BT[:, :, None] == k_seg_BS[:, None, :])[:, None]
  out_BTHK = jax.nn.dot_product_attention(
    q_BTHK, k_BSHK, v_BSHK, mask=same_B1TS, scale=scale, is_causal=True, implementation="cudnn"
  )
  max_logit_H = chunked_max_logits(q_BTHK, k_BSHK, scale, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)
  return out_BTHK[..., :V], max_logit_H


SPLASH_BLOCK = 128  # query and key rows per kernel block: the TPU's lanes (the backward kernel needs it)


def splash_fits(t: int, s: int, layout=None) -> bool:
  """Whether splash takes T queries and S keys: each query shard (`layout`'s context split) and the keys
  cut into whole `SPLASH_BLOCK`-row blocks."""
  q_shards = 1 if layout is None else layout.size(layout.seq)
  return t % (q_shards * SPLASH_BLOCK) == 0 and s % SPLASH_BLOCK == 0


@functools.lru_cache(maxsize=16)
def _splash_kernel(t: int, s: int, q_shards: int, interpret: bool, balanced: bool = False):
  """tokamax's splash MHA for a causal [T, S] mask (one mask for every head), its queries split in
  `q_shards` (context parallelism); built once per shape, the mask being static. `balanced`: the queries
  in the load-balanced order (`_causal_mask`)."""
  kernel = tokamax_private.module("splash_kernel")  # not in tokamax's public API: see tokamax_private
  masks = tokamax_private.module("splash_mask")
  b = SPLASH_BLOCK
  config = kernel.SplashConfig(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    use_base2_exp=False,
    # dq summed over 3 partial buffers in the input dtype; the default keeps one fp32 dq per key block
    # ([S/128, H, T, K]: 6.4 GB of temporaries at Kimi's 64 heads and T 4096, XLA:TPU's buffer assignment).
    dq_reduction_steps=3,
    interpret=interpret,
  )
  mask = _causal_mask(masks, t, s, q_shards, balanced)  # tokamax 0.0.12: one 2-D mask for all heads
  # The kernel is cached across traces: its mask info must be constants, never tracers of the first trace.
  with jax.ensure_compile_time_eval():
    return kernel, kernel.make_splash_mha(mask, config=config, save_residuals=True, q_seq_shards=q_shards)


def _causal_mask(masks, t: int, s: int, q_shards: int, balanced: bool):
  """tokamax's causal [T, S] mask (`masks`: its mask module). `balanced`: query row j is natural position
  `context_balance.balance_sequence(arange(T), q_shards)[j]` (keys in index order), set as the mask's
  `q_sequence`, which both the kernel's mask function and its block-sparsity info read (MaxText's
  load-balanced causal mask does the same)."""
  causal = masks.CausalMask((t, s))
  if balanced:
    causal.q_sequence = context_balance.balance_sequence(np.arange(t, dtype=np.int32), q_shards, axis=0)
  return causal


def _splash_rows(module, kernel, q_BTHK, k_BSHK, v_BSHV, q_seg_BT, k_seg_BS):
  """The kernel on each batch row (vmapped); returns the output and each row's per-head max logit."""

  def one(q_THK, k_SHK, v_SHV, q_seg_T, k_seg_S):
    seg = module.SegmentIds(q=q_seg_T, kv=k_seg_S)
    swap = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731  (the kernel wants heads first)
    out_HTV, stats = kernel(swap(q_THK), swap(k_SHK), swap(v_SHV), segment_ids=seg)
    return swap(out_HTV), jnp.max(stats["max_logits"], axis=1)

  return jax.vmap(one)(q_BTHK, k_BSHK, v_BSHV, q_seg_BT.astype(jnp.int32), k_seg_BS.astype(jnp.int32))


def splash(
  q_BTHK, k_BSHK, v_BSHV, scale, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, *, layout=None, interpret=False
):
  """tokamax splash attention. With a `sharding.AttentionLayout`, inside `shard_map` over the dense mesh:
  batch rows split, queries split over the context axis (the kernel's mask info split alike, so each
  shard masks by its rows' global indices), keys and values whole; the max logits reduced over all."""
  T, S = q_BTHK.shape[1], k_BSHK.shape[1]
  if not splash_fits(T, S, layout):
    raise ValueError(
      f"splash attention cuts each query shard and the keys into {SPLASH_BLOCK}-row blocks: T={T}, S={S} "
      f"do not split so; attention_impl='xla' takes any shape"
    )
  q_shards = 1 if layout is None else layout.size(layout.seq)
  balanced = layout is not None and layout.balanced
  module, kernel = _splash_kernel(T, S, q_shards, interpret, balanced)
  q_BTHK = q_BTHK * scale  # the kernel computes q·k unscaled
  if layout is None:
    out_BTHV, max_BH = _splash_rows(module, kernel, q_BTHK, k_BSHK, v_BSHV, q_seg_BT, k_seg_BS)
    return out_BTHV.astype(v_BSHV.dtype), jax.lax.stop_gradient(jnp.max(max_BH, axis=0))
  axes = tuple(
    a for rule in (layout.batch, layout.seq) for a in ((rule,) if isinstance(rule, str) else rule or ())
  )

  def body(kernel, q, k, v, q_seg, k_seg):
    out, max_bh = _splash_rows(module, kernel, q, k, v, q_seg, k_seg)
    # No gradient flows through the max logits, and pmax has no differentiation rule: stop it first.
    return out, jax.lax.pmax(jax.lax.stop_gradient(jnp.max(max_bh, axis=0)), axes)

  kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(layout.mesh, layout.spec("seq")))
  q_spec, kv_spec = layout.spec("batch", "seq", None, None), layout.spec("batch", None, None, None)
  out_BTHV, max_H = jax.shard_map(
    body,
    mesh=layout.mesh,
    in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, layout.spec("batch", "seq"), layout.spec("batch", None)),
    out_specs=(q_spec, layout.spec()),
    check_vma=False,
  )(kernel, q_BTHK, k_BSHK, v_BSHV, q_seg_BT, k_seg_BS)
  return out_BTHV.astype(v_BSHV.dtype), jax.lax.stop_gradient(max_H.astype(jnp.float32))


KERNELS = {"xla": xla, "cudnn": cudnn, "splash": splash}


def attention(impl: str, *args, **kwargs):
  """Dispatch to a kernel by name (`KERNELS`)."""
  if impl not in KERNELS:
    raise ValueError(f"attention kernel {impl!r} unknown; known: {sorted(KERNELS)}")
  return KERNELS[impl](*args, **kwargs)


def padding_free_positions(positions: np.ndarray, segments: np.ndarray) -> bool:
  """True when positions increase by one along every segment of every row (what the fused kernels'
  index-order mask assumes)."""
  same = segments[:, 1:] == segments[:, :-1]
  return bool(np.all(~same | (positions[:, 1:] == positions[:, :-1] + 1)))
