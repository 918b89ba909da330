"""`ragged_all_to_all` for backends without one (XLA:CPU: "HLO opcode ragged-all-to-all is not supported",
jax #34755), so the ragged expert dispatch runs, forward and backward, in the CPU test suite.

`ragged_all_to_all` here has `jax.lax.ragged_all_to_all`'s signature and semantics (its docstring): slice i
of the caller's `operand` (rows input_offsets[i] : + send_sizes[i]) goes to device i // (K / P) of the axis
(K slices, P devices), landing there at row output_offsets[i] (an offset in the *receiver's* buffer, as the
sender sees it); the receiver writes recv_sizes[i] rows of its slice i; every other row of `output` is kept.
It is built from collectives XLA:CPU has: each slice padded to min(N, M) rows (N operand rows, M output
rows, the longest a valid slice can be), one tiled `all_to_all` of the padded slices [K, min(N, M), ...]
and one of the output offsets, then a scatter of the received rows into `output` (rows past M dropped).
That moves P·min(N, M) rows per device where the native op moves the slices' rows: a test-sized stand-in.

It is its own primitive, typed as the native op is: the result has the type of `output` (varying over
the axes `output` varies over, not those of `operand`), and its JVP and transpose are the native op's
rules. So an output buffer typed invariant inside `shard_map` gives a result typed invariant here too, and
the backward pass sums its cotangent over the axis, as it does on TPU and GPU: the bug of a receive buffer
made with a bare `jnp.zeros` shows in CPU numerics. `expert_parallel` picks it where the mesh's platform
has no native op (`backend.native_ragged_all_to_all`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from composer_jax.model import varying

_ragged_all_to_all_p = Primitive("cpu_ragged_all_to_all")


def ragged_all_to_all(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
  """`jax.lax.ragged_all_to_all` from all_to_all and a scatter (module docstring); call inside `shard_map`."""
  if axis_index_groups is not None:
    raise NotImplementedError("The ragged_all_to_all stand-in takes no axis_index_groups.")
  axes = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
  n_slices, n_devices = input_offsets.shape[0], jax.lax.axis_size(axes)
  if n_slices % n_devices:
    raise ValueError(f"{n_slices} slices do not split over the {n_devices} devices of axes {axes}.")
  for name, a in zip(
    ("input_offsets", "send_sizes", "output_offsets", "recv_sizes"),
    (input_offsets, send_sizes, output_offsets, recv_sizes),
    strict=True,
  ):
    if a.shape != (n_slices,) or not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(
        f"ragged_all_to_all {name} must be integer of shape ({n_slices},), got {a.dtype}{a.shape}."
      )
  return _ragged_all_to_all_p.bind(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes
  )


def _abstract_eval(operand, output, *offsets_and_sizes, axis_name):
  """The native op's type: `output`'s, whatever `operand` varies over."""
  del operand, offsets_and_sizes, axis_name
  return output.update(shape=output.shape, weak_type=False)


def _slice_rows(offsets_K, sizes_K, width: int, bound: int):
  """Rows offsets[i] + c of slice i for c < width [K, width], `bound` (out of range) where c ≥ sizes[i]."""
  c = jnp.arange(width)[None, :]
  return jnp.where(c < sizes_K[:, None], offsets_K[:, None] + c, bound)


def _exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """The lowering: padded slices through `all_to_all`, scattered into `output` on the receiver."""
  # Values are per-device here whatever their type says: typed varying, all_to_all takes them as they are.
  operand, input_offsets, send_sizes, output_offsets = (
    jax.lax.pcast(a, tuple(sorted(set(axis_name) - varying.varying_axes(a))), to="varying")
    for a in (operand, input_offsets, send_sizes, output_offsets)
  )
  N, M = operand.shape[0], output.shape[0]
  width = max(1, min(N, M))  # the longest valid slice
  send_rows = _slice_rows(input_offsets, send_sizes, width, N)
  filled = (send_rows < N).reshape(*send_rows.shape, *(1,) * (operand.ndim - 1))
  send = jnp.where(filled, operand[jnp.clip(send_rows, 0, max(N - 1, 0))], 0)
  recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)
  # Slice i came from device i // (K / P); where it goes in my buffer is in that device's output_offsets.
  recv_offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  rows = _slice_rows(recv_offsets, recv_sizes, width, M).reshape(-1)
  return output.at[rows].set(recv.reshape(-1, *output.shape[1:]).astype(output.dtype), mode="drop")


def _jvp(primals, tangents, *, axis_name):
  """The native rule: the op is linear in (operand, output) and moves tangents as it moves values."""
  operand, output, *offsets_and_sizes = primals
  operand_dot, output_dot, *_ = tangents
  result = _ragged_all_to_all_p.bind(operand, output, *offsets_and_sizes, axis_name=axis_name)
  if type(operand_dot) is type(output_dot) is ad.Zero:
    return result, ad.Zero(jax.typeof(result).to_tangent_aval())
  operand_dot, output_dot = ad.instantiate_zeros(operand_dot), ad.instantiate_zeros(output_dot)
  return result, _ragged_all_to_all_p.bind(operand_dot, output_dot, *offsets_and_sizes, axis_name=axis_name)


def _transpose(t, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """The native rule: received rows' cotangents travel back to the slices they came from; the rows of
  `output` the op overwrote get none."""
  if type(t) is ad.Zero:
    operand_t = ad.Zero(operand.aval) if ad.is_undefined_primal(operand) else None
    output_t = ad.Zero(output.aval) if ad.is_undefined_primal(output) else None
    return [operand_t, output_t] + [None] * 4
  recv_offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  sent_from = jax.lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)
  operand_t = _ragged_all_to_all_p.bind(
    t, ad.zeros_like_aval(operand.aval), recv_offsets, recv_sizes, sent_from, send_sizes, axis_name=axis_name
  )
  M = t.shape[0]
  rows = _slice_rows(recv_offsets, recv_sizes, max(1, min(operand.aval.shape[0], M)), M).reshape(-1)
  written = jnp.zeros((M,), bool).at[rows].set(True, mode="drop")
  output_t = jnp.where(written.reshape(M, *(1,) * (t.ndim - 1)), jnp.zeros_like(t), t)
  return [operand_t, output_t] + [None] * 4


def _impl(*args, **params):
  raise RuntimeError("ragged_all_to_all (stand-in) must be used within a mapped context such as shard_map.")


_ragged_all_to_all_p.def_impl(_impl)
_ragged_all_to_all_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[_ragged_all_to_all_p] = _jvp
ad.primitive_transposes[_ragged_all_to_all_p] = _transpose
mlir.register_lowering(_ragged_all_to_all_p, mlir.lower_fun(_exchange, multiple_results=False))
