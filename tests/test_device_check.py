"""benchmarks/device_check.py --dry_run: the GPU device check stays runnable (tiny shapes on CPU).

Sections needing a GPU kernel (cuDNN attention, tokamax's grouped matmul) record their error on CPU;
the xla + ragged train step, Newton–Schulz and the sampler must produce figures. The compiles hit the
suite's persistent cache after the first run.
"""

from __future__ import annotations

import json

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
  assert "error" in result["train"]["cudnn+ragged"]  # no cuDNN on a CPU host: recorded, not raised
  parity = result["attention_parity"]
  assert "error" in parity or parity["logits_rel_err"] < 0.05, parity
  ns = result["newton_schulz"]
  assert ns["shape"] == [2, 16, 56] and ns["tflop_per_s"] > 0, ns
  decode = result["decode"]
  assert decode["tokens_per_s"] > 0 and decode["shape"] == [2, 8, 8], decode
