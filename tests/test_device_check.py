"""benchmarks/device_check.py --dry_run: the GPU device check stays runnable (tiny shapes on CPU), says which
kernel each section ran, and stops a section that overruns its guard.

Sections needing a GPU kernel (cuDNN attention, tokamax's grouped matmul) record their error on CPU;
the xla + ragged train step, the scanned step with the optimizer, Newton–Schulz and the sampler must
produce figures. The compiles hit the suite's persistent cache after the first run (the worker process is
given the same cache).
"""

from __future__ import annotations

import json
import sys
import time

import tiny


def _module():
  return tiny.load_script("benchmarks/device_check.py")


def test_device_check_dry_run_writes_every_section(tmp_path):
  out = tmp_path / "device_check.json"
  result = _module().main(["--dry_run", f"--out={out}"])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  assert result["dry_run"] is True and result["platform"] == "cpu"
  assert set(result["train"]) == {"xla+ragged", "xla+tokamax", "cudnn+ragged", "cudnn+tokamax"}
  for name, figures in result["train"].items():
    assert ("tokens_per_s" in figures) != ("error" in figures), (name, figures)
  base = result["train"]["xla+ragged"]
  assert base["tokens_per_s"] > 0 and base["step_s"] > 0, base
  assert (base["kernels"]["attention"], base["kernels"]["experts"], base["kernels"]["fallbacks"]) == (
    "xla",
    "ragged",
    [],
  )
  assert "error" in result["train"]["cudnn+ragged"]  # no cuDNN on a CPU host: recorded, not raised
  step = result["step"]
  assert step["tokens_per_s"] > 0 and step["model"] == {
    "layers": 2,
    "scan_layers": True,
    "remat": "full",
    "batch": 2,
    "seq": 32,
  }
  # The variant's kernels: attention "auto" (xla on CPU), experts "ragged" as moonlight_16b names them.
  assert (step["kernels"]["attention"], step["kernels"]["experts"]) == ("xla", "ragged"), step["kernels"]
  assert step["memory_gib"]["temp"] > 0 and step["loss"] > 0
  parity = result["attention_parity"]
  assert "error" in parity or parity["logits_rel_err"] < 0.05, parity
  ns = result["newton_schulz"]
  assert ns["shape"] == [2, 16, 56] and ns["tflop_per_s"] > 0 and "custom_calls" in ns["kernels"], ns
  decode = result["decode"]
  assert decode["tokens_per_s"] > 0 and decode["shape"] == [2, 8, 8], decode
  assert decode["kernels"]["attention"] == "absorbed", decode


def test_a_fused_kernel_missing_from_the_program_is_a_fallback():
  """What tracing chose counts only with its custom call in the compiled program."""
  dc = _module()
  asked = {"attention_impl": "cudnn", "expert_impl": "tokamax"}
  traced = {"attention_impl": {"cudnn"}, "expert_impl": {"tokamax"}}
  hlo = 'custom-call(%q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={}\n'
  hlo += 'custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", backend_config={}\n'
  ran = dc.kernels_ran(asked, traced, dc.custom_calls(hlo))
  assert (ran["attention"], ran["experts"], ran["fallbacks"]) == ("cudnn", "tokamax", [])
  no_triton = dc.custom_calls(hlo.splitlines()[0] + 'custom_call_target="__cublas$gemm"')
  ran = dc.kernels_ran(asked, traced, no_triton)
  assert (ran["attention"], ran["experts"]) == ("cudnn", "ragged")
  assert ran["fallbacks"] == ["experts: tokamax traced, but no tokamax call in the compiled program"]
  ran = dc.kernels_ran(asked, {"attention_impl": {"cudnn"}, "expert_impl": {"ragged"}}, dc.custom_calls(hlo))
  assert ran["experts"] == "ragged" and ran["fallbacks"] == ["experts: tokamax asked, ragged traced"]


# A stand-in worker speaking the device check's protocol: section "hang" never ends, "crash" exits 3.
_FAKE_WORKER = """
import json, sys, time
say = lambda **k: print("@device_check " + json.dumps(k), flush=True)
say(kind="header", info={"device": "fake"})
for name in sys.argv[1].split(","):
  say(kind="start", section=name)
  if name == "hang":
    time.sleep(120)
  if name == "crash":
    print("out of memory", file=sys.stderr, flush=True)
    sys.exit(3)
  say(kind="done", section=name, result={"ran": name})
"""


def test_a_section_past_its_guard_is_stopped_and_the_rest_still_run():
  dc = _module()
  results, header = {}, {}
  start = time.perf_counter()
  dc.supervise(
    ["a", "hang", "b", "crash", "c"],
    lambda rest: [sys.executable, "-c", _FAKE_WORKER, ",".join(rest)],
    results.__setitem__,
    lambda name: 1.0,
    budget_s=60.0,
    on_header=header.update,
  )
  assert time.perf_counter() - start < 30  # the hanging section did not run its 120 s
  assert header == {"device": "fake"}
  assert results["a"] == {"ran": "a"} and results["b"] == {"ran": "b"} and results["c"] == {"ran": "c"}
  assert results["hang"]["error"].startswith("stopped: over its guard"), results["hang"]
  assert results["crash"]["error"] == "the worker exited (status 3) in this section: out of memory"
  skipped: dict = {}
  dc.supervise(["a", "b"], lambda rest: [sys.executable, "-c", _FAKE_WORKER, ",".join(rest)],
               skipped.__setitem__, lambda name: 1.0, budget_s=0.0)  # fmt: skip
  assert skipped == {n: {"error": "skipped: past --budget_s"} for n in ("a", "b")}
