"""What each device holds in one train step: state (params, optimizer, gradients) and the
activations saved for the backward pass.

Counts are elements or bytes *per device*. Symbols in docstrings: b rows and t positions of the batch
per device (dense mesh), S sequence length, D d_model, H heads, C kv_lora_rank, R qk_rope_head_dim,
Q q_lora_rank, E experts, K top_k, P expert parallelism, W an MLP's hidden width, V vocab.
State bytes are exact (they match XLA's `memory_analysis()` arguments); activations are a model of
the code paths (model/*.py), documented where each term is computed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from composer_jax import backend
from composer_jax.model.attention_kernels import SPLASH_BLOCK, chunk_count
from composer_jax.model.config import ModelConfig
from composer_jax.model.experts import capacity
from composer_jax.plan.layout import Layout, Leaf


def state_memory(params: list[Leaf], grad_accum: int, tpu: bool = False) -> dict[str, dict[str, int]]:
  """Bytes per device on each mesh: params, optimizer state, gradients (+ fp32 accumulator); `tpu`:
  in XLA:TPU's tiled layout (`layout.tpu_bytes`).

  Optimizer state as `optim.build_optimizer` stores it: sharded Muon keeps one momentum buffer
  (`zeros_like` the param: same dtype, same sharding), optax AdamW two (mu, nu, param dtype), frozen
  leaves none; plus four int32 step counters (Muon, Adam, Adam's schedule, the train state's step).
  Gradients have the params' dtype and sharding; grad_accum > 1 adds the fp32 sum of `train.step.gradients`.
  """
  out = {m: {"params": 0, "opt_state": 0, "grads": 0, "grad_accum_f32": 0} for m in ("dense", "expert")}
  for p in params:
    b = p.local_bytes(tpu)
    row = out[p.mesh]
    row["params"] += b
    row["opt_state"] += {"muon": b, "adam": 2 * b, "frozen": 0}[p.label]
    row["grads"] += b
    if grad_accum > 1:
      row["grad_accum_f32"] += p.local_size * 4
  out["dense"]["opt_state"] += 3 * 4  # Muon, scale_by_adam and scale_by_schedule counts
  out["dense"]["step"] = 4
  return out


@dataclasses.dataclass(frozen=True)
class Tokens:
  """Per-device token counts of one micro-batch."""

  b: int  # rows (batch over the dense mesh's batch axes)
  t: int  # query positions (seq over context)
  seq: int  # key positions (keys are gathered over context)
  n_expert: int  # tokens per device on the expert mesh (all devices)
  total: int  # tokens of the micro-batch, all devices

  @property
  def n(self) -> int:
    return self.b * self.t


def tokens(layout: Layout, micro_batch: int, seq_len: int) -> Tokens:
  deg = layout.degrees
  if micro_batch % deg.batch:
    raise ValueError(
      f"micro-batch {micro_batch} (train.batch_size / grad_accum) is not divisible by replica·fsdp = "
      f"{deg.batch}; raise the batch or grad_accum, or use fewer devices."
    )
  if seq_len % deg.seq:
    raise ValueError(f"seq_len {seq_len} is not divisible by context = {deg.seq}.")
  total = micro_batch * seq_len
  return Tokens(
    b=micro_batch // deg.batch, t=seq_len // deg.seq, seq=seq_len, n_expert=total // deg.devices, total=total
  )


def mlp_elems(rows: int, d: int, width: int) -> int:
  """SwiGLU residuals: input, gate·up (2W), sigmoid, silu, product (3W), hidden (W), output."""
  return rows * (2 * d + 6 * width)


def attention_elems(cfg: ModelConfig, tok: Tokens) -> tuple[int, int]:
  """(compute-dtype elements, fp32 elements) saved by one absorbed-MLA layer (attention.py).

  Token rows (n = b·t): both RMSNorms' input and normalised output, the residual sum and the block
  output (6D), q-LoRA latent and its norm (2Q), q (H·(N+R)), its rotated part (H·R), q·W_k (H·C), the
  concatenated query (H·(C+R)), the latent and rope key (C+2R), attention out (H·C), W_v out (H·V).
  Keys and values are gathered over `context`: b·S·(2C+R). Three fp32 [b, t, H, S] buffers: scores,
  probabilities, and the probabilities laid out for the second matmul's backward (XLA keeps both); none
  when the queries run in chunks (`cfg.attention_chunk`: each chunk's scores are recomputed in the
  backward pass, `query_chunk_scores` is what lives at once).
  """
  d, h, c, r = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  per_token = 6 * d + 2 * cfg.q_lora_rank + h * (cfg.qk_head_dim + r + 2 * c + (c + r) + cfg.v_head_dim)
  per_token += c + 2 * r
  act = tok.n * per_token + tok.b * tok.seq * (2 * c + r)
  f32 = 0 if chunk_count(tok.seq, cfg.attention_chunk) > 1 else 3 * tok.b * tok.t * h * tok.seq
  return act, f32


def query_chunk_scores(cfg: ModelConfig, tok: Tokens) -> int:
  """fp32 elements of one query chunk's scores, probabilities and their gradient ([b, t/n, H, S] each)
  while the chunk is recomputed and differentiated; 0 without chunks (`attention_elems` keeps them)."""
  n = chunk_count(tok.seq, cfg.attention_chunk)
  return 0 if n == 1 else 3 * tok.b * (tok.t // n) * cfg.n_heads * tok.seq


def loss_positions(cfg: ModelConfig, tok: Tokens) -> int:
  """Positions per device whose logits live at once: all of them, or one chunk's (`cfg.loss_chunk`)."""
  return tok.b * (tok.t // chunk_count(tok.seq, cfg.loss_chunk))


def moe_rows(cfg: ModelConfig, layout: Layout, tok: Tokens) -> dict[str, int]:
  """Row counts of one MoE layer per device: assignments A = tokens·K, rows received by expert
  parallelism and rows the expert MLP runs on (moe.py, expert_parallel.py, experts.py).

  "all_to_all" receives P·capacity(A, P, cf) rows (fixed buffers); "ragged_all_to_all" ceil(A·cf).
  The "blocked" path pads every local expert to `expert_block`; "capacity" runs [E, slots] buckets.
  """
  p = layout.degrees.experts
  local_experts = cfg.n_experts // p
  a = tok.n_expert * cfg.top_k
  ep = p > 1 and tok.total % layout.devices == 0  # else moe.py runs the local path
  if ep and cfg.dispatch == "all_to_all":
    recv = p * capacity(a, p, cfg.capacity_factor)
  elif ep:
    recv = max(1, min(p * a, math.ceil(a * cfg.capacity_factor)))
    per = row_chunks(cfg, recv, round_up=True)  # expert_parallel pads the buffer to whole chunks
    recv = -(-recv // per) * per
  else:
    recv = a
  if cfg.expert_impl == "blocked":
    rows = (-(-recv // cfg.expert_block) + local_experts) * cfg.expert_block
  elif cfg.expert_impl == "ragged":
    rows = recv
  elif not ep:  # capacity path: [E, slots] buckets, slots as moe.MoE / expert_parallel compute them
    rows = cfg.n_experts * capacity(a, cfg.n_experts, cfg.capacity_factor)
  elif cfg.dispatch == "all_to_all":
    rows = local_experts * max(1, min(recv, math.ceil(a / local_experts * cfg.capacity_factor)))
  else:
    rows = local_experts * recv
  return {"assignments": a, "received_rows": recv, "expert_rows": rows, "expert_parallel": int(ep)}


def row_chunks(cfg: ModelConfig, rows: int, round_up: bool = False) -> int:
  """The chunks the ragged/tokamax expert path splits its rows into (`model.expert_chunks`): the
  EP receive buffer pads to a multiple (`round_up`); elsewhere chunks apply when they divide the rows."""
  n = cfg.expert_chunks
  if cfg.expert_impl not in ("ragged", "tokamax") or n <= 1 or not (round_up or rows % n == 0):
    return 1
  return n


def moe_elems(cfg: ModelConfig, layout: Layout, tok: Tokens) -> tuple[int, int, dict[str, int]]:
  """(compute-dtype elements, fp32 elements, row counts) saved by the routed experts of one layer.

  "all_to_all" saves send, receive and both result buffers (4 buffers of the received rows);
  "ragged_all_to_all" the receive and result buffers and the sorted send/return rows (2 + 2·A).
  The expert MLP's residuals on its rows; router scores fp32 [n, E] ×3 and the fp32 combine [A, D].
  """
  rows = moe_rows(cfg, layout, tok)
  a, recv, d = rows["assignments"], rows["received_rows"], cfg.d_model
  if rows["expert_parallel"] and cfg.dispatch == "all_to_all":
    buffers = 4 * recv * d
  elif rows["expert_parallel"]:
    buffers = 2 * recv * d + 2 * a * d
  else:
    buffers = 0
  big_r = rows["expert_rows"]
  # In row chunks the expert MLP saves its sorted input rows only (it recomputes each chunk backward).
  experts = big_r * d if row_chunks(cfg, big_r) > 1 else mlp_elems(big_r, d, cfg.moe_mlp_dim)
  act = a * d + buffers + experts
  f32 = 3 * tok.n * cfg.n_experts + a * d
  return act, f32, rows


def weights_elems(cfg: ModelConfig, params: list[Leaf], layout: Layout) -> tuple[int, int]:
  """(all layers, largest layer) elements of weight copies the backward pass keeps.

  Every SwiGLU concatenates gate and up ([D, 2W]; the local experts after the expert_fsdp gather);
  absorbed MLA slices kv_b into W_k and W_v and folds heads of q_b and o_proj into matrix rows
  (C·H·(N+V) + Q·H·(N+R) + H·V·D); when dense weights are FSDP-sharded or cast to another compute
  dtype, the gathered / cast copy of each dense matrix is saved too (the dot's operand).
  """
  deg = layout.degrees
  e_local = cfg.n_experts // deg.experts
  layers = {"dense_layers": cfg.first_k_dense, "moe_layers": cfg.n_moe_layers}
  concat = {
    "dense_layers": cfg.d_model * 2 * cfg.dense_mlp_dim,
    "moe_layers": cfg.d_model * 2 * (cfg.moe_mlp_dim * cfg.n_shared_experts + e_local * cfg.moe_mlp_dim),
  }
  copies = dict.fromkeys(layers, 0)
  if deg.fsdp > 1 or cfg.dtype != cfg.param_dtype:
    for p in params:
      if p.mesh == "dense" and p.stack and len(p.shape) >= 3 and p.label != "frozen":
        copies[p.stack] += p.size // p.shape[0]  # one layer's slice of the stacked leaf
  h = cfg.n_heads
  absorbed = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * cfg.d_model
  absorbed += cfg.q_lora_rank * h * cfg.qk_head_dim
  per_layer = {k: concat[k] + copies[k] + absorbed for k in layers}
  total = sum(layers[k] * per_layer[k] for k in layers)
  largest = max(per_layer[k] if layers[k] else 0 for k in layers)
  return total, largest


def activation_memory(
  cfg: ModelConfig, layout: Layout, params: list[Leaf], micro_batch: int, seq_len: int
) -> tuple[dict[str, int], dict[str, int]]:
  """Bytes per device saved for the backward pass of one micro-batch, at the end of the forward pass.

  remat "none": every layer's residuals (the sums below). "full": each block's input (b·t·D) for all
  layers plus one block's residuals, recomputed in the backward pass. "dots"/"dots_with_batch": the
  matmul outputs of every layer (approximated as half of "none"'s per-layer residuals, scores kept by
  "dots_with_batch" only) plus one block recomputed. The LM head's fp32 logits, log-softmax and its
  gradient ([b·t, V] ×3) and the final norm are always live.
  """
  tok = tokens(layout, micro_batch, seq_len)
  act_b = np.dtype(cfg.dtype).itemsize
  attn_act, attn_f32 = attention_elems(cfg, tok)
  moe_act, moe_f32, rows = moe_elems(cfg, layout, tok)
  n_moe, n_dense = cfg.n_moe_layers, cfg.first_k_dense
  dense_mlp = mlp_elems(tok.n, cfg.d_model, cfg.dense_mlp_dim)
  shared = (
    mlp_elems(tok.n, cfg.d_model, cfg.moe_mlp_dim * cfg.n_shared_experts) if cfg.n_shared_experts else 0
  )
  w_all, w_layer = weights_elems(cfg, params, layout)
  layer = {
    "dense": (attn_act + dense_mlp) * act_b + attn_f32 * 4,
    "moe": (attn_act + shared + moe_act) * act_b + (attn_f32 + moe_f32) * 4,
  }
  head = 3 * loss_positions(cfg, tok) * cfg.vocab_size * 4 + 2 * tok.n * cfg.d_model * act_b
  terms = {
    "attention": cfg.n_layers * (attn_act * act_b + attn_f32 * 4) + query_chunk_scores(cfg, tok) * 4,
    "dense_mlp": n_dense * dense_mlp * act_b,
    "shared_experts": n_moe * shared * act_b,
    "routed_experts": n_moe * (moe_act * act_b + moe_f32 * 4),
    "weight_copies": w_all * act_b,
    "head": head,
  }
  largest = max(layer["dense"] if n_dense else 0, layer["moe"] if n_moe else 0) + w_layer * act_b
  if cfg.remat == "full":
    terms = {"block_inputs": cfg.n_layers * tok.n * cfg.d_model * act_b, "one_block": largest, "head": head}
  elif cfg.remat in ("dots", "dots_with_batch"):
    keep = cfg.n_layers * tok.n * cfg.d_model * act_b
    per_layer = sum(v for k, v in terms.items() if k not in ("head", "weight_copies")) // 2
    if cfg.remat == "dots":
      per_layer -= cfg.n_layers * attn_f32 * 4 // 2
    terms = {"block_inputs": keep, "matmul_outputs": per_layer, "one_block": largest, "head": head}
  terms["total"] = sum(terms.values())
  return terms, rows


# XLA:TPU's temporaries (`memory_analysis().temp_size_in_bytes`) against the planner's live peak, read
# off the buffer assignments of the moonlight_16b and kimi_k25_1t train and RL steps (benchmarks/
# xla_heap.py): the heap is 1.1-1.5x the largest live set (buffers placed at offsets that overlap in
# address, not in time), and memory_analysis adds 1.0-1.6 fp32 [V, D] tables' worth outside that heap
# (2.5-7.2 GiB). 1.35 tables puts the four steps within 15 % (any value in 1.23-1.49 does; the Kimi RL and
# train steps have the same planned live peak and XLA temps 28.8 and 22.8 GiB, which bounds it).
TPU_HEAP_OVER_LIVE = 1.1
TPU_VOCAB_TABLES_OUTSIDE_HEAP = 1.35
SPLASH_LSE_LANES = 128  # splash keeps each query's log-sum-exp as a [H, t, 128] fp32 residual


def fused_attention(cfg: ModelConfig, tok: Tokens, tpu: bool) -> bool:
  """Whether the step's attention is splash (XLA:TPU, tokamax present, shapes it takes: see
  `model.attention`), which keeps no [t, H, S] scores; other targets are planned as XLA's attention."""
  if not tpu or cfg.attention_impl not in ("auto", "splash"):
    return False
  if cfg.attention_impl == "auto" and not backend.has_tokamax():
    return False
  return tok.t % SPLASH_BLOCK == 0 and tok.seq % SPLASH_BLOCK == 0


def _gathered_layer_bytes(cfg: ModelConfig, layout: Layout, params: list[Leaf]) -> int:
  """Weights one layer all-gathers (FSDP) in the compute dtype, twice: the layer being computed and the
  next one's, which XLA prefetches."""
  deg, act_b = layout.degrees, np.dtype(cfg.dtype).itemsize
  per_stack: dict[str, int] = {}
  for p in params:
    if p.stack and ((p.mesh == "dense" and deg.fsdp > 1) or (p.mesh == "expert" and deg.expert_fsdp > 1)):
      whole = p.size // p.shape[0] // (deg.experts if p.mesh == "expert" else 1)  # one layer's local experts
      per_stack[p.stack] = per_stack.get(p.stack, 0) + whole * act_b
  return 2 * max(per_stack.values(), default=0)


def remat_phases(
  cfg: ModelConfig, layout: Layout, params: list[Leaf], micro_batch: int, seq_len: int, tpu: bool = False
) -> dict[str, dict[str, int]]:
  """Live temporaries (bytes per device) at the two peaks of a rematerialised, scanned train step,
  read off XLA:TPU's live ranges of the moonlight_16b step (the `compile` stage's dumps):

  - "head": the loss. Every block's saved input, the logits in the compute dtype and the fp32
    log-softmax of the shifted ones ([b·t, V] each, or [b·chunk, V] with `loss_chunk`).
  - "backward": one block recomputed and differentiated. The saved inputs, the logits' gradient (XLA
    keeps it until the LM head's weight gradient) and that gradient itself, whole and fp32 on every
    device before its reduce-scatter, the block's attention (with XLA's attention: fp32 scores, bf16
    probabilities and their gradient [b·t, H, S], the absorbed query/latent products; with splash: the
    per-head q, k, v, output, their gradients and the log-sum-exp), the routed
    experts' working set on the received rows R (fp32 gate·up and down outputs, their inputs), the
    shared/dense MLP, and the stacks' gradient buffers.
  Both: the compute-dtype copies of all parameters (XLA hoists the casts of whole stacks out of the
  loops) and two layers' FSDP-gathered weights.
  """
  tok = tokens(layout, micro_batch, seq_len)
  a = np.dtype(cfg.dtype).itemsize
  n, d, h, s, v = tok.n, cfg.d_model, cfg.n_heads, tok.seq, cfg.vocab_size
  c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
  casts = sum(p.local_size for p in params) * a if cfg.dtype != cfg.param_dtype else 0
  if cfg.remat == "full":
    saved = cfg.n_layers * n * d * a
  else:  # dots: the matmul outputs of every layer (activation_memory's estimate) and the block inputs
    acts, _ = activation_memory(cfg, layout, params, micro_batch, seq_len)
    saved = acts["block_inputs"] + acts["matmul_outputs"]
  common = {"saved_for_backward": saved, "parameter_casts": casts}
  common["gathered_weights"] = _gathered_layer_bytes(cfg, layout, params)
  chunk = cfg.loss_chunk if 0 < cfg.loss_chunk < seq_len and seq_len % cfg.loss_chunk == 0 else seq_len
  loss_rows = tok.b * max(chunk // layout.degrees.seq, 1)  # positions of the loss's logits at a time
  head = common | {"logits": loss_rows * v * (a + 4)}
  if fused_attention(cfg, tok, tpu):  # per-head q, k, v, output and their gradients, the lse residual
    k_rows = tok.b * s
    attention = (2 * n + 2 * k_rows) * h * (
      cfg.qk_head_dim + cfg.v_head_dim
    ) * a + n * h * SPLASH_LSE_LANES * 4
  else:
    n_q = n // chunk_count(s, cfg.attention_chunk)  # query positions whose scores live at once
    attention = n_q * h * s * (4 + 2 * a) + n_q * s * 4 + n * h * (2 * (c + r) + 2 * c + cfg.qk_head_dim) * a
  rows = moe_rows(cfg, layout, tok)
  big_r, f = rows["expert_rows"], cfg.moe_mlp_dim
  live_r = big_r // row_chunks(cfg, big_r)  # rows whose hidden activations are live at once
  # fp32 gate·up and output, the hidden in the compute dtype; in row chunks the [R, D] input, output and
  # input-gradient rows stay whole (compute dtype) and the rest is one chunk's.
  whole_rows = 3 * big_r * d * a if live_r < big_r else big_r * d * a
  moe = live_r * (2 * f + d) * 4 + live_r * f * a + whole_rows + n * 3 * f * cfg.n_shared_experts * a
  dense = n * 3 * cfg.dense_mlp_dim * a + n * d * 4
  mlp = max(moe if cfg.n_moe_layers else 0, dense if cfg.first_k_dense else 0)
  grads = sum(p.local_bytes(tpu) for p in params if p.stack)
  logits_grad = n * v * a if chunk == seq_len else loss_rows * v * (a + 8)  # recomputed chunk, fp32 + grad
  backward = common | {"logits_grad": logits_grad, "lm_head_grad": v * d * 4}
  backward |= {"attention": attention, "mlp": mlp, "stacked_grads": grads}
  return {"head": head, "backward": backward}
