"""HF DeepseekV3 / Kimi-K2 safetensors checkpoints ↔ our params tree, one tensor slice at a time.

Loading memory-maps the safetensors files (raw bytes: safetensors' numpy framework cannot read
bf16) and builds every leaf with `jax.make_array_from_callback`, so each device shard reads only
its own slice — a stacked expert leaf [E, D, F] reads only the experts in the shard's range from
the per-expert tensors. The host never holds a second full copy of the model. Saving streams one
tensor (or one device's block of experts) at a time into a single `model.safetensors`.

Our decoder layers are stacked (`dense_layers`, `moe_layers`: a leading layer axis, transformer.py);
HF keeps one tensor per layer (`model.layers.{l}.*`), so a stacked leaf maps to one key per layer.
HF stores `Linear` weights [out, in]; ours are [in, out] with heads split out:
q_b_proj [H·K, Q] ↔ [Q, H, K], kv_b_proj [H·(N+V), C] ↔ [C, H, N+V], o_proj [D, H·V] ↔ [H, V, D].
Routed experts are `mlp.experts.{e}.{gate,up,down}_proj.weight` on disk (per expert) or the fused
in-memory layout `mlp.experts.gate_up_proj` [E, 2F, D] (gate first) + `down_proj` [E, D, F].
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator

import jax
import ml_dtypes
import numpy as np

from composer_jax import sharding
from composer_jax.model import transformer
from composer_jax.model.config import ModelConfig

_DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_PREFIX = "language_model."  # Kimi-K2.5 keeps the text model under this prefix.
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # Kimi-K2.5's vision branch: not ours.
_QUANTISED = re.compile(r"\.(weight_packed|weight_scale|weight_shape|weight_zero_point|weight_scale_inv)$")

# Layouts: (HF shape from ours, HF tensor → ours (a view), ours → HF tensor).
_LAYOUTS = {
  "copy": (lambda s: s, lambda w, s: w, lambda x: x),
  "t": (lambda s: s[::-1], lambda w, s: w.T, lambda x: x.T),
  # [H·K, X] ↔ [X, H, K]: q_proj, q_b_proj, kv_b_proj.
  "heads_out": (
    lambda s: (s[1] * s[2], s[0]),
    lambda w, s: w.reshape(s[1], s[2], s[0]).transpose(2, 0, 1),
    lambda x: x.transpose(1, 2, 0).reshape(x.shape[1] * x.shape[2], x.shape[0]),
  ),
  # [D, H·V] ↔ [H, V, D]: o_proj.
  "heads_in": (
    lambda s: (s[2], s[0] * s[1]),
    lambda w, s: w.reshape(s[2], s[0], s[1]).transpose(1, 2, 0),
    lambda x: x.transpose(2, 0, 1).reshape(x.shape[2], x.shape[0] * x.shape[1]),
  ),
}
_EXPERT_LEAVES = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def _layer_tensors(cfg: ModelConfig, moe: bool) -> dict[tuple, tuple[str, str]]:
  """One layer's leaf path (inside its stack) → (HF key suffix after `model.layers.{l}.`, layout),
  routed experts aside. Every layer of a stack has the same leaves."""
  out = {("input_norm",): ("input_layernorm.weight", "copy")}
  out[("post_attn_norm",)] = ("post_attention_layernorm.weight", "copy")
  attn = {
    "kv_a_proj": ("kv_a_proj_with_mqa", "t"),
    "kv_a_norm": ("kv_a_layernorm", "copy"),
    "kv_b_proj": ("kv_b_proj", "heads_out"),
    "o_proj": ("o_proj", "heads_in"),
  }
  if cfg.q_lora_rank:
    attn.update(
      q_a_proj=("q_a_proj", "t"), q_a_norm=("q_a_layernorm", "copy"), q_b_proj=("q_b_proj", "heads_out")
    )
  else:
    attn.update(q_proj=("q_proj", "heads_out"))
  for name, (theirs, layout) in attn.items():
    out[("attn", name)] = (f"self_attn.{theirs}.weight", layout)
  mlp = ("gate_proj", "up_proj", "down_proj")
  if moe:
    out[("mlp", "router")] = ("mlp.gate.weight", "t")
    out[("mlp", "router_bias")] = ("mlp.gate.e_score_correction_bias", "copy")
    if cfg.n_shared_experts:
      out.update({("mlp", "shared", name): (f"mlp.shared_experts.{name}.weight", "t") for name in mlp})
  else:
    out.update({("mlp", name): (f"mlp.{name}.weight", "t") for name in mlp})
  return out


def _tensor_map(cfg: ModelConfig) -> dict[tuple, tuple[tuple[str, ...], str, bool]]:
  """Our leaf path → (HF keys, layout, stacked) for every non-routed-expert leaf: one key for a leaf
  outside the stacks, one per layer (in stack order) for a stacked leaf."""
  out = {("embed",): (("model.embed_tokens.weight",), "copy", False)}
  out[("final_norm",)] = (("model.norm.weight",), "copy", False)
  if not cfg.tie_word_embeddings:
    out[("lm_head",)] = (("lm_head.weight",), "t", False)
  for name, layers in _stack_layers(cfg).items():
    for path, (suffix, layout) in _layer_tensors(cfg, name == transformer.MOE).items():
      out[(name, *path)] = (tuple(f"model.layers.{layer}.{suffix}" for layer in layers), layout, True)
  return out


def _stack_layers(cfg: ModelConfig) -> dict[str, list[int]]:
  """Stack key → the HF layer numbers it holds, in order."""
  out: dict[str, list[int]] = {}
  for layer in range(cfg.n_layers):
    out.setdefault(transformer.layer_slot(cfg, layer)[0], []).append(layer)
  return out


def _expert_key(layer: int, expert: int, proj: str) -> str:
  return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


# ---------------------------------------------------------------------------------------------
# Reading


class _Checkpoint:
  """The tensors of a safetensors checkpoint directory as lazily read, memory-mapped arrays."""

  def __init__(self, path: str):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
      self.source = index
    elif os.path.exists(os.path.join(path, "model.safetensors")):
      files, self.source = ["model.safetensors"], os.path.join(path, "model.safetensors")
    else:
      raise FileNotFoundError(f"No model.safetensors or model.safetensors.index.json in {path!r}.")
    self.entries = {}  # key without `language_model.` → (file, raw key, dtype, shape, byte range)
    for name in files:
      file = os.path.join(path, name)
      with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
      header.pop("__metadata__", None)
      for raw, info in header.items():
        if info["dtype"] not in _DTYPES:
          raise ValueError(f"Tensor {raw!r} in {file} has unsupported dtype {info['dtype']}.")
        self.entries[raw.removeprefix(_PREFIX)] = (
          file,
          raw,
          _DTYPES[info["dtype"]],
          tuple(info["shape"]),
          tuple(info["data_offsets"]),
          8 + size,
        )
    self._maps: dict[str, np.memmap] = {}

  def __contains__(self, key: str) -> bool:
    return key in self.entries

  def shape(self, key: str, expected: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The stored shape; a missing key or a shape other than `expected` is an error."""
    if key not in self.entries:
      raise KeyError(f"Tensor {key!r} (optionally prefixed {_PREFIX!r}) is missing from {self.source}.")
    file, raw, _, shape, _, _ = self.entries[key]
    if expected is not None and shape != tuple(expected):
      raise ValueError(
        f"Tensor {raw!r} in {file} has shape {list(shape)}, but the config needs {list(expected)}."
      )
    return shape

  def array(self, key: str) -> np.ndarray:
    """A read-only view of the tensor on the mapped file; slicing it reads only those bytes."""
    file, _, dtype, shape, (begin, end), data_start = self.entries[key]
    if file not in self._maps:
      self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
    return self._maps[file][data_start + begin : data_start + end].view(dtype).reshape(shape)


def _mtp_layers(path: str) -> int:
  """Multi-token-prediction layers appended after the main ones (DeepSeek-V3: 1); HF drops them."""
  try:
    with open(os.path.join(path, "config.json")) as f:
      hf = json.load(f)
  except FileNotFoundError:
    return 1
  hf = hf.get("text_config", hf)
  return int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0)


def _stacked(per_layer: list[Callable]) -> Callable:
  """A reader of a stacked leaf [L, ...] from readers of each layer's [...] slice."""

  def read(index, dtype):
    return np.stack([per_layer[layer](index[1:], dtype) for layer in range(len(per_layer))[index[0]]])

  return read


def _sources(ckpt: _Checkpoint, cfg: ModelConfig, abstract: dict) -> tuple[dict, set]:
  """Leaf path → callback(index, dtype) giving that slice in our layout; and the HF keys used.

  Every key and shape is checked here, before any array is built. Callbacks return a private
  copy: a device buffer must never alias the mapped file (it may be overwritten later).
  """
  sources, used = {}, set()
  for path, (keys, layout, stacked) in _tensor_map(cfg).items():
    shape = _leaf(abstract, path).shape[1 if stacked else 0 :]
    readers = []
    for key in keys:
      ckpt.shape(key, _LAYOUTS[layout][0](shape))
      used.add(key)
      view = _LAYOUTS[layout][1]
      readers.append(
        lambda index, dtype, key=key, view=view, shape=shape: np.array(
          view(ckpt.array(key), shape)[index], dtype, order="C"
        )
      )
    sources[path] = _stacked(readers) if stacked else readers[0]
  moe_layers = _stack_layers(cfg).get(transformer.MOE, [])
  for name in _EXPERT_LEAVES:
    path = (transformer.MOE, "mlp", name)
    if moe_layers:
      shape = _leaf(abstract, path).shape[1:]  # [E, D, F] or [E, F, D]
      sources[path] = _stacked([_expert_reader(ckpt, cfg, layer, name, shape, used) for layer in moe_layers])
  return sources, used


def _expert_reader(ckpt: _Checkpoint, cfg: ModelConfig, layer: int, name: str, shape: tuple, used: set):
  """Reader of one layer's routed-expert leaf [E, D, F] / [E, F, D] from the fused in-memory layout
  or the per-expert tensors (reading only the experts of the requested slice)."""
  E, F, proj = cfg.n_experts, cfg.moe_mlp_dim, _EXPERT_LEAVES[name]
  fused = f"model.layers.{layer}.mlp.experts.gate_up_proj"
  if fused in ckpt:
    if proj == "down_proj":
      key, part = f"model.layers.{layer}.mlp.experts.down_proj", slice(None)
      ckpt.shape(key, (E, shape[2], shape[1]))
    else:
      key, part = fused, slice(0, F) if proj == "gate_proj" else slice(F, 2 * F)
      ckpt.shape(key, (E, 2 * F, shape[1]))
    used.add(key)
    return lambda index, dtype: np.array(ckpt.array(key)[:, part].transpose(0, 2, 1)[index], dtype, order="C")
  keys = [_expert_key(layer, e, proj) for e in range(E)]
  for key in keys:
    ckpt.shape(key, shape[:0:-1])
  used.update(keys)

  def per_expert(index, dtype):
    picked = range(len(keys))[index[0]]
    rows, cols = (range(n)[i] for n, i in zip(shape[1:], index[1:], strict=True))
    out = np.empty((len(picked), len(rows), len(cols)), dtype)
    for i, e in enumerate(picked):  # only this shard's experts are read
      out[i] = ckpt.array(keys[e]).T[index[1:]]
    return out

  return per_expert


def _check_unused(ckpt: _Checkpoint, used: set, cfg: ModelConfig, n_mtp: int) -> None:
  """Every tensor must have a place, but empty ones (HF writes shared experts of width 0 when
  n_shared_experts = 0), rotary buffers, MTP layers and the vision branch."""
  mtp = tuple(f"model.layers.{layer}." for layer in range(cfg.n_layers, cfg.n_layers + n_mtp))
  unused = sorted(
    raw
    for key, (_, raw, _, shape, *_) in ckpt.entries.items()
    if key not in used
    and 0 not in shape
    and "rotary_emb." not in key
    and not key.startswith(mtp + _VISION_PREFIXES)
  )
  if unused:
    raise ValueError(
      f"{len(unused)} tensors in {ckpt.source} have no place in this config (wrong config?), "
      f"e.g. {unused[:5]}."
    )


def load_hf_checkpoint(path: str, cfg: ModelConfig, meshes: sharding.Meshes | None = None) -> dict:
  """Our params tree from a HF DeepseekV3 / Kimi-K2 safetensors checkpoint directory.

  Each leaf is created in its final sharding (`sharding.param_shardings`; the default device
  without meshes) and cast to the leaf's dtype (`cfg.param_dtype`; router weights stay float32).
  Ignored: MTP layers (`model.layers.{n_layers}.*`, as many as config.json's
  `num_nextn_predict_layers`, 1 without a config.json), rotary buffers, Kimi-K2.5 vision tensors.
  """
  path = os.fspath(path)
  ckpt = _Checkpoint(path)
  quantised = sorted(raw for _, raw, *_ in ckpt.entries.values() if _QUANTISED.search(raw))
  if quantised:
    raise NotImplementedError(
      f"{ckpt.source} holds quantised weights (e.g. {quantised[:3]}): int4 / fp8 dequantisation isn't "
      "supported; dequantise the checkpoint to bf16 first."
    )
  abstract = transformer.abstract_params(cfg)
  sources, used = _sources(ckpt, cfg, abstract)
  _check_unused(ckpt, used, cfg, _mtp_layers(path))
  if meshes is None:
    device = jax.config.jax_default_device
    if not isinstance(device, jax.Device):
      device = jax.devices(device)[0] if device else jax.devices()[0]
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), abstract)
  else:
    shardings = sharding.param_shardings(transformer.logical_axes(cfg), abstract, meshes)

  def build(key_path, leaf, leaf_sharding):
    path = _path(key_path)
    if path not in sources:
      raise KeyError(f"No HF tensor maps to our parameter {'/'.join(map(str, path))}.")
    source = sources[path]
    return jax.make_array_from_callback(leaf.shape, leaf_sharding, lambda index: source(index, leaf.dtype))

  return jax.tree_util.tree_map_with_path(build, abstract, shardings)


# ---------------------------------------------------------------------------------------------
# Writing


def _host_blocks(x) -> Iterator[tuple[int, np.ndarray]]:
  """(start, rows) blocks of x along axis 0 on the host: one device's shard range at a time."""
  if not isinstance(x, jax.Array):
    yield 0, np.asarray(x)
    return
  if not x.is_fully_addressable:
    raise ValueError("save_hf_checkpoint needs fully addressable arrays; gather to one process first.")
  ranges = {}
  for shard in x.addressable_shards:
    start, stop, _ = shard.index[0].indices(x.shape[0])
    rest = tuple((s.start, s.stop) for s in shard.index[1:])  # slices aren't hashable before 3.12
    ranges.setdefault((start, stop), {})[rest] = shard  # one copy per distinct slice
  for (start, stop), shards in sorted(ranges.items()):
    block = np.empty((stop - start, *x.shape[1:]), x.dtype)
    for shard in shards.values():
      block[(slice(None), *shard.index[1:])] = np.asarray(shard.data)
    yield start, block


def _hf_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, tuple, np.dtype, Callable]]:
  """(HF key, shape, dtype, thunk giving the array) in file order; stacks one layer at a time,
  experts one at a time."""
  for path, (keys, layout, stacked) in _tensor_map(cfg).items():
    x = _leaf(params, path)
    shape = tuple(x.shape[1:] if stacked else x.shape)
    hf_shape, to_hf = _LAYOUTS[layout][0](shape), _LAYOUTS[layout][2]
    for i, key in enumerate(keys):
      yield (
        key,
        hf_shape,
        np.dtype(x.dtype),
        lambda x=x, i=i, s=stacked, f=to_hf: f(np.asarray(x[i] if s else x)),
      )
  moe_layers = _stack_layers(cfg).get(transformer.MOE, [])
  for i, layer in enumerate(moe_layers):
    for name, proj in _EXPERT_LEAVES.items():
      x = _leaf(params, (transformer.MOE, "mlp", name))
      blocks = _host_blocks(x[i])  # one block alive at a time; experts arrive in order
      state = {"start": 0, "block": np.empty((0,))}

      def expert(e, blocks=blocks, state=state):
        while not state["start"] <= e < state["start"] + len(state["block"]):
          state["start"], state["block"] = next(blocks)
        return state["block"][e - state["start"]].T

      hf_shape = tuple(x.shape[:1:-1])
      for e in range(x.shape[1]):
        yield _expert_key(layer, e, proj), hf_shape, np.dtype(x.dtype), lambda e=e, f=expert: f(e)


def save_hf_checkpoint(params: dict, cfg: ModelConfig, path: str) -> None:
  """Writes `model.safetensors` (HF layout, per-expert keys) and `config.json` into `path`.

  `transformers.DeepseekV3ForCausalLM.from_pretrained(path)` loads the result. Tensors keep the
  params' dtypes and are streamed to disk one at a time.
  """
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  tensors = list(_hf_tensors(params, cfg))
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for key, shape, dtype, _ in tensors:
    if dtype not in _NAMES:
      raise ValueError(f"Cannot write {key} of dtype {dtype} to safetensors.")
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # 8-byte aligned data, like the reference writer
  with open(os.path.join(path, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for key, shape, dtype, get in tensors:
      array = np.ascontiguousarray(get(), dtype=dtype)
      if array.shape != shape:
        raise ValueError(f"{key}: produced shape {array.shape}, expected {shape}.")
      f.write(array.reshape(-1).view(np.uint8).data)
  hf_config = cfg.to_hf()
  hf_config.setdefault("dtype", cfg.param_dtype)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)


# ---------------------------------------------------------------------------------------------


def _path(key_path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in key_path)


def _leaf(tree: dict, path: tuple):
  for key in path:
    tree = tree[key] if key in tree else tree[str(key)]  # layer keys may be strings after a restore
  return tree
