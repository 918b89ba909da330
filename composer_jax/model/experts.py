"""Routed-expert kernels: one device's SwiGLU experts over its assignments, three interchangeable paths.

Shape suffixes: A assignments (token copies, one per chosen expert), D d_model, E experts, F expert
hidden, C capacity slots per expert, N row blocks, b rows per block, I/O a matmul's in/out width,
R rows of the padded block layout.

`experts_local` picks the path of `cfg.expert_impl` (already resolved from "auto" by the MoE layer,
`backend.expert_impl`):
- "ragged": sort assignments by expert → `jax.lax.ragged_dot` grouped matmuls → unsort. Dropless.
  XLA:CPU lowers ragged_dot as a masked dense matmul over all E groups (E× the work), and so does
  XLA:GPU (a zero-padded dense expansion: E_local× the FLOPs, out of memory at 48 local experts).
  XLA:TPU emits its own Mosaic grouped-matmul kernels for the forward and the input gradient, but
  the weight gradient becomes a convolution over all local groups that XLA counts at E_local× the
  grouped FLOPs.
- "tokamax": the same sort, with tokamax's grouped-matmul kernels (`tokamax.ragged_dot`: Pallas Mosaic
  on TPU, Triton on GPU; megablocks-style tiles over the sorted rows, grouped kernels for both
  gradients too). Needs tokamax (extra `kernels`) and `shard_map` around it (Mosaic kernels are not
  auto-partitioned): the expert-parallel dispatch provides it.
- "dense": every expert on every row, each row keeping its own expert's output. Exact and dropless,
  E× the routed FLOPs: for a handful of tokens (decoding), where one batched matmul beats sorting.
- "blocked": rows sorted by expert, each expert padded to a multiple of `expert_block`, one matmul per
  block (`blocked_matmul`). Dropless; the CPU default.
- "capacity": gather assignments into [E, C, D] buckets → batched einsum → gather back. Assignments
  past C slots are dropped *and counted*. Equal to the others whenever nothing overflows.
Ids outside [0, E) (padding of the expert-parallel buffers) give zero rows on every path. Assignment a
reads its input row from x[a // per_token]: the layer passes tokens with per_token = top_k (no
`jnp.repeat(x, K)` copy), the expert-parallel dispatch its received rows with per_token = 1.

The weights' logical axes live here too (`W_GATE_AXES`, ...): the MoE layer creates its parameters
with them and the expert-parallel dispatch derives its `shard_map` specs from them.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
from absl import flags

from composer_jax.model import tokamax_private, varying
from composer_jax.model.config import ModelConfig
from composer_jax.model.layers import project

# Logical axes of the routed experts' weights [E, D, F] / [E, F, D].
W_GATE_AXES = ("expert", "embed", "expert_mlp")
W_UP_AXES = W_GATE_AXES
W_DOWN_AXES = ("expert", "expert_mlp", "embed")


def capacity(n_assignments: int, n_experts: int, factor: float) -> int:
  """Slots per expert: ceil(assignments/E · factor), never more than all assignments; factor ≤ 0:
  all of them (dropless)."""
  if factor <= 0:
    return max(1, n_assignments)
  return max(1, min(n_assignments, math.ceil(n_assignments / n_experts * factor)))


def sort_by_expert(expert_ids_A: jax.Array, n_experts: int):
  """Stable order of assignments by expert, group sizes [E], and each assignment's rank in its group."""
  expert_ids_A = jnp.asarray(expert_ids_A)
  order_A = jnp.argsort(expert_ids_A, stable=True)
  sizes_E = jnp.zeros((n_experts,), jnp.int32).at[expert_ids_A].add(1, mode="drop")
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  sorted_ids_A = expert_ids_A[order_A]
  rank_sorted_A = jnp.arange(expert_ids_A.shape[0]) - starts_E[jnp.clip(sorted_ids_A, 0, n_experts - 1)]
  rank_A = jnp.zeros_like(rank_sorted_A).at[order_A].set(rank_sorted_A)
  return order_A, sizes_E, starts_E, rank_A


def _grouped_swiglu(x_RD, sizes_E, w_gate_up_EDF, w_down_EFD, ragged_dot):
  """SwiGLU over rows sorted by expert (group e: the next sizes_E[e] rows), in the weights' dtype."""
  F = w_down_EFD.shape[1]

  def grouped(x, w):
    return ragged_dot(x, w, sizes_E, preferred_element_type=jnp.float32).astype(w.dtype)

  gate_up = grouped(x_RD, w_gate_up_EDF)  # one matmul, not two
  return grouped(jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:], w_down_EFD)


def chunk_sizes(sizes_E: jax.Array, start, rows: int) -> jax.Array:
  """Group sizes of rows [start, start + rows) of a layout sorted by group (group e: sizes_E[e] rows)."""
  ends_E = jnp.cumsum(sizes_E)
  return jnp.clip(jnp.minimum(ends_E, start + rows) - jnp.maximum(ends_E - sizes_E, start), 0, None)


def chunks_used(sizes_E: jax.Array, rows: int) -> jax.Array:
  """How many chunks of `rows` rows the assigned rows (Σ sizes, from row 0) reach into."""
  return (jnp.sum(sizes_E) + rows - 1) // rows


def expected_chunks(expected_rows: int, total_rows: int, chunks: int) -> int:
  """The row-chunk loop's trip count for the cost model: the chunks a device's expected share of rows
  fills, plus one for a device above the mean (capped at all chunks). XLA cannot know a data-dependent
  trip count; `plan.estimate` reads this number from the loop's scope name."""
  rows = total_rows // chunks
  return min(chunks, -(-expected_rows // rows) + (1 if expected_rows < total_rows else 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def row_chunked_swiglu(x_RD, sizes_E, w_gate_up_EDF, w_down_EFD, chunks: int, expect: int, ragged_dot):
  """`_grouped_swiglu` over R sorted rows in `chunks` equal chunks, running only the chunks that hold
  assigned rows (a `while` loop of data-dependent length): a receive buffer sized for the worst case
  costs compute for the rows it actually got, and the [R, 2F] hidden activations live one chunk at a
  time. Rows of unrun chunks are 0; rows past Σ sizes inside a run chunk are the kernel's (mask them).
  The backward pass recomputes each chunk's forward (the residuals are the inputs only) and sums the
  weight gradients over chunks in fp32."""
  return _row_chunks_forward(x_RD, sizes_E, w_gate_up_EDF, w_down_EFD, chunks, expect, ragged_dot)


def _row_chunks_forward(x_RD, sizes_E, w_gate_up_EDF, w_down_EFD, chunks, expect, ragged_dot):
  R, D = x_RD.shape
  rows = R // chunks

  def body(i, y_RD):
    start = i * rows
    x_rD = jax.lax.dynamic_slice_in_dim(x_RD, start, rows)
    y_rD = _grouped_swiglu(x_rD, chunk_sizes(sizes_E, start, rows), w_gate_up_EDF, w_down_EFD, ragged_dot)
    return jax.lax.dynamic_update_slice_in_dim(y_RD, y_rD.astype(y_RD.dtype), start, 0)

  with jax.named_scope(f"expert_row_chunks_expect{expect}"):
    init = jnp.zeros((R, D), w_down_EFD.dtype)
    return _dynamic_fori(chunks_used(sizes_E, rows), body, init, x_RD, sizes_E, w_gate_up_EDF, w_down_EFD)


def _dynamic_fori(n, body, init, *varying_like):
  """`jax.lax.fori_loop(0, n, ...)` for a traced n (a `while` of data-dependent length), its carry typed
  to vary over the `shard_map` axes its updates vary over (those of `varying_like`)."""
  return jax.lax.fori_loop(0, n, body, varying.vary_like(init, *varying_like))


def _row_chunks_fwd(x_RD, sizes_E, w_gate_up_EDF, w_down_EFD, chunks, expect, ragged_dot):
  y = _row_chunks_forward(x_RD, sizes_E, w_gate_up_EDF, w_down_EFD, chunks, expect, ragged_dot)
  return y, (x_RD, sizes_E, w_gate_up_EDF, w_down_EFD)


def _row_chunks_bwd(chunks, expect, ragged_dot, residuals, dy_RD):
  x_RD, sizes_E, w_gu, w_down = residuals
  rows = x_RD.shape[0] // chunks

  def body(i, carry):
    dx_RD, dgu, ddown = carry
    start = i * rows
    sizes = chunk_sizes(sizes_E, start, rows)
    x_rD = jax.lax.dynamic_slice_in_dim(x_RD, start, rows)
    _, vjp = jax.vjp(lambda x, a, b: _grouped_swiglu(x, sizes, a, b, ragged_dot), x_rD, w_gu, w_down)
    dx_rD, dgu_c, ddown_c = vjp(jax.lax.dynamic_slice_in_dim(dy_RD, start, rows).astype(w_down.dtype))
    dx_RD = jax.lax.dynamic_update_slice_in_dim(dx_RD, dx_rD.astype(dx_RD.dtype), start, 0)
    return dx_RD, dgu + dgu_c.astype(jnp.float32), ddown + ddown_c.astype(jnp.float32)

  init = (jnp.zeros_like(x_RD), jnp.zeros(w_gu.shape, jnp.float32), jnp.zeros(w_down.shape, jnp.float32))
  with jax.named_scope(f"expert_row_chunks_expect{expect}"):
    dx_RD, dgu, ddown = _dynamic_fori(
      chunks_used(sizes_E, rows), body, init, x_RD, sizes_E, w_gu, w_down, dy_RD
    )
  return dx_RD, None, dgu.astype(w_gu.dtype), ddown.astype(w_down.dtype)


row_chunked_swiglu.defvjp(_row_chunks_fwd, _row_chunks_bwd)


def experts_ragged(
  x_ND,
  expert_ids_A,
  w_gate_EDF,
  w_up_EDF,
  w_down_EFD,
  dtype,
  per_token=1,
  ragged_dot=jax.lax.ragged_dot,
  chunks: int = 1,
  expected_rows: int | None = None,
  presorted: bool = False,
) -> jax.Array:
  """Dropless grouped SwiGLU: one row per assignment out. Ids outside [0, E) give zeros.

  `ragged_dot`: `jax.lax.ragged_dot` or a kernel with its signature (`tokamax_ragged_dot`).
  `chunks` > 1 (dividing A): the sorted rows in that many chunks, only those holding assigned rows
  run (`row_chunked_swiglu`); `expected_rows` (default A) is the cost model's guess of how many do.
  `presorted`: the rows are already grouped by expert with every assigned row first and zeros after
  (the ragged EP receive buffer of a device holding one expert), and the caller reads no row past them:
  no sort, no unsort and no masks — three passes over the buffer fewer."""
  E, A = w_gate_EDF.shape[0], expert_ids_A.shape[0]
  w_gate_up = jnp.concatenate([w_gate_EDF, w_up_EDF], axis=-1).astype(dtype)
  w_down = w_down_EFD.astype(dtype)
  if presorted:
    if per_token != 1:
      raise ValueError("presorted rows are one per assignment (per_token=1).")
    sizes_E = jnp.zeros((E,), jnp.int32).at[expert_ids_A].add(1, mode="drop")
    return _swiglu_rows(
      jnp.asarray(x_ND).astype(dtype), sizes_E, w_gate_up, w_down, ragged_dot, chunks, expected_rows
    )
  order_A, sizes_E, _, _ = sort_by_expert(expert_ids_A, E)
  # Rows past Σ sizes (ids outside [0, E)) are zero for jax.lax.ragged_dot; a kernel may leave them as
  # they were (NaN in Pallas interpret mode), in its output and in its input gradient: masked on both
  # sides, so neither reaches y nor x's gradient.
  valid_sorted = (jnp.arange(A) < jnp.sum(sizes_E))[:, None]
  x_sorted = jnp.where(valid_sorted, jnp.asarray(x_ND)[order_A // per_token], 0).astype(dtype)
  y_sorted = _swiglu_rows(x_sorted, sizes_E, w_gate_up, w_down, ragged_dot, chunks, expected_rows)
  y_sorted = jnp.where(valid_sorted, y_sorted, 0)
  return jnp.zeros_like(y_sorted).at[order_A].set(y_sorted)


def _swiglu_rows(x_RD, sizes_E, w_gate_up, w_down, ragged_dot, chunks, expected_rows):
  """Rows sorted by expert → SwiGLU rows, in one pass or in row chunks (`experts_ragged`)."""
  R = x_RD.shape[0]
  if chunks <= 1:
    return _grouped_swiglu(x_RD, sizes_E, w_gate_up, w_down, ragged_dot)
  if R % chunks:
    raise ValueError(f"expert row chunks={chunks} must divide the {R} rows (pad the buffer to a multiple).")
  expect = expected_chunks(R if expected_rows is None else expected_rows, R, chunks)
  return row_chunked_swiglu(x_RD, sizes_E, w_gate_up, w_down, chunks, expect, ragged_dot)


def tokamax_ragged_dot(platform: str, interpret: bool = False):
  """`tokamax.ragged_dot` for `platform` ("tpu": Pallas Mosaic, "gpu": Triton) in `jax.lax.ragged_dot`'s
  signature. Shapes the kernel refuses (Mosaic: any of rows, contraction or output width < 128) run
  tokamax's XLA implementation (`jax.lax.ragged_dot`), tokamax's own fallback order.

  On TPU the Mosaic op's device check is skipped: tokamax asks the host's default device, a CPU when the
  step is compiled ahead of time for a TPU topology (`plan.compile`); the caller has chosen the target.
  `interpret`: Pallas interpret mode (tests; trace under a TPU `jax.sharding.AbstractDevice`)."""
  try:
    tokamax = importlib.import_module("tokamax")
  except ImportError as e:
    raise ImportError(
      "expert_impl='tokamax' needs tokamax (`pip install -e '.[kernels]'`); 'ragged' runs without it"
    ) from e
  # tokamax reads its options as absl flags and, unless flags are parsed (run.py parses them), parses
  # sys.argv on first use: any other command line (pytest, a benchmark's argparse) fails there.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  if platform == "tpu":
    kernel = _mosaic_tpu_ragged_dot(interpret)
  elif platform == "gpu":
    kernel = "triton"
  else:
    raise ValueError(f"expert_impl='tokamax' runs on TPU or GPU, not {platform!r}; use 'blocked' on CPU")
  return functools.partial(tokamax.ragged_dot, implementation=(kernel, "xla"))


@functools.cache
def _mosaic_tpu_ragged_dot(interpret: bool):
  """tokamax's Pallas Mosaic TPU grouped matmul (forward, and the same kernel for both backward
  products), without its check of the host's default device."""
  mosaic = tokamax_private.module("ragged_dot_mosaic_tpu")  # the public op would ask the host's device
  base = tokamax_private.module("ragged_dot_base")

  class ForTpu(mosaic.PallasMosaicTpuRaggedDot):
    __slots__ = ()

    def supported_on(self, device) -> bool:
      return True

  inner = ForTpu(interpret=interpret)
  vjp = functools.partial(base.vjp, dlhs_ragged_dot=inner, drhs_ragged_dot=inner)
  return ForTpu(interpret=interpret, vjp=vjp)


def experts_dense(x_ND, expert_ids_A, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, per_token=1) -> jax.Array:
  """Every expert on every input row [N, E, ·], each assignment then keeping its expert's output."""
  E = w_gate_EDF.shape[0]
  # Batched matmuls with batch = experts (x broadcast, not a weight relayout); gate and up as two
  # matmuls: concatenating their weights would copy every expert's weights on each call.
  x_END = jnp.broadcast_to(jnp.asarray(x_ND)[None], (E, *x_ND.shape))
  h_ENF = jax.nn.silu(project("end,edf->enf", x_END, w_gate_EDF, dtype)) * project(
    "end,edf->enf", x_END, w_up_EDF, dtype
  )
  y_END = project("enf,efd->end", h_ENF, w_down_EFD, dtype)
  rows_A = jnp.arange(expert_ids_A.shape[0]) // per_token
  valid_A = (expert_ids_A >= 0) & (expert_ids_A < E)
  return jnp.where(valid_A[:, None], y_END[jnp.clip(expert_ids_A, 0, E - 1), rows_A], 0)


def experts_capacity(x_ND, expert_ids_A, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, slots: int, per_token=1):
  """Bucketed SwiGLU over [E, C, D]; returns (y_AD, dropped assignments). Ids outside [0, E) → 0."""
  E, A = w_gate_EDF.shape[0], expert_ids_A.shape[0]
  order_A, sizes_E, starts_E, rank_A = sort_by_expert(expert_ids_A, E)
  # Slot (e, c) holds the c-th assignment of expert e, if there is one.
  slot_EC = starts_E[:, None] + jnp.arange(slots)[None, :]
  filled_EC = jnp.arange(slots)[None, :] < sizes_E[:, None]
  source_EC = order_A[jnp.clip(slot_EC, 0, A - 1)]
  x_ECD = jnp.where(filled_EC[..., None], jnp.asarray(x_ND)[source_EC // per_token], 0).astype(dtype)
  F = w_gate_EDF.shape[2]
  gate_up_ECF = project("ecd,edf->ecf", x_ECD, jnp.concatenate([w_gate_EDF, w_up_EDF], axis=-1), dtype)
  y_ECD = project("ecf,efd->ecd", jax.nn.silu(gate_up_ECF[..., :F]) * gate_up_ECF[..., F:], w_down_EFD, dtype)
  valid_A = (expert_ids_A >= 0) & (expert_ids_A < E)
  kept_A = valid_A & (rank_A < slots)
  flat_slot_A = jnp.clip(expert_ids_A, 0, E - 1) * slots + jnp.clip(rank_A, 0, slots - 1)
  y_AD = jnp.where(kept_A[:, None], y_ECD.reshape(E * slots, -1)[flat_slot_A], 0)
  return y_AD, jnp.sum(valid_A & ~kept_A)


@jax.custom_vjp
def blocked_matmul(
  x_NbI: jax.Array, w_EIO: jax.Array, expert_N: jax.Array, used_blocks: jax.Array
) -> jax.Array:
  """y[n] = x[n] @ w[expert[n]] for the first `used_blocks` row blocks (the rest are zeros).

  One matmul per scan step; blocks past `used_blocks` (the static bound's slack) skip the
  matmul. A custom VJP so the weight gradient accumulates in place into one [E, I, O] buffer;
  plain autodiff of `w[expert[n]]` inside a scan materialises a [blocks, I, O] stack per layer.
  """
  return _blocked_forward(x_NbI, w_EIO, expert_N, used_blocks)


def _zeros_of_product(a_bK: jax.Array, b_KO: jax.Array) -> jax.Array:
  """Zeros shaped like a @ b that also carry both operands' shard_map (varying) type, so a
  `cond` branch that skips the matmul type-checks inside `shard_map` (the EP dispatch)."""
  return a_bK[:, :1] * b_KO[:1, :] * 0


def _blocked_forward(x_NbI, w_EIO, expert_N, used_blocks):

  def step(n, block):
    x_bI, expert = block
    y_bO = jax.lax.cond(
      n < used_blocks,
      lambda: jnp.dot(x_bI, w_EIO[expert], preferred_element_type=jnp.float32).astype(x_bI.dtype),
      lambda: _zeros_of_product(x_bI, w_EIO[expert]),
    )
    return n + 1, y_bO

  return jax.lax.scan(step, 0, (x_NbI, expert_N))[1]


def _blocked_fwd(x_NbI, w_EIO, expert_N, used_blocks):
  return _blocked_forward(x_NbI, w_EIO, expert_N, used_blocks), (x_NbI, w_EIO, expert_N, used_blocks)


def _blocked_bwd(residuals, dy_NbO):
  x_NbI, w_EIO, expert_N, used_blocks = residuals

  def step(carry, block):
    n, dw_EIO = carry
    x_bI, dy_bO, expert = block

    def grads():
      dx_bI = jnp.dot(dy_bO, w_EIO[expert].T, preferred_element_type=jnp.float32).astype(x_bI.dtype)
      return dx_bI, dw_EIO.at[expert].add(jnp.dot(x_bI.T, dy_bO, preferred_element_type=jnp.float32))

    skip = lambda: (_zeros_of_product(dy_bO, w_EIO[expert].T), dw_EIO)  # noqa: E731
    dx_bI, dw_EIO = jax.lax.cond(n < used_blocks, grads, skip)
    return (n + 1, dw_EIO), dx_bI

  init = (0, jnp.zeros_like(w_EIO, dtype=jnp.float32))
  (_, dw_EIO), dx_NbI = jax.lax.scan(step, init, (x_NbI, dy_NbO, expert_N))
  return dx_NbI, dw_EIO.astype(w_EIO.dtype), None, None


blocked_matmul.defvjp(_blocked_fwd, _blocked_bwd)


def experts_blocked(
  x_ND, expert_ids_A, w_gate_EDF, w_up_EDF, w_down_EFD, dtype, block: int, per_token=1
) -> jax.Array:
  """Dropless SwiGLU over row blocks that each belong to one expert.

  Assignments are sorted by expert and each expert's rows padded to a multiple of `block`, so
  the padding is < E·block rows (not a capacity factor's worth) and nothing is ever dropped.
  Each block multiplies by its own expert's weights (`blocked_matmul`). This is the CPU
  default: XLA:CPU runs `ragged_dot` as a dense masked matmul over all E groups. Ids outside
  [0, E) give zeros.
  """
  E, A, F = w_gate_EDF.shape[0], expert_ids_A.shape[0], w_gate_EDF.shape[2]
  n_blocks = -(-A // block) + E  # Σ_e ceil(size_e/block) ≤ A/block + E
  order_A, sizes_E, starts_E, rank_A = sort_by_expert(expert_ids_A, E)
  padded_E = -(-sizes_E // block) * block
  padded_ends_E = jnp.cumsum(padded_E)
  padded_starts_E = padded_ends_E - padded_E
  # Row r of the padded layout belongs to expert e_r and holds that expert's (r - start)-th assignment.
  rows = jnp.arange(n_blocks * block)
  expert_R = jnp.minimum(jnp.searchsorted(padded_ends_E, rows, side="right"), E - 1)
  within_R = rows - padded_starts_E[expert_R]
  filled_R = (within_R < sizes_E[expert_R]) & (rows < padded_ends_E[-1])
  source_R = order_A[jnp.clip(starts_E[expert_R] + within_R, 0, A - 1)]
  x_NbD = (
    jnp.where(filled_R[:, None], jnp.asarray(x_ND)[source_R // per_token], 0)
    .astype(dtype)
    .reshape(n_blocks, block, -1)
  )
  expert_N = expert_R[::block]
  w_gate_up_EDF = jnp.concatenate([w_gate_EDF, w_up_EDF], axis=-1).astype(dtype)  # one matmul for both
  used_blocks = padded_ends_E[-1] // block
  gate_up_NbF = blocked_matmul(x_NbD, w_gate_up_EDF, expert_N, used_blocks)
  h_NbF = jax.nn.silu(gate_up_NbF[..., :F]) * gate_up_NbF[..., F:]
  y_RD = blocked_matmul(h_NbF, w_down_EFD.astype(dtype), expert_N, used_blocks).reshape(n_blocks * block, -1)
  valid_A = (expert_ids_A >= 0) & (expert_ids_A < E)
  dest_A = padded_starts_E[jnp.clip(expert_ids_A, 0, E - 1)] + rank_A
  return jnp.where(valid_A[:, None], y_RD[jnp.clip(dest_A, 0, n_blocks * block - 1)], 0)


def experts_local(
  x_ND,
  expert_ids_A,
  w_gate,
  w_up,
  w_down,
  cfg: ModelConfig,
  slots: int,
  per_token=1,
  platform="cpu",
  expected_rows: int | None = None,
  presorted: bool = False,
):
  """The configured expert path (`cfg.expert_impl`, resolved) on one device's assignments, reading
  assignment a's input from x_ND[a // per_token]; returns (y_AD, dropped). `expected_rows`: how many of
  the A rows a device gets on average (a padded receive buffer's balanced share), for the cost model
  of `cfg.expert_chunks`; the row chunks apply when they divide A. `presorted`: see `experts_ragged`
  (the other paths sort anyway)."""
  ws, none = (w_gate, w_up, w_down), jnp.zeros((), jnp.int32)
  impl = cfg.expert_impl
  if impl in ("ragged", "tokamax"):
    kernel = tokamax_ragged_dot(platform) if impl == "tokamax" else jax.lax.ragged_dot
    A = expert_ids_A.shape[0]
    chunks = cfg.expert_chunks if cfg.expert_chunks > 1 and A % cfg.expert_chunks == 0 else 1
    y_AD = experts_ragged(
      x_ND, expert_ids_A, *ws, cfg.dtype, per_token, kernel, chunks, expected_rows, presorted
    )
    return y_AD, none
  if impl == "dense":
    return experts_dense(x_ND, expert_ids_A, *ws, cfg.dtype, per_token), none
  if impl == "blocked":
    return experts_blocked(x_ND, expert_ids_A, *ws, cfg.dtype, cfg.expert_block, per_token), none
  if impl == "capacity":
    return experts_capacity(x_ND, expert_ids_A, *ws, cfg.dtype, slots, per_token)
  raise ValueError(f"expert_impl={impl!r} is not resolved (backend.expert_impl resolves 'auto')")
