"""Next-token log-probabilities and the masked (sum, count) losses built from them.

Shape suffixes: B batch, T time, V vocab.

Every loss here returns `(sum, count)`: summed over micro-batches and divided once, they give exactly the
whole batch's mean (never a mean of per-micro-batch means). One log-prob function serves pretraining,
SFT, RL and evaluation, so the alignment convention (logits at column t predict token t + 1) lives in
one place.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

from composer_jax.model.attention_kernels import chunk_count, join_columns, split_columns


def next_token_logp(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """log p(tokens[:, t + 1] | tokens[:, ≤ t]) for t < T - 1, float32 [B, T - 1]."""
  chex.assert_rank([logits_BTV, tokens_BT], [3, 2])
  chex.assert_equal_shape_prefix([logits_BTV, tokens_BT], 2)
  return target_logp(logits_BTV[:, :-1], tokens_BT[:, 1:])


def target_logp(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """log p(targets[:, t]) under the logits of column t, float32 [B, T]."""
  chex.assert_type(targets_BT, int)
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


def token_logp(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """log p(token t | < t) aligned with the tokens (column 0, which nothing predicts, is 0), [B, T]."""
  return jnp.pad(next_token_logp(logits_BTV, tokens_BT), ((0, 0), (1, 0)))


def masked_sum(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(Σ x where mask, number of masked-in entries), float32; masked-out entries may hold inf/NaN."""
  chex.assert_equal_shape([x, mask])
  m = mask > 0 if mask.dtype != jnp.bool_ else mask
  return jnp.sum(jnp.where(m, x, 0.0)), jnp.sum(m).astype(jnp.float32)


def document_mask(segment_ids_BT: jax.Array) -> jax.Array:
  """[B, T - 1]: position t predicts t + 1 inside one document (same segment id, not padding 0)."""
  nxt_BT = segment_ids_BT[:, 1:]
  return (nxt_BT == segment_ids_BT[:, :-1]) & (nxt_BT != 0)


def next_token_loss(
  logits_BTV: jax.Array, tokens_BT: jax.Array, segment_ids_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(Σ −log p(next token), counted tokens) within documents: packing never teaches the model to
  predict across a document boundary."""
  return masked_sum(-next_token_logp(logits_BTV, tokens_BT), document_mask(segment_ids_BT))


def next_token_targets(tokens_BT: jax.Array, segment_ids_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each column's next token and whether `next_token_loss` counts it, [B, T] each (the last column
  predicts nothing: 0, not counted). With them every column carries its own target, so the columns can
  be reordered (context load balancing) and `target_loss` is `next_token_loss` up to float order."""
  pad = ((0, 0), (0, 1))
  return jnp.pad(tokens_BT[:, 1:], pad), jnp.pad(document_mask(segment_ids_BT), pad)


def target_loss(
  logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(Σ −log p(targets[:, t]) under column t's logits where mask, number counted)."""
  return masked_sum(-target_logp(logits_BTV, targets_BT), mask_BT)


def target_count(segment_ids_BT: jax.Array) -> jax.Array:
  """How many targets `next_token_loss` counts (the whole batch's normaliser for micro-batches)."""
  return jnp.sum(document_mask(segment_ids_BT)).astype(jnp.float32)


def masked_target_loss(
  logits_BTV: jax.Array, tokens_BT: jax.Array, target_mask_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(Σ −log p(token t + 1) where target_mask[t] is set, number of targets): SFT on chosen tokens."""
  return masked_sum(-next_token_logp(logits_BTV, tokens_BT), target_mask_BT[:, :-1] > 0)


def chunked_target_loss(
  hidden_BTD: jax.Array,
  head: Callable[[jax.Array], jax.Array],
  targets_BT: jax.Array,
  mask_BT: jax.Array,
  chunk: int,
) -> tuple[jax.Array, jax.Array]:
  """`target_loss(head(hidden), targets, mask)` computed `chunk` columns of every row at a time, each
  chunk's logits recomputed in the backward pass (`jax.checkpoint`): the whole [B, T, V] logits never
  exist. Chunk j takes columns i·n + j (n = T / chunk chunks), so a time axis split over devices in
  contiguous blocks stays split inside every chunk. The same sum up to float order."""
  B, T, D = hidden_BTD.shape
  if chunk <= 0 or chunk >= T or T % chunk:
    return target_loss(head(hidden_BTD), targets_BT, mask_BT)
  n = T // chunk

  def by_chunk(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, chunk, ...]
    return jnp.moveaxis(x.reshape(B, chunk, n, *x.shape[2:]), 2, 0)

  @jax.checkpoint
  def one(h_BcD: jax.Array, t_Bc: jax.Array, m_Bc: jax.Array) -> tuple[jax.Array, jax.Array]:
    return target_loss(head(h_BcD), t_Bc, m_Bc)

  def add(total, xs):
    s, c = one(*xs)
    return (total[0] + s, total[1] + c), None

  zero = jnp.zeros((), jnp.float32)
  (s, c), _ = jax.lax.scan(add, (zero, zero), (by_chunk(hidden_BTD), by_chunk(targets_BT), by_chunk(mask_BT)))
  return s, c


def chunked_token_logp(
  hidden_BTD: jax.Array, head: Callable[[jax.Array], jax.Array], tokens_BT: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
  """(`token_logp(head(hidden), tokens)`, the predictive entropy aligned the same way, no gradient), both
  float32 [B, T], from at most `chunk` columns of every row at a time (`chunk` 0: all at once).

  The RL loss needs every sampled token's log-prob, not a sum, so unlike `chunked_target_loss` the
  chunks' values are kept ([B, T] floats, not [B, T, V]); each chunk's logits are recomputed in the
  backward pass (`jax.checkpoint`). Chunk j takes columns i·n + j, as in `chunked_target_loss`."""
  targets_BT = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, 1)))  # column t predicts token t + 1

  def columns(h_BcD: jax.Array, t_Bc: jax.Array) -> tuple[jax.Array, jax.Array]:
    logp_BcV = jax.nn.log_softmax(head(h_BcD).astype(jnp.float32), axis=-1)
    sg_BcV = jax.lax.stop_gradient(logp_BcV)
    ent_Bc = -jnp.sum(jnp.exp(sg_BcV) * sg_BcV, axis=-1)
    return jnp.take_along_axis(logp_BcV, t_Bc[..., None], axis=-1)[..., 0], ent_Bc

  n = chunk_count(hidden_BTD.shape[1], chunk)
  if n == 1:
    logp_BT, ent_BT = columns(hidden_BTD, targets_BT)
  else:
    chunks = (split_columns(hidden_BTD, n), split_columns(targets_BT, n))
    logp_BT, ent_BT = map(join_columns, jax.lax.map(jax.checkpoint(lambda xs: columns(*xs)), chunks))
  shift = lambda x: jnp.pad(x[:, :-1], ((0, 0), (1, 0)))  # noqa: E731  aligned with the predicted tokens
  return shift(logp_BT), shift(ent_BT)
