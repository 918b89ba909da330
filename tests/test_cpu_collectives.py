"""The CPU stand-in for `jax.lax.ragged_all_to_all` against a NumPy model of the op's documented semantics
(jax's docstring): slice i of a sender's operand goes to device i // (K / P) and lands at the sender's
output_offsets[i] in that device's buffer; the receiver writes recv_sizes[j] rows for its slice j; every
other row of the output buffer is kept. Its result is typed like the native op's: like the output buffer.

Shape suffixes: S source devices, P destination devices, R slices per destination, K slices (P·R),
N operand rows, M output rows, D row width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from composer_jax.model import cpu_collectives, varying

P, R, N, M, D = 8, 2, 48, 56, 3
K = P * R


def _layout(rng):
  """Offsets and sizes of a random exchange: every sender lays its K slices out in order with gaps
  (padding) between them; every receiver places its K incoming slices in a random order with gaps."""
  sizes_SPR = rng.integers(0, 3, (P, P, R))  # zero-size slices included
  in_off_SK, send_SK = np.zeros((P, K), np.int32), np.zeros((P, K), np.int32)
  out_off_SK, recv_PK = np.zeros((P, K), np.int32), np.zeros((P, K), np.int32)
  for s in range(P):
    cursor = 0
    for i in range(K):
      p, r = divmod(i, R)
      cursor += rng.integers(0, 2)
      in_off_SK[s, i], send_SK[s, i] = cursor, sizes_SPR[s, p, r]
      cursor += sizes_SPR[s, p, r]
    assert cursor <= N
  for p in range(P):
    cursor = 0
    for j in rng.permutation(K):  # my slice j comes from device j // R, its slice p·R + j % R
      s, r = divmod(j, R)
      cursor += rng.integers(0, 2)
      out_off_SK[s, p * R + r], recv_PK[p, j] = cursor, sizes_SPR[s, p, r]
      cursor += sizes_SPR[s, p, r]
    assert cursor <= M
  return in_off_SK, send_SK, out_off_SK, recv_PK


def np_ragged_all_to_all(operand_SND, output_PMD, in_off_SK, send_SK, out_off_SK, recv_PK):
  """The docstring's pseudocode: SEND every slice, write each at the offset its sender named."""
  result = output_PMD.copy()
  for s in range(P):
    for i in range(K):
      p, r = divmod(i, R)
      n = send_SK[s, i]
      assert recv_PK[p, s * R + r] == n  # the sizes the docstring requires to agree
      result[p, out_off_SK[s, i] : out_off_SK[s, i] + n] = operand_SND[
        s, in_off_SK[s, i] : in_off_SK[s, i] + n
      ]
  return result


def np_ragged_all_to_all_grads(cot_PMD, in_off_SK, send_SK, out_off_SK):
  """Gradients of Σ result·cot: each sent row gets the cotangent of the row it landed on; the output
  buffer's rows keep theirs unless overwritten."""
  d_operand, d_output = np.zeros((P, N, D)), cot_PMD.copy()
  for s in range(P):
    for i in range(K):
      p, n, o = i // R, send_SK[s, i], out_off_SK[s, i]
      d_operand[s, in_off_SK[s, i] : in_off_SK[s, i] + n] += cot_PMD[p, o : o + n]
      d_output[p, o : o + n] = 0
  return d_operand, d_output


def test_stand_in_matches_the_documented_semantics_with_gradients():
  """Eight devices, two slices per destination, zero-size slices, gaps on both sides, a non-zero output
  buffer (its untouched rows kept): values and both gradients against NumPy."""
  rng = np.random.default_rng(0)
  layout = _layout(rng)
  operand_SND = rng.standard_normal((P, N, D)).astype(np.float32)
  output_PMD = rng.standard_normal((P, M, D)).astype(np.float32)
  cot_PMD = rng.standard_normal((P, M, D)).astype(np.float32)
  mesh = jax.make_mesh((P,), ("x",), axis_types=(AxisType.Auto,))
  exchange = jax.shard_map(
    lambda *a: cpu_collectives.ragged_all_to_all(*a, axis_name="x"),
    mesh=mesh,
    in_specs=PartitionSpec("x"),
    out_specs=PartitionSpec("x"),
  )

  def loss(operand, output):
    result = exchange(operand, output, *(a.reshape(-1) for a in layout))
    return jnp.sum(result * cot_PMD.reshape(P * M, D)), result

  (_, result), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
    operand_SND.reshape(P * N, D), output_PMD.reshape(P * M, D)
  )
  want = np_ragged_all_to_all(operand_SND, output_PMD, *layout)
  assert (want != output_PMD).any(axis=-1).sum() > 100  # rows were written, and others kept
  np.testing.assert_array_equal(np.asarray(result).reshape(P, M, D), want)
  want_grads = np_ragged_all_to_all_grads(cot_PMD, layout[0], layout[1], layout[2])
  for g, w, n in zip(grads, want_grads, (N, M), strict=True):
    np.testing.assert_allclose(np.asarray(g).reshape(P, n, D), w, rtol=1e-6)


def test_stand_in_is_typed_like_its_output_buffer_as_the_native_op():
  """Inside `shard_map` the native op's result has the type of its output buffer: invariant for a bare
  `jnp.zeros` even though it holds other devices' rows (the backward pass then sums its cotangent over
  the axis). The stand-in types it the same, so that bug shows in CPU numerics. Tracing only."""
  layout = [a.reshape(-1) for a in _layout(np.random.default_rng(1))]
  mesh = jax.make_mesh((P,), ("x",), axis_types=(AxisType.Auto,))
  seen = {}

  def body(operand, *offsets_and_sizes):
    bare = jnp.zeros((M, D), operand.dtype)
    for name, op in (("native", jax.lax.ragged_all_to_all), ("stand-in", cpu_collectives.ragged_all_to_all)):
      for buffer, typed in ((bare, "bare"), (varying.vary_like(bare, operand), "varying")):
        seen[name, typed] = varying.varying_axes(op(operand, buffer, *offsets_and_sizes, axis_name="x"))
    return operand

  fn = jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x"))
  jax.eval_shape(fn, jax.ShapeDtypeStruct((P * N, D), jnp.float32), *layout)
  assert seen == {
    ("native", "bare"): set(),
    ("native", "varying"): {"x"},
    ("stand-in", "bare"): set(),
    ("stand-in", "varying"): {"x"},
  }
