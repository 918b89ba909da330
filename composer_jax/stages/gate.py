"""Stage `gate`: the precondition of targeted text feedback, measured on the SFT checkpoint before RL.

  <workdir>/gate.json: G1..G5 with their numbers, 95 % CIs and why each passed or failed (`rl.gate`)

On ≥ `gate.min_flagged` flagged turns, each resampled `gate.samples` times: the hinted teacher must make
the turn valid more often than the student (G1), a neutral note must not (G2), a wrong hint must hurt
(G3), the teacher must lower the mistake's token and not the valid prefix (G4), and the mistake must cost
reward on a fair share of rollouts (G5). The summary says which gate failed and why; a failed gate stops the
run before stage `rl` (`pipeline`), which would distil a teacher shown not to help, unless
`gate.required=False` (then rl runs and its summary says the gate failed).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from absl import logging

from composer_jax import sharding
from composer_jax.configs import Config
from composer_jax.stages import sft, weights
from composer_jax.stages.record import Stage


def run(config: Config, workdir: str) -> dict[str, Any]:
  from composer_jax.rl import chat, gate

  meshes = sharding.make_meshes(config)
  params, source = weights.starting_params(config, workdir, "sft", meshes)
  logging.info("[gate] weights from %s", source)
  tok = chat.tokenizer(config.data.tokenizer)
  report = gate.run(params, config.model, config.rl, config.gate, tok, meshes) | {"init": source}
  failed = [k for k, g in report.get("gates", {}).items() if not g["pass"]]
  logging.info("[gate] %s", "all gates pass" if report["passed"] else f"FAILED: {', '.join(failed) or 'all'}")
  pathlib.Path(workdir, "gate.json").write_text(json.dumps(report, indent=1))
  return report


def _summarize(s: dict, w: pathlib.Path) -> dict:
  keep = ("passed", "flagged", "rollouts", "samples", "valid_rate", "gates", "why")
  return {k: s[k] for k in keep if k in s} | {"report": str(w / "gate.json")}


def _lines(r: dict) -> list[str]:
  v = r.get("valid_rate", {})
  lines = [
    f"  {r.get('flagged')} flagged turns of {r.get('rollouts')} rollouts x {r.get('samples')} samples; valid "
    "rate " + ", ".join(f"{c} {x:.3f}" for c, x in v.items()) + f": {'PASS' if r.get('passed') else 'FAIL'}"
  ]
  lines += [f"  {k} {'pass' if g['pass'] else 'FAIL'}: {g['why']}" for k, g in r.get("gates", {}).items()]
  if "why" in r:
    lines.append(f"  {r['why']}")
  return lines + [f"  report {r.get('report')}"]


STAGE = Stage(
  name="gate",
  run=run,
  doc="does the hinted teacher beat the student on flagged turns? (G1-G5, on the SFT checkpoint, before RL)",
  depends=("seed", "model", "gate", "rl", "data.tokenizer", "init_from"),
  ignores=("gate.required",),  # what to do after a failure, not an input of the verdict
  outputs=("gate.json",),
  upstream=lambda config: ("sft",),
  check=sft.check_chat,
  summarize=_summarize,
  lines=_lines,
)
