"""Rollout tokens/s: the KV-cache sampler vs naive full recompute, same model, same sampling, CPU.

  python benchmarks/sampler.py                                     # benchmark shape (Tunix's rollout shape)
  python benchmarks/sampler.py --out benchmarks/RESULTS.md         # append a dated section
  python benchmarks/sampler.py --tiny --new 16 --rounds 1          # smoke test, seconds
  python benchmarks/sampler.py --tunix_python <tunix venv>/bin/python --no_naive   # ours vs Tunix

Model: `model_step.BENCH` (d_model 256, 4 layers, 8 heads, MLA no q-LoRA, 8 experts top-2 + 1
shared, vocab 1024, fp32), random init. Rollout: 8 sequences, right-padded prompts of 17–32
tokens, 224 new tokens each, temperature 0.9, top-k 50 (a Tunix rollout's shape); no
stop tokens, so every row generates all 224 and tokens/s = 8 · 224 / wall time of the call,
prefill included.

Sides:
- **kv cache**: `rl.sampler.sample` — one prefill, then a compiled `while_loop`, one token per step.
- **naive**: the same `select` (same keys, so the same tokens up to float noise) on logits from a
  full forward over a fixed [B, P + N] buffer for every new token. Also one compiled loop, so the
  ratio measures the cache, not Python dispatch. The buffer has a fixed width (one compile); its
  not-yet-written columns are invisible to earlier ones by causality.
- **Tunix** (with `--tunix_python`, a venv with `pip install google-tunix`): Tunix's KV-cache
  `Sampler` on its own Qwen3-MoE (`tunix.models.qwen3`), random init, fp32, the same layers,
  d_model, heads, vocab, experts/top-k and expert width, head_dim = our v_head_dim; GQA with as
  many KV heads as heads instead of MLA, and no shared expert (Qwen3-MoE has none). Same prompts
  (token ids; Tunix left-pads them), same N, temperature, top-k 50, no stop. It runs in a
  long-lived subprocess (`_tunix_sampler.py`) that compiles once and then times one
  `Sampler.__call__` per round on request. On CPU its MoE runs every expert densely on every
  token (a one-hot dispatch), so it does 4× the routed-expert FLOPs of top-2.
Rounds alternate sides; the table reports the median round. One CPU device each.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from machine import describe as machine  # noqa: E402
from model_step import BENCH  # noqa: E402

from composer_jax import model  # noqa: E402
from composer_jax.rl import sampler  # noqa: E402

TINY = dataclasses.replace(
  BENCH, vocab_size=128, d_model=64, n_layers=2, n_heads=2, dense_mlp_dim=128, moe_mlp_dim=64,
  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens"))
def naive_sample(params, cfg, prompts_BP, lengths_B, keys_B, temperature, top_k, top_p, *, max_new_tokens):
  """Sampling by re-running the whole prefix each step (no cache): the baseline."""
  B, P = prompts_BP.shape
  N = max_new_tokens
  real_BP = jnp.arange(P)[None, :] < lengths_B[:, None]
  buf_BT = jnp.pad(jnp.where(real_BP, prompts_BP, 0), ((0, 0), (0, N)))
  rows_B = jnp.arange(B)
  u_BN = jax.vmap(lambda k: jax.random.uniform(k, (N,)))(keys_B)  # as `sampler.decode` draws them

  def step(t, carry):
    buf_BT, out_BN = carry
    logits_BTV, _ = model.apply(params, cfg, buf_BT)
    logits_BV = logits_BTV[rows_B, lengths_B + t - 1]
    token_B, _, _ = sampler.select_uniform(logits_BV, u_BN[:, t], temperature, top_k, top_p)
    return buf_BT.at[rows_B, lengths_B + t].set(token_B), out_BN.at[:, t].set(token_B)

  _, out_BN = jax.lax.fori_loop(0, N, step, (buf_BT, jnp.zeros((B, N), jnp.int32)))
  return out_BN


# ---------------------------------------------------------------------------------------------------
# Tunix, in its own venv


def _tunix_env() -> dict:
  """The environment for the Tunix interpreter: its own venv, one real CPU device."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  return env


class _SideProcess:
  """A benchmark side in its own process: one JSON line when it is ready, one per `run` it is sent."""

  name = "side"
  proc: subprocess.Popen
  info: dict | None = None

  def _reply(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"{self.name} exited ({self.proc.wait()}); its stderr is above")
    return json.loads(line)

  def _check(self, reply: dict) -> None:
    """Raises when a reply shows the side did other work than asked (none by default)."""

  def wait_ready(self) -> dict:
    if self.info is None:
      self.info = self._reply()
      self._check(self.info)
    return self.info

  def __call__(self) -> tuple[float, float]:
    """(wall, CPU) seconds of one rollout, timed inside the side's process."""
    self.wait_ready()
    self.proc.stdin.write("run\n")
    self.proc.stdin.flush()
    reply = self._reply()
    self._check(reply)
    return reply["seconds"], reply["cpu_seconds"]

  def close(self):
    if self.proc.poll() is None:
      self.proc.stdin.write("quit\n")
      self.proc.stdin.close()
      self.proc.wait(timeout=60)


class TunixSide(_SideProcess):
  """`_tunix_sampler.py` under `python`: started (and compiling) at once, one rollout per `__call__`."""

  name = "Tunix side"

  def __init__(self, python: str, cfg: model.ModelConfig, prompts: list[list[int]], args):
    spec = {
      "shape": {
        "n_layers": cfg.n_layers,
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "moe_mlp_dim": cfg.moe_mlp_dim,
        "n_heads": cfg.n_heads,
        "head_dim": cfg.v_head_dim,
        "rope_theta": cfg.rope.theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "n_experts": cfg.n_experts,
        "top_k": cfg.top_k,
      },
      "seed": 0,
      "prompts": prompts,
      "new_tokens": args.new,
      "temperature": args.temperature,
      "top_k": args.top_k,
    }
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tunix_sampler.py")
    self.start = time.perf_counter()
    self.proc = subprocess.Popen(
      [python, script, json.dumps(spec)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=_tunix_env(),
    )
    self.info: dict | None = None
    self.new_tokens = args.new

  def wait_ready(self) -> dict:
    if self.info is None:
      super().wait_ready()
      self.info["startup_s"] = time.perf_counter() - self.start
    return self.info

  def _check(self, reply: dict):
    if any(n != self.new_tokens for n in reply["new_tokens"]):
      raise RuntimeError(f"Tunix generated {reply['new_tokens']} tokens per row, expected {self.new_tokens}")


class BaselineSide(_SideProcess):
  """Our sampler from another source tree (`_ours_sampler.py` with PYTHONPATH=<tree>), in a subprocess,
  e.g. the previous commit (`git archive <commit> | tar -x -C <dir>`): before and after in one run."""

  name = "baseline side"

  def __init__(self, src: str, prompts_BP, lengths_B, args):
    spec = {
      "prompts": np.asarray(prompts_BP).tolist(),
      "lengths": np.asarray(lengths_B).tolist(),
      "new_tokens": args.new,
      "temperature": args.temperature,
      "top_k": args.top_k,
      "tiny": args.tiny,
    }
    env = _tunix_env() | {"PYTHONPATH": os.path.abspath(src)}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ours_sampler.py")
    self.proc = subprocess.Popen(
      [sys.executable, script, json.dumps(spec)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=env,
    )
    self.info = None


def param_counts(params) -> tuple[int, int]:
  """Total parameters, and those one token uses (routed experts counted top_k of n_experts).

  The same convention as `_tunix_sampler.count_params`: embedding and LM head both included.
  """
  total = routed = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    n = math.prod(leaf.shape)
    total += n
    if getattr(path[-1], "key", None) in ("w_gate", "w_up", "w_down"):
      routed += n
  return total, routed


def public_command(argv: list[str]) -> str:
  """The command line without this machine's paths (the Tunix interpreter becomes a placeholder)."""
  out = []
  for i, a in enumerate(argv):
    flag, eq, _ = a.partition("=")
    if eq and flag == "--tunix_python":
      a = "--tunix_python=<tunix venv>/bin/python"
    elif i and argv[i - 1] == "--tunix_python":
      a = "<tunix venv>/bin/python"
    elif eq and flag == "--baseline_src" or i and argv[i - 1] == "--baseline_src":
      a = a.replace(a.partition("=")[2] if eq else a, "<previous commit's tree>")
    elif i and argv[i - 1] == "--out" and os.path.isabs(a):
      a = os.path.basename(a)
    out.append(a)
  return "python benchmarks/sampler.py " + " ".join(out)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=32, help="longest prompt; lengths spread over [P/2+1, P]")
  ap.add_argument("--new", type=int, default=224)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--temperature", type=float, default=0.9)
  ap.add_argument("--top_k", type=int, default=50)
  ap.add_argument("--tiny", action="store_true", help="a small model, for a quick correctness run")
  ap.add_argument("--no_naive", action="store_true", help="skip the (slow) naive full-recompute side")
  ap.add_argument("--tunix_python", default=None, help="python of a venv with `pip install google-tunix`")
  ap.add_argument("--baseline_src", default=None, help="another source tree of ours, run side by side")
  ap.add_argument("--out", default=None, help="append a dated markdown section to this file")
  args = ap.parse_args()
  cfg = TINY if args.tiny else BENCH
  B, P, N = args.batch, args.prompt, args.new

  params = model.init(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  lengths_B = rng.integers(P // 2 + 1, P + 1, B).astype(np.int32)
  lengths_B[0] = P
  prompts_BP = np.where(np.arange(P)[None] < lengths_B[:, None], rng.integers(0, cfg.vocab_size, (B, P)), 0)
  prompts_BP, lengths_B = jnp.asarray(prompts_BP, jnp.int32), jnp.asarray(lengths_B)
  keys_B = jax.random.split(jax.random.key(1), B)
  temperature, top_k, top_p = jnp.float32(args.temperature), jnp.int32(args.top_k), jnp.float32(1.0)
  tunix = None
  if args.tunix_python:  # start it first: it compiles while we do
    real = [
      [int(t) for t in row[:n]] for row, n in zip(np.asarray(prompts_BP), np.asarray(lengths_B), strict=True)
    ]
    tunix = TunixSide(args.tunix_python, cfg, real, args)
  baseline = BaselineSide(args.baseline_src, prompts_BP, lengths_B, args) if args.baseline_src else None

  def kv():
    out = sampler.sample(
      params,
      cfg,
      prompts_BP,
      lengths_B,
      keys_B,
      max_new_tokens=N,
      temperature=args.temperature,
      top_k=args.top_k,
    )
    return jax.block_until_ready(out.tokens)

  def naive():
    out = naive_sample(
      params, cfg, prompts_BP, lengths_B, keys_B, temperature, top_k, top_p, max_new_tokens=N
    )
    return jax.block_until_ready(out)

  KV, NAIVE, TUNIX = "kv cache (rl.sampler)", "naive full recompute", "Tunix Sampler (Qwen3-MoE)"
  BASE = "kv cache, baseline tree"
  sides = {KV: kv} if args.no_naive else {KV: kv, NAIVE: naive}
  tokens = {}
  for name, fn in sides.items():
    start = time.perf_counter()
    tokens[name] = np.asarray(fn())
    print(f"{name}: first call (compile + run) {time.perf_counter() - start:.1f}s", flush=True)
  agree = None
  if NAIVE in tokens:
    a, b = tokens[KV], tokens[NAIVE]
    first_diff = np.argmax(np.concatenate([a != b, np.ones((B, 1), bool)], 1), 1)  # N: none
    agree = float(np.mean(first_diff)) / N
  if tunix is not None:
    info = tunix.wait_ready()
    print(
      f"{TUNIX}: ready after {info['startup_s']:.0f}s (first call, compile + run, "
      f"{info['compile_s']:.1f}s); {info['params']:,} params; {info['versions']}",
      flush=True,
    )
    sides[TUNIX] = tunix
  if baseline is not None:
    info = baseline.wait_ready()
    same = np.array_equal(np.asarray(info["tokens"]), tokens[KV])
    print(f"{BASE}: first call {info['compile_s']:.1f}s; same tokens as ours: {same}", flush=True)
    sides[BASE] = baseline
  times = {name: [] for name in sides}
  cpu = {name: [] for name in sides}
  loads = [os.getloadavg()[0]]
  for r in range(args.rounds):  # alternate sides every round
    for name, fn in sides.items():
      start, cpu_start = time.perf_counter(), time.process_time()
      out = fn()
      wall, used = (
        out if name in (TUNIX, BASE) else (time.perf_counter() - start, time.process_time() - cpu_start)
      )
      times[name].append(wall)
      cpu[name].append(used)
      loads.append(os.getloadavg()[0])
      print(
        f"round {r + 1}/{args.rounds} {name}: {wall:.2f}s, CPU {used:.2f}s (load {loads[-1]:.1f})", flush=True
      )
  for side in (tunix, baseline):
    if side is not None:
      side.close()

  med = {name: statistics.median(ts) for name, ts in times.items()}
  cmed = {name: statistics.median(ts) for name, ts in cpu.items()}
  head = "| side | s/rollout (median) | tok/s | CPU s/rollout |" + (" × naive |" if NAIVE in med else "")
  head += " rounds (s) |"
  lines = [head, "|---" * head.count(" |") + "|"]
  for name, ts in times.items():
    rounds = ", ".join(f"{t:.2f}" for t in ts)
    ratio = f" {med[NAIVE] / med[name]:.1f} |" if NAIVE in med else ""
    lines.append(
      f"| {name} | {med[name]:.2f} | {B * N / med[name]:.0f} | {cmed[name]:.2f} |{ratio} {rounds} |"
    )
  if agree is not None:
    lines.append(
      f"- same tokens on both sides: {agree:.1%} of each row before the first difference (float noise)"
    )
  if tunix is not None:
    ours_total, ours_routed = param_counts(params)
    ours_active = ours_total - ours_routed + ours_routed * cfg.top_k // cfg.n_experts
    lines.append(
      f"- ours ÷ Tunix tok/s = **{med[TUNIX] / med[KV]:.2f}** (by CPU time: {cmed[TUNIX] / cmed[KV]:.2f})"
    )
    if BASE in med:
      lines.append(
        f"- baseline tree ÷ Tunix tok/s = {med[TUNIX] / med[BASE]:.2f} "
        f"(by CPU time: {cmed[TUNIX] / cmed[BASE]:.2f})"
      )
    lines.append(
      f"- parameters (embedding and LM head included; active = routed experts counted {cfg.top_k} of "
      f"{cfg.n_experts}): ours {ours_total:,} total, {ours_active:,} active; Tunix "
      f"{tunix.info['params']:,} total, {tunix.info['active_params']:,} active "
      "(its CPU MoE computes all experts)"
    )
    lines.append(
      "- Tunix "
      + ", ".join(f"{k} {v}" for k, v in tunix.info["versions"].items())
      + f"; its first call (compile + run) {tunix.info['compile_s']:.0f}s"
    )
  if BASE in med:
    lines.append(
      f"- ours ÷ baseline tree tok/s = **{med[BASE] / med[KV]:.2f}** "
      f"(by CPU time: {cmed[BASE] / cmed[KV]:.2f})"
    )
  lines.append(
    f"- 1-min load average during the rounds: {min(loads):.1f}–{max(loads):.1f} ({os.cpu_count()} cores)"
  )
  table = "\n".join(lines)
  print("\n" + table)

  if args.out:
    shape = "tiny smoke model" if args.tiny else "benchmark shape (`model_step.BENCH`)"
    title = " vs ".join(
      ["KV cache"] + (["naive full recompute"] if NAIVE in med else []) + (["Tunix"] if tunix else [])
    )
    section = [
      f"\n## Sampler: {title} ({datetime.date.today().isoformat()})\n",
      f"- **Machine**: {machine()}; jax {jax.__version__}",
      f"- **Command**: `{public_command(sys.argv[1:])}`",
      f"- **Shape**: {shape}, fp32, `expert_impl={cfg.expert_impl}`; {B} sequences, prompts "
      f"{int(lengths_B.min())}–{P} tokens (right-padded), {N} new tokens each, "
      f"temperature {args.temperature}, top-k {args.top_k}, no stop tokens; "
      f"tokens/s = {B}·{N} / wall time of one rollout (prefill included); "
      f"{args.rounds} alternating rounds, median.",
      "",
      table,
      "",
    ]
    with open(args.out, "a") as f:
      f.write("\n".join(section))
    print(f"appended to {args.out}")


if __name__ == "__main__":
  main()
