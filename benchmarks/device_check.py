"""What only a GPU can measure, in one prepared run (issues 33, 44): ≤ 8 minutes on one H100/H200, one JSON.

  python benchmarks/device_check.py --out=device_check.json            # on the GPU machine
  python benchmarks/device_check.py --dry_run --out=<tmp>/dry.json     # CPU, tiny shapes, seconds

Sections (`SECTIONS`, in this order; each records its figures or its error and the run goes on):
- `train:<attention>+<experts>`, attention ∈ {xla, cudnn} × experts ∈ {ragged (`jax.lax.ragged_dot`),
  tokamax (grouped matmul kernel)}: forward + backward (`value_and_grad` of the next-token loss, no
  optimizer) of a moonlight_16b-shaped model cut to 2 layers (1 dense + 1 MoE: d 2048, 16 heads MLA
  without q-LoRA, 64 experts top-6 + 2 shared, vocab 163,840, bf16 compute, fp32 params, unscanned, no
  remat): tokens/s (median of --steps timed steps after one warm-up step) and MFU = model FLOPs
  (`plan.compile.model_flops`: 6 · active params · tokens + causal attention) ÷ time ÷ the card's bf16
  dense peak (`PEAK_FLOPS`). Under `train` in the JSON, by pair.
- `step`: the pretraining step as the pretrain stage builds it (`train.step.make_step`: next-token loss,
  sharded Muon + AdamW of the variant's optimizer, router-bias update, QK-clip, state donated) on a
  one-device mesh, for moonlight_16b cut to --step_layers layers (default 4: 1 dense + 3 MoE) with the
  variant's own compute settings: layers scanned, `remat="full"`, attention "auto", experts as the
  variant names them, loss and expert row chunks. tokens/s, MFU (model FLOPs, recompute not counted) and
  XLA's memory of the compiled step: the figure that says something about a real step.
- `attention_parity`: logits and gradients of the same model and batch with attention "cudnn" vs "xla":
  max |Δ| relative to max |xla| (bf16 compute on both).
- `newton_schulz`: `optim.newton_schulz.orthogonalize` (5 quintic steps, bf16) on a stack of Kimi K2.5
  routed-expert matrices (2048 × 7168): TFLOP/s by `newton_schulz.flops`.
- `decode`: `rl.sampler.sample` with the 2-layer model (prefill of 32 × 128 tokens + 128 sampled tokens
  per row, one compiled loop): generated tokens/s over the whole call after a compile call.

Kernels: each model section reports `kernels`, what ran, not what was asked for. The model code notes
the kernel it picks while it is traced (`backend.record_kernels`); the compiled program's custom calls
(`custom_calls`) must then show it: cuDNN attention is a `__cudnn$fmha*` call, a Pallas Triton kernel
(tokamax's GPU grouped matmul) `__gpu$xla.gpu.triton`, a Mosaic kernel `tpu_custom_call` or
`mosaic_gpu*` (`FUSED_CALLS`). A fused kernel asked for that did not make it into the program (tokamax
hands a shape its kernel refuses to XLA's ragged_dot, tokamax on a mesh without the expert-parallel path
resolves to "ragged", "auto" without tokamax picks XLA) is reported as the XLA path that ran and listed
under `fallbacks`. `decode` reports what tracing chose only (the sampler compiles inside its own jitted
calls), and `newton_schulz` the custom calls of its program.

Guards: the sections run in a worker process (`--worker`) that reports each one as it starts and ends;
this process never initialises a backend (the worker owns the card). A section gets at most its guard
(`GUARD_S`, or --guard_s for all) and never runs past --budget_s (default 420) from the start; one that
overruns (a compile or a kernel that hangs) is stopped by killing the worker, recorded as stopped, and a
fresh worker runs the sections after it. A worker that dies in a section (out of memory, a crash) costs
that section alike. No section starts after --budget_s, and the JSON is rewritten after every section,
so a run cut off from outside keeps what finished.

--dry_run swaps in tiny widths (d 64, 4 experts, vocab 256, 2 × 32 tokens, a 2-layer step) so CPU
finishes in seconds; sections needing a GPU kernel (cudnn, tokamax) record their error there.
tests/test_device_check.py runs it, and checks the guard on a stand-in worker that hangs and crashes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.util
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from composer_jax import backend, configs, model, optim, sharding, train  # noqa: E402
from composer_jax.optim import newton_schulz  # noqa: E402
from composer_jax.plan.compile import model_flops  # noqa: E402
from composer_jax.rl import sampler as rl_sampler  # noqa: E402
from composer_jax.train import losses  # noqa: E402
from composer_jax.train import step as step_lib  # noqa: E402
from composer_jax.train.batch import TokenBatch, place  # noqa: E402

# bf16 dense FLOP/s (no sparsity) by device_kind substring: NVIDIA H100 / H200 SXM data sheets.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
# Gpu shapes: (batch, seq) of the train and step sections, decode (batch, prompt, new tokens), NS stack.
GPU = {"batch": 4, "seq": 2048, "step_layers": 4, "decode": (32, 128, 128), "ns": (16, 2048, 7168)}
DRY = {"batch": 2, "seq": 32, "step_layers": 2, "decode": (2, 8, 8), "ns": (2, 16, 56)}
TINY_WIDTHS = dict(
  vocab_size=256, d_model=64, n_heads=2, dense_mlp_dim=128, moe_mlp_dim=32, n_experts=4, top_k=2,
  n_shared_experts=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
)  # fmt: skip
PAIRS = tuple(f"{a}+{e}" for a in ("xla", "cudnn") for e in ("ragged", "tokamax"))
SECTIONS = (*(f"train:{p}" for p in PAIRS), "step", "attention_parity", "newton_schulz", "decode")
# Seconds a section may run (compile included) before it is stopped; a section not named: `GUARD_S[None]`.
GUARD_S = {"step": 240.0, "newton_schulz": 60.0, "attention_parity": 90.0, None: 120.0}
WORKER_START_S = 180.0  # the worker's own start (jax, the card, the 2-layer model's parameters)
# Custom-call targets (prefixes) that show a fused kernel in a compiled program, by the name the model
# code gives the kernel (`attention_impl` / `expert_impl`); the XLA path that runs when it is absent.
FUSED_CALLS = {
  "cudnn": ("__cudnn$fmha",),
  "splash": ("tpu_custom_call",),
  "tokamax": ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu", "tpu_custom_call"),
}
FALLBACK = {"cudnn": "xla", "splash": "xla", "tokamax": "ragged"}
_MARK = "@device_check "  # the worker's report lines on its stdout: _MARK + JSON


# ----------------------------------------------------------------------------------------------------
# Kernels


def custom_calls(hlo_text: str) -> list[str]:
  """The custom-call targets of an HLO module's text, sorted, each once."""
  return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def kernels_ran(requested: dict, traced: dict, calls: list[str] | None) -> dict:
  """{"attention": ..., "experts": ..., "fallbacks": [...], "custom_calls": [...]}: the kernels that ran.

  `requested`: the config's `attention_impl` / `expert_impl`; `traced`: what `backend.record_kernels`
  saw while the program was traced; `calls`: the compiled program's custom calls (None: not inspected,
  tracing's word is taken). A fused kernel counts only with its call in the program (`FUSED_CALLS`);
  without it, or when tracing chose another kernel than the one named, the path that ran is reported and
  the fallback said."""
  out: dict = {"fallbacks": []}
  for kind, name in (("attention_impl", "attention"), ("expert_impl", "experts")):
    asked, picked = requested.get(kind), sorted(traced.get(kind, ()))
    ran = []
    for impl in picked:
      if (
        calls is not None and impl in FUSED_CALLS and not any(c.startswith(FUSED_CALLS[impl]) for c in calls)
      ):
        ran.append(FALLBACK[impl])
        out["fallbacks"].append(f"{name}: {impl} traced, but no {impl} call in the compiled program")
      else:
        ran.append(impl)
    if asked not in (None, "auto") and picked and asked not in picked:
      out["fallbacks"].append(f"{name}: {asked} asked, {'/'.join(picked)} traced")
    out[name] = "/".join(ran) or None
  out["custom_calls"] = calls
  return out


def _compile(jitted, args: tuple, requested: dict) -> tuple:
  """(compiled, seconds to lower and compile, `kernels_ran` of the compiled program)."""
  start = time.perf_counter()
  with backend.record_kernels() as traced:
    lowered = jitted.lower(*args)
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  return compiled, seconds, kernels_ran(requested, traced, custom_calls(compiled.as_text()))


# ----------------------------------------------------------------------------------------------------
# Sections (in the worker)


def _variant(name: str) -> configs.Config:
  path = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "composer25.py"
  )
  spec = importlib.util.spec_from_file_location("composer25", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return getattr(module, name)()


def moonlight_2_layers(dry_run: bool) -> model.ModelConfig:
  """experiments/composer25.py:moonlight_16b's model with 2 layers (tiny widths for --dry_run)."""
  cfg = _variant("moonlight_16b").model
  cfg = dataclasses.replace(cfg, n_layers=2, remat="none", scan_layers=False)
  return dataclasses.replace(cfg, **TINY_WIDTHS) if dry_run else cfg


def moonlight_step_model(dry_run: bool, layers: int) -> model.ModelConfig:
  """moonlight_16b's model as the variant computes it (scanned, remat, its kernels), cut to `layers`."""
  cfg = dataclasses.replace(_variant("moonlight_16b").model, n_layers=layers)
  return dataclasses.replace(cfg, **TINY_WIDTHS) if dry_run else cfg


def _timed(fn, steps: int) -> tuple[float, float]:
  """(seconds of the first call, median seconds of `steps` further calls)."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - start
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return first, statistics.median(times)


def _batch(cfg: model.ModelConfig, batch: int, seq: int) -> jax.Array:
  return jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)


def _grad_fn(cfg: model.ModelConfig):
  def loss(params, tokens):
    logits, _ = model.apply(params, cfg, tokens)
    total, count = losses.next_token_loss(logits, tokens, jnp.ones_like(tokens))
    return total / count

  return jax.jit(jax.value_and_grad(loss))


def _rate(fn, steps: int, n_tokens: int, flops: float, peak: float | None) -> dict:
  first, seconds = _timed(fn, steps)
  mfu = flops / seconds / peak if peak else None
  return {"first_call_s": first, "step_s": seconds, "tokens_per_s": n_tokens / seconds, "mfu": mfu}


class Worker:
  """The sections' shared state: shapes, the card's peak, the 2-layer model and its compiled steps."""

  def __init__(self, dry_run: bool, steps: int):
    self.dry_run, self.steps = dry_run, steps
    self.shapes = DRY if dry_run else GPU
    device = jax.devices()[0]
    self.peak = next((v for k, v in PEAK_FLOPS.items() if k in device.device_kind), None)
    self.info = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__}
    self.info |= {"peak_flops": self.peak}
    self._compiled: dict = {}

  @functools.cached_property
  def cfg(self) -> model.ModelConfig:
    return moonlight_2_layers(self.dry_run)

  @functools.cached_property
  def params(self):
    return model.init(self.cfg, jax.random.key(0))

  @functools.cached_property
  def tokens(self) -> jax.Array:
    return _batch(self.cfg, self.shapes["batch"], self.shapes["seq"])

  def grad_step(self, attention: str, experts: str) -> tuple:
    """The compiled forward + backward with these kernels (compiled once: parity reuses train's)."""
    key = (attention, experts)
    if key not in self._compiled:
      cfg = dataclasses.replace(self.cfg, attention_impl=attention, expert_impl=experts)
      asked = {"attention_impl": attention, "expert_impl": experts}
      self._compiled[key] = _compile(_grad_fn(cfg), (self.params, self.tokens), asked)
    return self._compiled[key]

  def run(self, name: str) -> dict:
    if name.startswith("train:"):
      return self.train(*name.split(":", 1)[1].split("+"))
    return getattr(self, name)()  # step, attention_parity, newton_schulz, decode

  def train(self, attention: str, experts: str) -> dict:
    """tokens/s and MFU of forward + backward with one (attention, experts) pair."""
    compiled, compile_s, kernels = self.grad_step(attention, experts)
    flops = model_flops(self.cfg, self.shapes["batch"], self.shapes["seq"])
    figures = _rate(
      lambda: compiled(self.params, self.tokens), self.steps, self.tokens.size, flops, self.peak
    )
    return {"compile_s": compile_s} | figures | {"kernels": kernels}

  def step(self) -> dict:
    """The pretraining step (`make_step`, sharded Muon + AdamW) of the variant's scanned, rematerialised
    model cut to `step_layers` layers, on a one-device mesh: tokens/s, MFU and XLA's memory."""
    variant = _variant("moonlight_16b")
    cfg = moonlight_step_model(self.dry_run, self.shapes["step_layers"])
    ocfg = configs.pretrain_optimizer(variant)  # the variant's optimizer over its schedule
    meshes = sharding.build_meshes((1, 1, 1), (1, 1), jax.devices()[:1])
    tx = optim.build_optimizer(cfg, ocfg, meshes)
    state = train.create_state(cfg, tx, jax.random.key(0), meshes)
    B, T = self.shapes["batch"], self.shapes["seq"]
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    tokens = np.asarray(_batch(cfg, B, T))
    batch = place(TokenBatch(tokens, positions.copy(), np.ones((B, T), np.int32)), meshes)
    step = step_lib.make_step(
      step_lib.next_token_loss(cfg, meshes), tx, cfg, schedule=optim.lr_schedule(ocfg), meshes=meshes,
      state_sharding=train.state.state_shardings(state), router_bias_rate=variant.train.router_bias_rate,
      qk_clip_tau=ocfg.qk_clip_tau,
    )  # fmt: skip
    asked = {"attention_impl": cfg.attention_impl, "expert_impl": cfg.expert_impl}
    compiled, compile_s, kernels = _compile(step, (state, batch), asked)
    kernels["auto"] = {
      "attention_impl": backend.attention_impl("auto", meshes),
      "expert_impl": backend.expert_impl("auto", meshes),
    }
    held = [state]

    def one():
      held[0], metrics = compiled(held[0], batch)
      return held[0].step, metrics["loss"]

    figures = _rate(one, self.steps, B * T, model_flops(cfg, B, T), self.peak)
    mem = compiled.memory_analysis()
    gib = {k: getattr(mem, f"{k}_size_in_bytes", None) for k in ("argument", "output", "alias", "temp")}
    shape = {"layers": cfg.n_layers, "scan_layers": cfg.scan_layers, "remat": cfg.remat, "batch": B, "seq": T}
    loss = float(jax.device_get(one()[1]))
    return (
      {"model": shape, "compile_s": compile_s}
      | figures
      | {
        "loss": loss,
        "memory_gib": {k: v / 2**30 for k, v in gib.items() if v is not None},
        "kernels": kernels,
      }
    )

  def attention_parity(self) -> dict:
    """cudnn vs xla attention: logits and gradients, max |Δ| ÷ max |xla|."""
    results, kernels = {}, None
    for impl in ("xla", "cudnn"):
      cfg = dataclasses.replace(self.cfg, attention_impl=impl, expert_impl="ragged")
      logits = jax.jit(lambda p, t, c=cfg: model.apply(p, c, t)[0])(self.params, self.tokens)
      compiled, _, kernels = self.grad_step(impl, "ragged")
      _, grads = compiled(self.params, self.tokens)
      results[impl] = (
        np.asarray(logits, np.float32),
        [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)],
      )
    (lx, gx), (lc, gc) = results["xla"], results["cudnn"]
    rel = lambda a, b: float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))  # noqa: E731
    return {
      "logits_rel_err": rel(lx, lc),
      "grads_rel_err_max": max(rel(a, b) for a, b in zip(gx, gc, strict=True)),
      "kernels": kernels,  # of the cudnn side's gradient step: a fallback would compare xla with xla
    }

  def newton_schulz(self) -> dict:
    """Newton–Schulz on a [N, M, K] bf16 stack of expert matrices: TFLOP/s and the fraction of peak."""
    n, m, k = shape = self.shapes["ns"]
    coeffs, scale = newton_schulz.coefficients("quintic", 5)
    x = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    compiled, compile_s, kernels = _compile(
      jax.jit(lambda x: newton_schulz.orthogonalize(x, coeffs, scale)), (x,), {}
    )
    first, seconds = _timed(lambda: compiled(x), self.steps)
    flops = n * newton_schulz.flops(m, k, 5)
    rate = {
      "tflop_per_s": flops / seconds / 1e12,
      "of_peak": flops / seconds / self.peak if self.peak else None,
    }
    out = {"shape": list(shape), "compile_s": compile_s, "first_call_s": first, "seconds": seconds} | rate
    return out | {"kernels": {"custom_calls": kernels["custom_calls"]}}

  def decode(self) -> dict:
    """Generated tokens/s of `rl.sampler.sample` (prefill + sampling loop), after one compile call."""
    batch, prompt, new = self.shapes["decode"]
    prompts = _batch(self.cfg, batch, prompt)
    lengths = jnp.full((batch,), prompt, jnp.int32)

    def rollout():
      out = rl_sampler.sample(self.params, self.cfg, prompts, lengths, jax.random.key(3), max_new_tokens=new)
      return out.tokens

    start = time.perf_counter()
    with backend.record_kernels() as traced:
      jax.block_until_ready(rollout())
    first = time.perf_counter() - start
    _, seconds = _timed(rollout, self.steps)
    asked = {"attention_impl": self.cfg.attention_impl, "expert_impl": self.cfg.expert_impl}
    return {
      "shape": [batch, prompt, new],
      "first_call_s": first,
      "seconds": seconds,
      "tokens_per_s": batch * new / seconds,
      "kernels": kernels_ran(asked, traced, None),
    }


def _section(fn) -> dict:
  try:
    return fn()
  except Exception as e:  # noqa: BLE001  (a kernel missing on this platform is a result, not a crash)
    return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
            "where": traceback.format_exc().strip().splitlines()[-3][:200]}  # fmt: skip


def _say(kind: str, **fields) -> None:
  print(_MARK + json.dumps({"kind": kind, **fields}), flush=True)


def worker(sections: list[str], dry_run: bool, steps: int) -> None:
  """Runs `sections` in order, reporting each on stdout (`_MARK` lines) as it starts and ends."""
  w = Worker(dry_run, steps)
  _say("header", info=w.info)
  for name in sections:
    _say("start", section=name)
    _say("done", section=name, result=_section(lambda name=name: w.run(name)))


# ----------------------------------------------------------------------------------------------------
# Guards (in the supervising process: no backend here)


def _pump(stream, sink: queue.Queue, tail: collections.deque | None = None) -> None:
  for line in stream:
    if tail is None:
      sink.put(line)
    else:  # the worker's stderr: passed through, its last lines kept for the error of a dead worker
      sys.stderr.write(line)
      tail.append(line.strip())
  if tail is None:
    sink.put(None)


def _stop(proc: subprocess.Popen) -> None:
  """Kills the worker and whatever it started (its own process group)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def supervise(
  sections: list[str],
  command: Callable[[list[str]], list[str]],
  on_result: Callable[[str, dict], None],
  guard_s: Callable[[str], float],
  budget_s: float,
  on_header: Callable[[dict], None] = lambda info: None,
  start_s: float = WORKER_START_S,
  env: dict | None = None,
) -> None:
  """Runs `sections` in worker processes (`command(remaining sections)` → argv) under wall-clock guards.

  Each section gets `guard_s(name)` seconds from its start, never past `budget_s` from now; a worker that
  overruns is killed with its process group, the section recorded as stopped, and a fresh worker runs the
  rest. A section the worker dies in is recorded with the worker's exit status and last stderr line;
  sections left when the budget is spent, or after a worker that never started, are recorded skipped."""
  end = time.perf_counter() + budget_s
  remaining = list(sections)
  while remaining:
    if time.perf_counter() >= end:
      for name in remaining:
        on_result(name, {"error": "skipped: past --budget_s"})
      return
    proc = subprocess.Popen(
      command(remaining), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
      start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    tail: collections.deque = collections.deque(maxlen=5)
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    threading.Thread(target=_pump, args=(proc.stderr, lines, tail), daemon=True).start()
    current, started, section_start = None, False, 0.0
    deadline = min(end, time.perf_counter() + start_s)
    while True:
      try:
        line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
      except queue.Empty:
        _stop(proc)
        if current is None:  # the worker did not start (or hung between sections): nothing left will
          why = "the worker did not start" if not started else "the worker hung between sections"
          for name in remaining:
            on_result(name, {"error": f"skipped: {why} within {start_s:.0f} s"})
          return
        waited = time.perf_counter() - section_start
        on_result(current, {"error": f"stopped: over its guard ({waited:.0f} s)", "stopped_after_s": waited})
        remaining.remove(current)
        break
      if line is None:  # the worker's stdout closed: it ended
        rc = proc.wait()
        if current is not None:
          last = next((t for t in reversed(tail) if t), "")
          on_result(current, {"error": f"the worker exited (status {rc}) in this section: {last[:300]}"})
          remaining.remove(current)
        elif remaining and not started:
          for name in remaining:
            on_result(name, {"error": f"skipped: the worker exited (status {rc}) before any section"})
          return
        break
      if not line.startswith(_MARK):
        sys.stdout.write(line)
        continue
      event = json.loads(line[len(_MARK) :])
      if event["kind"] == "header":
        on_header(event["info"])
      elif event["kind"] == "start":
        started, current, section_start = True, event["section"], time.perf_counter()
        if section_start >= end:
          _stop(proc)
          for name in remaining:
            on_result(name, {"error": "skipped: past --budget_s"})
          return
        deadline = min(end, section_start + guard_s(current))
      elif event["kind"] == "done":
        on_result(event["section"], event["result"])
        remaining.remove(event["section"])
        current, deadline = None, min(end, time.perf_counter() + start_s)


def _worker_env() -> dict:
  """This process's environment, plus the persistent compilation cache jax is configured with here (the
  test suite's), so that a worker reuses compiled programs too."""
  env = dict(os.environ)
  for name in (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
  ):
    value = getattr(jax.config, name, None)
    if value is not None and name.upper() not in env:
      env[name.upper()] = str(value)
  return env


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", help="the JSON to write (required unless --worker)")
  p.add_argument("--dry_run", action="store_true", help="tiny shapes on any backend (CPU: seconds)")
  p.add_argument("--steps", type=int, default=None, help="timed calls per figure (default 5; dry run 1)")
  p.add_argument("--budget_s", type=float, default=420.0, help="no section runs past this many seconds")
  p.add_argument("--guard_s", type=float, default=None, help="every section's guard (default: GUARD_S)")
  p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of SECTIONS")
  p.add_argument("--worker", action="store_true", help="run the sections here (what the supervisor starts)")
  args = p.parse_args(argv)
  steps = args.steps or (1 if args.dry_run else 5)
  names = [s for s in args.sections.split(",") if s]
  unknown = sorted(set(names) - set(SECTIONS))
  if unknown:
    p.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
  if args.worker:
    worker(names, args.dry_run, steps)
    return {}
  if not args.out:
    p.error("--out is required")
  shapes = DRY if args.dry_run else GPU
  result: dict = {"dry_run": args.dry_run}
  result["shapes"] = {k: list(v) if isinstance(v, tuple) else v for k, v in shapes.items()}
  t0 = time.perf_counter()

  def write() -> None:
    result["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)

  def on_result(name: str, figures: dict) -> None:
    if name.startswith("train:"):
      result.setdefault("train", {})[name.split(":", 1)[1]] = figures
    else:
      result[name] = figures
    print(f"[device_check] {name}: {json.dumps(figures)[:400]}", file=sys.stderr, flush=True)
    write()

  me = os.path.abspath(__file__)
  extra = ["--dry_run"] * args.dry_run + [f"--steps={steps}"]
  supervise(
    names,
    lambda rest: [sys.executable, me, "--worker", f"--sections={','.join(rest)}", *extra],
    on_result,
    lambda name: args.guard_s or GUARD_S.get(name, GUARD_S[None]),
    args.budget_s,
    on_header=result.update,
    env=_worker_env(),
  )
  write()
  print(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
