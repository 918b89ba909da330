"""Step time, FLOPs and MFU from XLA's own cost model, corrected for `while` loops.

`compiled.cost_analysis()` of an XLA:TPU ahead-of-time compile gives `flops`, `bytes accessed` and
`optimal_seconds` (the TPU cost model's time for one device), but XLA's HloCostAnalysis counts a `while`
body once: a 10-step `lax.scan` of matmuls reports a tenth of the same loop unrolled. A train step with
scanned layers (and grad accumulation, and Newton–Schulz loops) is mostly loop bodies, so its raw figures
are short by about the layer count.

The correction here reads the optimized HLO text (`compiled.as_text()`), where every loop is explicit:
1. Trip counts: `known_trip_count` in a `while`'s backend_config when XLA wrote one; otherwise the loop
   JAX emits for `scan`/`fori_loop` — a condition `compare(get-tuple-element(p, i), constant(N)),
   direction=LT` with element `i` of the initial tuple a constant `K` (through copies) and a step of 1 —
   gives N − K. A loop of data-dependent length whose `op_name` carries the scope
   `expert_row_chunks_expect<N>` (the MoE layer's row-chunk loop, `experts.row_chunked_swiglu`: N = the
   chunks a device's balanced share fills, plus one) counts N times and is listed with `"expected":
   true`. A loop matching none counts once and is listed under `unknown_trip_counts`.
2. A per-instruction roofline of our own over the whole module: FLOPs of `dot`, `convolution` (valid
   window taps only: XLA:TPU writes batched matmuls as convolutions over a dilated or padded window),
   `ragged-dot` and grouped-matmul Mosaic kernels (MaxText's gmm/tgmm, XLA:TPU's ragged-dot kernel, from
   their operand shapes; other kernels such as splash attention count by bytes only, the text carries no
   kernel cost) — 2 × output elements × contracted size; one per output element for arithmetic ops —, HBM
   bytes of each unfused instruction or fusion (operands + result), time max(FLOPs / peak, bytes / HBM
   bandwidth). It is summed twice: each computation once (what XLA does) and each weighted by the product
   of the trip counts of the loops around it.
3. XLA's figures are scaled by weighted ÷ once of the same quantity: `flops` by the FLOP ratio, `bytes
   accessed` by the byte ratio and `optimal_seconds` by the roofline-time ratio. XLA keeps the absolute
   scale (its fusion-level cost model); our walk only says how much of the program repeats. Where XLA's
   `optimal_seconds` is negative (it gives about -10 s for programs it cannot time, e.g. our tiny MoE
   step), the step time is the weighted roofline itself (`seconds_source` says which).

Checked on a small case (tests/test_compile.py): a scanned loop of matmuls and the same loop unrolled
give estimates within 10 %. The same walk gives collective bytes by kind (result sizes, weighted) and
the share of the step spent in ops whose `op_name` carries a scope (e.g. Muon's `muon_group<i>` and
`newton_schulz`), so the Muon update's own time is the corrected step time × its roofline share.
The cost model is per op (no overlap of collectives with compute, no launch gaps): read its seconds as a
ratio against a peer compiled the same way, not as a wall time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import numpy as np

from composer_jax.plan import hlo

# bf16 dense FLOP/s and HBM bytes/s per chip by `device_kind` (Google Cloud TPU system architecture pages).
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5": 459e12, "TPU v5 lite": 197e12, "TPU v6 lite": 918e12}
HBM_BANDWIDTH = {"TPU v4": 1.228e12, "TPU v5": 2.765e12, "TPU v5 lite": 0.819e12, "TPU v6 lite": 1.64e12}

_CALLS = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_EXPECT = re.compile(r"expert_row_chunks_expect(\d+)(?!\d)")
_COLLECTIVE = re.compile(r"^((?:ragged-)?all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)")
# Ops that move or relabel data (0 FLOPs); ops whose bytes are counted elsewhere (a called computation).
_NO_FLOPS = frozenset(
  "parameter constant get-tuple-element tuple bitcast copy reshape transpose broadcast slice dynamic-slice "
  "dynamic-update-slice concatenate pad iota convert gather scatter reverse copy-start copy-done "
  "after-all partition-id replica-id custom-call rng-get-and-update-state opt-barrier while call conditional "
  "fusion async-start async-update async-done send recv send-done recv-done".split()
)
_NO_BYTES = frozenset("parameter constant get-tuple-element tuple bitcast while call conditional".split())
_NO_BYTES |= frozenset("after-all partition-id replica-id opt-barrier".split())


@functools.lru_cache(maxsize=4096)
def _valid_taps(in_size: int, out_size: int, size: int, stride: int, pad: int, lhs: int, rhs: int) -> float:
  """Mean window taps per output position of one spatial dimension that meet an input element (not
  padding, not an lhs-dilation hole): XLA's HloCostAnalysis counts convolutions the same way."""
  o = np.arange(out_size)[:, None]
  k = np.arange(size)[None, :]
  idx = o * stride + k * rhs - pad
  valid = (idx >= 0) & (idx <= (in_size - 1) * lhs) & (idx % lhs == 0)
  return float(valid.sum()) / max(out_size, 1)


def _window_taps(ins: hlo.Instr, labels: tuple[str, str, str], table: dict[str, hlo.Instr]) -> float:
  """Valid taps per output element over all spatial dimensions. XLA:TPU writes batched matmuls as
  convolutions whose window spans the batch (e.g. size=B, lhs_dilate=B, or padding B-1 on both sides),
  so the window's size alone overcounts by the batch."""
  window = re.search(r"window=\{([^}]*)\}", ins.attrs)
  if not window:
    return 1.0
  fields = dict(re.findall(r"(\w+)=([\d_x-]+)", window.group(1)))
  sizes = [int(x) for x in fields.get("size", "1").split("x")]
  n = len(sizes)

  def per_dim(key: str, default: str) -> list[str]:
    return fields.get(key, "x".join([default] * n)).split("x")

  stride, lhs, rhs = ([int(x) for x in per_dim(k, "1")] for k in ("stride", "lhs_dilate", "rhs_dilate"))
  pad = [int(x.split("_")[0]) for x in per_dim("pad", "0_0")]
  lhs_dims = [d for _, d in hlo.dims(hlo.shape_of(table, ins.operands[0]))][0]
  out_dims = [d for _, d in hlo.dims(ins.shape)][0]
  taps = 1.0
  for i in range(n):
    in_size, out_size = lhs_dims[labels[0].index(str(i))], out_dims[labels[2].index(str(i))]
    taps *= _valid_taps(in_size, out_size, sizes[i], stride[i], pad[i], lhs[i], rhs[i])
  return taps


def _contracted(ins: hlo.Instr, table: dict[str, hlo.Instr]) -> int:
  """Contracted size per output element of a dot, convolution or ragged-dot (1 for anything else)."""
  operand = [d for _, d in hlo.dims(hlo.shape_of(table, ins.operands[0]))] if ins.operands else []
  if ins.opcode == "dot" and operand:
    return math.prod(operand[0][i] for i in hlo.int_set(ins.attrs, "lhs_contracting_dims"))
  if ins.opcode == "ragged-dot" and operand:
    dims = hlo.int_set(ins.attrs, "lhs_contracting_dims") or [len(operand[0]) - 1]
    return math.prod(operand[0][i] for i in dims)
  if ins.opcode == "convolution" and len(ins.operands) > 1:
    kernel = [d for _, d in hlo.dims(hlo.shape_of(table, ins.operands[1]))]
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if kernel and labels:  # the kernel's input features times the window taps that meet real input
      features = math.prod(n for c, n in zip(labels.group(2), kernel[0], strict=False) if c == "i")
      return int(features * _window_taps(ins, labels.groups(), table))
  return 1


def _kernel_flops(ins: hlo.Instr, table: dict[str, hlo.Instr]) -> float:
  """A grouped-matmul Mosaic kernel (named gmm/tgmm: MaxText's megablox; ragged-dot: XLA:TPU's kernel),
  after its scalar-prefetch operands an lhs [M, K] → out [M, N] (or a weight gradient [G, K, N]):
  2·M·K·N. Other kernels (splash attention): 0, bytes only (the HLO text carries no kernel cost)."""
  out = [d for _, d in hlo.dims(ins.shape)]
  if not re.search(r"gmm|ragged-dot", ins.name) or len(out) != 1 or len(out[0]) not in (2, 3):
    return 0.0
  mats = [d for name in ins.operands for _, d in hlo.dims(hlo.shape_of(table, name)) if len(d) == 2]
  if len(out[0]) == 2:
    k = next((m[1] for m in mats if m[0] == out[0][0]), 0)
    return 2.0 * out[0][0] * out[0][1] * k
  rows = next((m[0] * m[1] // out[0][1] for m in mats if out[0][1] in m), 0)
  return 2.0 * rows * out[0][1] * out[0][2]


def _flops(ins: hlo.Instr, table: dict[str, hlo.Instr]) -> float:
  if ins.opcode == "custom-call":
    return _kernel_flops(ins, table)
  if ins.opcode in ("dot", "convolution", "ragged-dot"):
    return 2.0 * sum(math.prod(d) for _, d in hlo.dims(ins.shape)) * _contracted(ins, table)
  if ins.opcode in _NO_FLOPS or _COLLECTIVE.match(ins.opcode) or ins.opcode.endswith(("-start", "-done")):
    return 0.0
  return float(sum(math.prod(d) for _, d in hlo.dims(ins.shape)))


def _collective_bytes(ins: hlo.Instr) -> tuple[str, int] | None:
  """(kind, result bytes) of a collective; an async `-start`'s tuple result counts its largest array."""
  found = _COLLECTIVE.match(ins.opcode)
  if not found or ins.opcode.endswith("-done"):
    return None
  arrays = [b * math.prod(d) for b, d in hlo.dims(ins.shape)]
  return found.group(1), max(arrays, default=0)


def _constant(table: dict[str, hlo.Instr], name: str) -> int | None:
  """The integer value of instruction `name` if it is a scalar constant, looking through copies."""
  ins = table.get(name)
  while ins is not None and ins.opcode == "copy" and ins.operands:
    ins = table.get(ins.operands[0])
  if ins is None or ins.opcode != "constant" or not re.fullmatch(r"\s*-?\d+\s*", ins.args):
    return None
  return int(ins.args)


def _op_name(ins: hlo.Instr) -> str:
  found = _OP_NAME.search(ins.attrs)
  return found.group(1) if found else ""


def trip_count(ins: hlo.Instr, comps: dict[str, list[hlo.Instr]], table: dict[str, hlo.Instr]) -> int | None:
  """A `while`'s trip count: XLA's `known_trip_count`, else JAX's counted-loop pattern (docstring)."""
  if found := _TRIP.search(ins.attrs):
    return int(found.group(1))
  cond = comps.get(dict(_CALLS.findall(ins.attrs)).get("condition", ""), [])
  root = next((i for i in cond if i.root), None)
  if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
    return None
  counter, limit = table.get(root.operands[0]), _constant(table, root.operands[1])
  init = table.get(ins.operands[0]) if ins.operands else None
  if counter is None or counter.opcode != "get-tuple-element" or limit is None or init is None:
    return None
  index = int(re.search(r"index=(\d+)", counter.attrs).group(1))
  if init.opcode != "tuple" or index >= len(init.operands):
    return None
  start = _constant(table, init.operands[index])
  return None if start is None else max(limit - start, 0)


_SLICES = frozenset(("dynamic-slice", "slice", "gather"))


def _param_bytes(
  fused: list[hlo.Instr], comps: dict[str, list[hlo.Instr]], table: dict[str, hlo.Instr]
) -> dict[int, int]:
  """Bytes a fusion reads of each operand: a parameter only sliced inside (a layer of a scanned weight
  stack, also through nested fusions) reads its slices; the buffer a dynamic-update-slice writes into in
  place reads the update; any other use reads it whole."""
  users: dict[str, list[tuple[hlo.Instr, int]]] = {}
  for ins in fused:
    for k, name in enumerate(ins.operands):
      users.setdefault(name, []).append((ins, k))
  out = {}
  for ins in fused:
    if ins.opcode != "parameter":
      continue
    whole, size = hlo.shape_bytes(ins.shape), 0
    for user, k in users.get(ins.name, []):
      if user.opcode in _SLICES and k == 0:
        size += hlo.shape_bytes(user.shape)
      elif user.opcode == "dynamic-update-slice" and k == 0:
        size += hlo.shape_bytes(hlo.shape_of(table, user.operands[1]))
      elif user.opcode == "fusion":
        inner = comps.get(dict(_CALLS.findall(user.attrs)).get("calls", ""), [])
        size += _param_bytes(inner, comps, table).get(k, whole)
      else:
        size += whole
    out[int(ins.args)] = min(size, whole)
  return out


def _io_bytes(ins: hlo.Instr, comps: dict[str, list[hlo.Instr]], table: dict[str, hlo.Instr]) -> int:
  """HBM bytes an unfused instruction or a fusion reads and writes."""
  if ins.opcode in _NO_BYTES or ins.opcode.endswith("-done"):
    return 0
  if ins.opcode in _SLICES:
    return 2 * hlo.shape_bytes(ins.shape)
  if ins.opcode == "dynamic-update-slice":
    return 2 * hlo.shape_bytes(hlo.shape_of(table, ins.operands[1]))
  result = hlo.shape_bytes(ins.shape)
  reads = [hlo.shape_bytes(hlo.shape_of(table, n)) for n in ins.operands]
  if ins.opcode == "fusion":
    fused = comps.get(dict(_CALLS.findall(ins.attrs)).get("calls", ""), [])
    per_param = _param_bytes(fused, comps, table)
    reads = [per_param.get(i, r) for i, r in enumerate(reads)]
    root = next((i for i in fused if i.root), None)
    if root is not None and root.opcode == "dynamic-update-slice":
      result = hlo.shape_bytes(hlo.shape_of(table, root.operands[1]))
  return result + sum(reads)


@dataclasses.dataclass
class Totals:
  """Roofline sums: FLOPs, HBM bytes, seconds, collective result bytes by kind, seconds by op_name scope."""

  flops: float = 0.0
  bytes: float = 0.0
  seconds: float = 0.0
  collectives: dict[str, float] = dataclasses.field(default_factory=dict)
  scopes: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Walk:
  comps: dict[str, list[hlo.Instr]]
  table: dict[str, hlo.Instr]
  peak: float
  bandwidth: float
  scopes: dict[str, re.Pattern]
  record: list[tuple] | None = None  # (weighted seconds, weight, opcode, name, op_name) per instruction
  once: Totals = dataclasses.field(default_factory=Totals)
  weighted: Totals = dataclasses.field(default_factory=Totals)
  loops: list[dict[str, Any]] = dataclasses.field(default_factory=list)

  def fused_flops(self, name: str) -> float:
    total = 0.0
    for ins in self.comps.get(name, []):
      total += _flops(ins, self.table)
      if ins.opcode == "fusion":
        total += self.fused_flops(dict(_CALLS.findall(ins.attrs)).get("calls", ""))
    return total

  def add(self, ins: hlo.Instr, weight: float) -> None:
    flops = _flops(ins, self.table)
    if ins.opcode == "fusion":
      flops += self.fused_flops(dict(_CALLS.findall(ins.attrs)).get("calls", ""))
    size = _io_bytes(ins, self.comps, self.table)
    seconds = max(flops / self.peak, size / self.bandwidth)
    coll = _collective_bytes(ins)
    op_name = _OP_NAME.search(ins.attrs)
    if self.record is not None:
      self.record.append(
        (weight * seconds, weight * flops, weight, ins.opcode, op_name.group(1) if op_name else "")
      )
    for totals, w in ((self.once, 1.0), (self.weighted, weight)):
      totals.flops += w * flops
      totals.bytes += w * size
      totals.seconds += w * seconds
      if coll:
        totals.collectives[coll[0]] = totals.collectives.get(coll[0], 0.0) + w * coll[1]
      for scope, pattern in self.scopes.items():
        if op_name and pattern.search(op_name.group(1)):
          totals.scopes[scope] = totals.scopes.get(scope, 0.0) + w * seconds

  def visit(self, name: str, weight: float) -> None:
    for ins in self.comps.get(name, []):
      self.add(ins, weight)
      called = dict(_CALLS.findall(ins.attrs))
      if ins.opcode == "while":
        trip, expected = trip_count(ins, self.comps, self.table), False
        if trip is None and (marked := _EXPECT.search(_op_name(ins))):
          trip, expected = int(marked.group(1)), True
        self.loops.append({"while": ins.name, "trip_count": trip, "weight": weight, "expected": expected})
        for key in ("body", "condition"):
          self.visit(called[key], weight * (trip if trip is not None else 1))
      elif ins.opcode != "fusion" and "calls" in called:  # call, async-start, custom-call with a body
        self.visit(called["calls"], weight)
      elif ins.opcode == "conditional":
        branches = _BRANCHES.search(ins.attrs)
        names = _OPERAND.findall(branches.group(1)) if branches else []
        names += [called[k] for k in ("true_computation", "false_computation") if k in called]
        for branch in names:
          self.visit(branch, weight)


def walk(
  hlo_text: str, device_kind: str, scopes: dict[str, str] | None = None, record: bool = False
) -> _Walk:
  """Both roofline sums of a module (each computation once; weighted by loop trip counts); `record`
  keeps each instruction's weighted figures in `.record`."""
  comps, entry = hlo.parse_module(hlo_text)
  table = {ins.name: ins for body in comps.values() for ins in body}
  peak, bandwidth = PEAK_FLOPS.get(device_kind, 459e12), HBM_BANDWIDTH.get(device_kind, 2.765e12)
  patterns = {k: re.compile(v) for k, v in (scopes or {}).items()}
  w = _Walk(comps, table, peak, bandwidth, patterns, record=[] if record else None)
  w.visit(entry, 1.0)
  return w


def _phase(opcode: str, op_name: str) -> str:
  kind = "collective" if _COLLECTIVE.match(opcode) else "compute"
  if "transpose(jvp" in op_name:
    return f"backward {kind}"
  if "jvp(" in op_name:
    return f"forward {kind}"
  return f"rest {kind} (optimizer, loss, copies)"


def breakdown(hlo_text: str, device_kind: str, top: int = 12) -> dict[str, Any]:
  """Where the weighted roofline time goes: seconds by phase (forward, backward from JAX's jvp /
  transpose(jvp) op names, the rest: optimizer, loss, copies) × compute or collective, and the `top`
  op names (numbers stripped) by seconds with their FLOPs: what to read first in the HLO."""
  w = walk(hlo_text, device_kind, record=True)
  phases: dict[str, float] = {}
  ops: dict[str, list[float]] = {}
  for seconds, flops, _, opcode, op_name in w.record:
    phase = _phase(opcode, op_name)
    phases[phase] = phases.get(phase, 0.0) + seconds
    key = f"{opcode} {re.sub(r'[0-9]+', '', op_name.split('/', 1)[-1])[-120:]}"
    entry_ = ops.setdefault(key, [0.0, 0.0])
    entry_[0] += seconds
    entry_[1] += flops
  ranked = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
  return {
    "roofline_seconds": w.weighted.seconds,
    "phases": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
    "top": [{"op": k, "seconds": v[0], "flops": v[1]} for k, v in ranked],
  }


def _ratio(weighted: float, once: float) -> float:
  return weighted / once if once > 0 else 1.0


def estimate(hlo_text: str, cost: dict[str, float], device_kind: str, scopes: dict[str, str] | None = None):
  """XLA's `cost_analysis()` of a compiled module corrected for loop trip counts (module docstring).

  Returns a JSON-able dict: XLA's raw figures, the correction factors, the corrected per-device
  `flops`, `bytes_accessed` and `step_seconds` (corrected `optimal_seconds`), collective result bytes by
  kind per step, the seconds in each named scope, and the loops found with their trip counts.
  """
  w = walk(hlo_text, device_kind, scopes)
  once, weighted = w.once, w.weighted
  raw = {k: float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed", "optimal_seconds")}
  ratio = {
    "flops": _ratio(weighted.flops, once.flops),
    "bytes": _ratio(weighted.bytes, once.bytes),
    "seconds": _ratio(weighted.seconds, once.seconds),
  }
  # XLA:TPU returns a negative optimal_seconds (about -10) for some programs it cannot time (the tiny
  # MoE step): then the step time is our own weighted roofline (same walk, the chip's peak and HBM rate).
  valid = raw["optimal_seconds"] > 0
  seconds = raw["optimal_seconds"] * ratio["seconds"] if valid else weighted.seconds
  share = {k: _ratio(v, weighted.seconds) if weighted.seconds else 0.0 for k, v in weighted.scopes.items()}
  return {
    "xla_raw": raw,
    "correction": ratio,
    "flops": raw["flops"] * ratio["flops"],
    "bytes_accessed": raw["bytes accessed"] * ratio["bytes"],
    "step_seconds": seconds,
    "seconds_source": "xla_optimal_seconds" if valid else "roofline",
    "roofline_seconds": weighted.seconds,
    "collective_bytes": {k: int(v) for k, v in sorted(weighted.collectives.items())},
    "scope_seconds": {k: seconds * share.get(k, 0.0) for k in sorted(w.scopes)},
    "loops": [loop for loop in w.loops if loop["trip_count"] != 1],
    "unknown_trip_counts": sum(loop["trip_count"] is None for loop in w.loops),
    "peak_flops": w.peak,
    "hbm_bandwidth": w.bandwidth,
  }
