"""ModelConfig: the shapes and switches of a Kimi-K2.5 / DeepSeek-V3 MoE transformer.

A frozen (hashable) dataclass, so it can be a static jit argument. `from_hf` reads the
`config.json` of a HF `DeepseekV3ForCausalLM` / Kimi-K2 checkpoint; `to_hf` writes one back.
Implementation switches (expert compute, dispatch, dtypes) live here too because `model.apply`
takes only the config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

# HF field name -> our field name, for the fields that map one to one.
_HF_FIELDS = {
  "vocab_size": "vocab_size",
  "hidden_size": "d_model",
  "num_hidden_layers": "n_layers",
  "num_attention_heads": "n_heads",
  "intermediate_size": "dense_mlp_dim",
  "moe_intermediate_size": "moe_mlp_dim",
  "n_routed_experts": "n_experts",
  "num_experts_per_tok": "top_k",
  "n_shared_experts": "n_shared_experts",
  "n_group": "n_group",
  "topk_group": "topk_group",
  "norm_topk_prob": "norm_topk_prob",
  "routed_scaling_factor": "routed_scaling_factor",
  "first_k_dense_replace": "first_k_dense",
  "kv_lora_rank": "kv_lora_rank",
  "qk_nope_head_dim": "qk_nope_head_dim",
  "qk_rope_head_dim": "qk_rope_head_dim",
  "v_head_dim": "v_head_dim",
  "rms_norm_eps": "rms_norm_eps",
  "max_position_embeddings": "max_position_embeddings",
  "rope_interleave": "rope_interleave",
  "tie_word_embeddings": "tie_word_embeddings",
}
_ARCHITECTURES = ("DeepseekV3ForCausalLM", "KimiK2ForCausalLM")
_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
_ROPE_KEYS = (
  "rope_type",
  "type",
  "rope_theta",
  "factor",
  "original_max_position_embeddings",
  "beta_fast",
  "beta_slow",
  "mscale",
  "mscale_all_dim",
  "attention_factor",
  "truncate",
)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding settings; `kind="yarn"` follows HF `_compute_yarn_parameters` exactly."""

  theta: float = 10000.0
  kind: Literal["default", "yarn"] = "default"
  factor: float = 1.0
  original_max_position: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes of a DeepSeek-V3-family model plus how to compute it.

  Layer `l` is an MoE layer iff `l >= first_k_dense` (HF ignores `moe_layer_freq`, so do we).
  `q_lora_rank=0` means a plain `q_proj` (Moonlight), as HF's `q_lora_rank=None`.
  """

  vocab_size: int = 1024
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 8
  dense_mlp_dim: int = 512
  moe_mlp_dim: int = 512
  n_experts: int = 8
  top_k: int = 2
  n_shared_experts: int = 1
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  first_k_dense: int = 1
  q_lora_rank: int = 0
  kv_lora_rank: int = 64
  qk_nope_head_dim: int = 32
  qk_rope_head_dim: int = 16
  v_head_dim: int = 32
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 4096
  rope: RopeConfig = RopeConfig()
  rope_interleave: bool = True
  tie_word_embeddings: bool = False
  init_std: float = 0.02

  # --- how to compute (not part of the checkpoint) ---
  dtype: str = "float32"  # activations / matmul inputs; matmuls accumulate in fp32.
  param_dtype: str = "float32"
  # Expert compute: "blocked" (dropless, CPU default), "ragged" (dropless `jax.lax.ragged_dot`),
  # "tokamax" (dropless, tokamax's grouped matmul kernels: GPU/TPU), "dense" (every expert on every
  # token, exact; for a handful of tokens, e.g. decoding), "capacity" (fixed slots per expert; overflow
  # dropped and counted), "auto" (per platform: `backend.expert_impl`).
  expert_impl: Literal["auto", "blocked", "ragged", "tokamax", "dense", "capacity"] = "blocked"
  # Training attention: "auto" (per platform: `backend.attention_impl`), "xla", "cudnn", "splash"
  # (expanded K/V, attention_kernels.py), or "absorbed" (the latent form decoding always uses).
  attention_impl: Literal["auto", "absorbed", "xla", "cudnn", "splash"] = "auto"
  # The "xla" and "absorbed" kernels (the CPU path; prefill and the RL update) take queries in chunks of at
  # most this many positions, each chunk's scores recomputed in the backward pass, so [B, T, H, S] fp32
  # scores never exist whole: memory linear in the length, not quadratic. 0: all queries at once.
  attention_chunk: int = 512
  expert_block: int = 128  # blocked path: rows per block (padding < n_experts·expert_block rows).
  # Slots per expert (capacity path) / per EP buffer, × a balanced share; 0: dropless (worst-case buffers).
  capacity_factor: float = 2.0
  # Ragged/tokamax paths: the sorted rows in this many equal chunks, a `while` loop running only those
  # that hold assigned rows (compute for the rows a padded EP buffer got, not its size; the hidden
  # activations one chunk at a time). 0 or 1: one pass over every row. The EP buffer pads to a multiple.
  expert_chunks: int = 0
  dispatch: Literal["all_to_all", "ragged_all_to_all"] = "all_to_all"  # expert parallelism.
  router_aux_loss_coef: float = 0.0  # DeepSeek-V3 sequence-wise balance loss weight (α).
  # Activation rematerialisation per block in training: "none", "full" (keep block inputs only),
  # "dots" (keep non-batched matmul outputs), "dots_with_batch" (all matmul outputs).
  remat: Literal["none", "full", "dots", "dots_with_batch"] = "none"
  # Each layer stack runs as one `lax.scan` (compile time independent of depth); False unrolls it.
  scan_layers: bool = True
  # Pretraining/SFT loss: the LM head and log-softmax run on `loss_chunk` columns of every row at a time,
  # recomputed in the backward pass, so the [B, T, V] fp32 logits never exist whole (10 GiB per chip at
  # Moonlight's 4 rows of 4096 and vocab 163840); 0: the whole sequence at once.
  loss_chunk: int = 0
  # Causal load balancing over the dense mesh's `context` axis (pretraining): each row cut into 2·context
  # chunks, context shard i holding chunks i and 2·context−1−i (`context_balance.balance_sequence`), so every
  # shard does the same causal attention work (contiguous, the last shard does 2·context/(context+1)× the
  # mean at one block per shard, up to (2·context−1)/context with fine blocks). On by default: exact on
  # "xla" and "absorbed" (masks from positions) and "splash" (its mask over the permuted rows); "cudnn"
  # masks by index and is refused (`check_context_balance`). Under "capacity" experts, which tokens
  # overflow depends on their order.
  context_load_balance: bool = True

  def __post_init__(self):
    _check(self)

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² for YaRN (HF `yarn_apply_mscale`)."""
    scale = self.qk_head_dim**-0.5
    if self.rope.kind != "default" and self.rope.mscale_all_dim:
      m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
      scale *= m * m
    return scale

  def is_moe_layer(self, layer: int) -> bool:
    return layer >= self.first_k_dense

  @property
  def n_moe_layers(self) -> int:
    return sum(map(self.is_moe_layer, range(self.n_layers)))

  @classmethod
  def from_hf(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
    """Reads a HF DeepseekV3 / Kimi-K2 `config.json` dict (text part of Kimi-K2.5 too)."""
    if "text_config" in hf:  # Kimi-K2.5 wraps the language model config.
      hf = hf["text_config"]
    arch = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES and not set(arch) & set(_ARCHITECTURES):
      raise ValueError(
        f"Unsupported HF architecture {arch or None} / model_type {model_type!r}; "
        f"expected one of {_ARCHITECTURES} / {_MODEL_TYPES}."
      )
    _require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"), "'silu'")
    _require(not hf.get("attention_bias", False), "attention_bias", True, "false")
    _require(
      hf.get("num_key_value_heads") in (None, hf.get("num_attention_heads")),
      "num_key_value_heads",
      hf.get("num_key_value_heads"),
      "num_attention_heads",
    )
    _require(
      hf.get("scoring_func", "sigmoid") == "sigmoid", "scoring_func", hf.get("scoring_func"), "'sigmoid'"
    )
    _require(
      hf.get("topk_method", "noaux_tc") == "noaux_tc", "topk_method", hf.get("topk_method"), "'noaux_tc'"
    )
    kwargs = {ours: hf[theirs] for theirs, ours in _HF_FIELDS.items() if hf.get(theirs) is not None}
    kwargs["q_lora_rank"] = hf.get("q_lora_rank") or 0
    kwargs["rope"] = _rope_from_hf(hf)
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf(self) -> dict[str, Any]:
    """The HF `DeepseekV3Config` kwargs of this model (transformers 5 `rope_parameters` form)."""
    out = {theirs: getattr(self, ours) for theirs, ours in _HF_FIELDS.items()}
    out.update(
      architectures=["DeepseekV3ForCausalLM"],
      model_type="deepseek_v3",
      q_lora_rank=self.q_lora_rank or None,
      num_key_value_heads=self.n_heads,
      hidden_act="silu",
      attention_bias=False,
      num_nextn_predict_layers=0,
      initializer_range=self.init_std,
    )
    r = self.rope
    params = {"rope_type": r.kind, "rope_theta": r.theta}
    if r.kind == "yarn":
      params.update(
        factor=r.factor,
        original_max_position_embeddings=r.original_max_position,
        beta_fast=r.beta_fast,
        beta_slow=r.beta_slow,
        truncate=r.truncate,
      )
      for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(r, key) is not None:
          params[key] = getattr(r, key)
    out["rope_parameters"] = params
    return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN attention temperature: 0.1·m·ln(s) + 1 for s > 1 (DeepSeek-V2 / HF `yarn_get_mscale`)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
  # transformers 5 writes `rope_parameters` (theta inside); published config.json files use
  # `rope_theta` + `rope_scaling`.
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  unknown = set(params) - set(_ROPE_KEYS)
  if unknown:
    raise ValueError(f"Unsupported RoPE settings {sorted(unknown)} in {params}.")
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in ("default", "yarn"):
    raise ValueError(f"Unsupported rope_type {kind!r}; supported: 'default', 'yarn'.")
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  if kind == "default":
    return RopeConfig(theta=float(theta))
  factor = params.get("factor")
  original = params["original_max_position_embeddings"]
  if factor is None:
    factor = hf["max_position_embeddings"] / original
  return RopeConfig(
    theta=float(theta),
    kind="yarn",
    factor=float(factor),
    original_max_position=int(original),
    beta_fast=float(params.get("beta_fast") or 32),
    beta_slow=float(params.get("beta_slow") or 1),
    mscale=params.get("mscale"),
    mscale_all_dim=params.get("mscale_all_dim"),
    attention_factor=params.get("attention_factor"),
    truncate=bool(params.get("truncate", True)),
  )


def _require(ok: bool, field: str, value: Any, expected: str) -> None:
  if not ok:
    raise ValueError(f"Unsupported HF config value {field}={value!r}; expected {expected}.")


def _check(c: ModelConfig) -> None:
  """Fails early, naming the field, on shapes the model cannot run."""
  problems = []
  if c.n_experts % c.n_group:
    problems.append(f"n_experts={c.n_experts} is not divisible by n_group={c.n_group}")
  elif c.n_group > 1 and c.n_experts // c.n_group < 2:
    problems.append("group-limited routing needs >= 2 experts per group (it sums each group's top 2)")
  if not 1 <= c.topk_group <= c.n_group:
    problems.append(f"topk_group={c.topk_group} must be in [1, n_group={c.n_group}]")
  if not 1 <= c.top_k <= c.n_experts * c.topk_group // c.n_group:
    problems.append(f"top_k={c.top_k} exceeds the experts left after group selection")
  if c.qk_rope_head_dim % 2:
    problems.append(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even")
  if c.attention_chunk < 0:
    problems.append(f"attention_chunk={c.attention_chunk} must be >= 0 (0: all queries at once)")
  if c.loss_chunk < 0:
    problems.append(f"loss_chunk={c.loss_chunk} must be >= 0 (0: the whole sequence at once)")
  if not 0 <= c.first_k_dense <= c.n_layers:
    problems.append(f"first_k_dense={c.first_k_dense} must be in [0, n_layers={c.n_layers}]")
  impls = ("auto", "blocked", "ragged", "tokamax", "dense", "capacity")
  if c.expert_impl not in impls:
    problems.append(f"expert_impl={c.expert_impl!r} must be one of {impls}")
  if c.attention_impl not in ("auto", "absorbed", "xla", "cudnn", "splash"):
    problems.append(
      f"attention_impl={c.attention_impl!r} must be 'auto', 'absorbed', 'xla', 'cudnn' or 'splash'"
    )
  if c.expert_block < 1:
    problems.append(f"expert_block={c.expert_block} must be >= 1")
  if c.dispatch not in ("all_to_all", "ragged_all_to_all"):
    problems.append(f"dispatch={c.dispatch!r} must be 'all_to_all' or 'ragged_all_to_all'")
  if c.remat not in ("none", "full", "dots", "dots_with_batch"):
    problems.append(f"remat={c.remat!r} must be 'none', 'full', 'dots' or 'dots_with_batch'")
  if c.expert_chunks < 0:
    problems.append(f"expert_chunks={c.expert_chunks} must be >= 0 (0: one pass over every row)")
  if c.capacity_factor < 0:
    problems.append(f"capacity_factor={c.capacity_factor} must be >= 0 (0: dropless)")
  if c.dtype not in ("float32", "bfloat16") or c.param_dtype not in ("float32", "bfloat16"):
    problems.append(f"dtype={c.dtype!r}, param_dtype={c.param_dtype!r}: use 'float32' or 'bfloat16'")
  if problems:
    raise ValueError("Invalid ModelConfig: " + "; ".join(problems) + ".")


def check_context_balance(impl: str, context: int, seq_len: int, length_name: str) -> None:
  """A one-line ValueError for a load-balanced context split that cannot run: the attention kernel
  `impl` must mask by position (cuDNN's `is_causal` masks by index), and the length must cut into
  2·context equal chunks."""
  if impl == "cudnn":
    raise ValueError(
      "model.context_load_balance needs attention that masks by position (xla, absorbed, splash), not "
      "cudnn: set --config.model.context_load_balance=false or another model.attention_impl"
    )
  if seq_len % (2 * context):
    raise ValueError(
      f"model.context_load_balance cuts each row into 2·context = {2 * context} chunks: {length_name} "
      f"{seq_len} is not divisible by {2 * context}"
    )
