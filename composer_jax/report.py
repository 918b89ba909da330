"""The end-of-run summary: the numbers that matter from each stage's summary, printed and kept.

  text = write(build(results, runs, workdir), workdir)   # also <workdir>/summary.json

`results` maps a stage to the summary dict it returned (or saved, when skipped); `runs` to
{seconds, skipped, finished}. RL curves are summarised as the mean over the first and the last k steps
(k = min(3, steps // 3), at least 1): single steps of a few dozen rollouts are noisy.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any


def build(results: dict[str, dict], runs: dict[str, dict], workdir: str) -> dict[str, Any]:
  """{workdir, stages: {stage: {seconds, skipped, ...its key numbers and paths}}, total_seconds}."""
  w = pathlib.Path(workdir).absolute()
  stages = {}
  for stage, summary in results.items():
    row = dict(runs.get(stage, {}))
    row |= _EXTRACT.get(stage, _scalars)(summary, w)
    stages[stage] = row
  ran = sum(run.get("seconds", 0.0) for run in runs.values() if not run.get("skipped"))
  return dict(workdir=str(w), stages=stages, seconds_this_run=ran, summary=str(w / "summary.json"))


def write(report: dict[str, Any], workdir: str) -> str:
  """Writes `<workdir>/summary.json` (process 0 of a multi-process run) and returns the printed text."""
  import jax

  if jax.process_index() == 0:
    pathlib.Path(workdir, "summary.json").write_text(json.dumps(report, indent=1))
  return text(report)


def window_means(values: Sequence[float]) -> tuple[float, float, int]:
  """(mean of the first k, mean of the last k, k) with k = max(1, min(3, len // 3))."""
  k = max(1, min(3, len(values) // 3))
  return sum(values[:k]) / k, sum(values[-k:]) / k, k


def _pretrain(s: dict, w: pathlib.Path) -> dict:
  keys = ("start_step", "steps", "first_train_loss", "last_train_loss", "first_validation_loss")
  keys += ("last_validation_loss", "tokens_per_s", "skipped_steps")
  return {k: s.get(k) for k in keys} | dict(
    checkpoints=str(w / "checkpoints"), metrics=str(w / "metrics" / "metrics.jsonl")
  )


def _synth(s: dict, w: pathlib.Path) -> dict:
  rows = s.get("sources", [])
  return dict(
    tasks=s.get("total_valid", 0),
    candidates=sum(r.get("candidates", 0) for r in rows),
    sources={
      r["name"]: dict(valid=r.get("valid"), candidates=r.get("candidates"), error=r.get("error"))
      for r in rows
    },
    tasks_dir=str(w / "synth_tasks"),
  )


def _sft(s: dict, w: pathlib.Path) -> dict:
  out = {k: s.get(k) for k in ("steps", "first_loss", "last_loss")}
  for name in ("sampled", "greedy"):
    ev = s.get(f"eval_{name}") or {}
    out[name] = {k: ev.get(k) for k in ("pass_rate", "invalid_call_rate", "turns_per_rollout")}
  return out | dict(checkpoints=str(w / "sft"), metrics=str(w / "sft_metrics" / "metrics.jsonl"))


def _arm(s: dict) -> dict:
  h = s.get("history") or []
  out: dict[str, Any] = dict(
    steps=s.get("steps"), lambda_feedback=s.get("lambda_feedback"), failed_steps=s.get("failed_steps")
  )
  if h:
    for key in ("reward", "pass_rate", "invalid_call_rate"):
      first, last, k = window_means([r.get(key, 0.0) for r in h])
      out[key] = dict(first=first, last=last)
    out["window"] = k
    for key in ("feedback_turns_per_rollout", "feedback_kl"):
      out[key] = sum(r.get(key, 0.0) for r in h) / len(h)
  evals = s.get("evals") or []
  if len(evals) > 1:  # the fixed problem set, before the first step and after the last evaluated one
    keep = ("step", "reward", "invalid_call_rate")
    out["eval"] = dict(first={k: evals[0].get(k) for k in keep}, last={k: evals[-1].get(k) for k in keep})
  return out | {k: s[k] for k in ("checkpoints", "metrics") if k in s}


def _rl(s: dict, w: pathlib.Path) -> dict:
  out = _arm(s)
  if s.get("without_feedback"):
    out["without_feedback"] = _arm(s["without_feedback"])
  return out


def _demo(s: dict, w: pathlib.Path) -> dict:
  return dict(loss=s.get("loss"), uniform_loss=s.get("uniform_loss"), file=str(w / "demo.json"))


def _scalars(s: dict, w: pathlib.Path) -> dict:
  """Numbers and one-line strings (a stage without its own extractor, e.g. plan)."""
  short = lambda v: isinstance(v, str) and len(v) <= 80 and "\n" not in v  # noqa: E731
  return {k: v for k, v in s.items() if isinstance(v, int | float | bool) or v is None or short(v)}


_EXTRACT = {"demo": _demo, "pretrain": _pretrain, "synth": _synth, "sft": _sft, "rl": _rl}


def _f(x: Any, fmt: str = ".3f") -> str:
  return "n/a" if x is None else format(x, fmt)


def _arm_line(a: dict) -> str:
  if "reward" not in a:
    return f"{a.get('steps')} steps, no step finished"
  ff = lambda key: f"{_f(a[key]['first'])} -> {_f(a[key]['last'])}"  # noqa: E731
  line = (
    f"reward {ff('reward')}, pass {ff('pass_rate')}, invalid-call rate {ff('invalid_call_rate')}, "
    f"feedback turns/rollout {_f(a['feedback_turns_per_rollout'], '.2f')}, "
    f"feedback KL {_f(a['feedback_kl'], '.4f')}"
  )
  if "eval" in a:
    e0, e1 = a["eval"]["first"], a["eval"]["last"]
    line += (
      f"; fixed problems, step {e0['step']} -> {e1['step']}: reward {_f(e0['reward'])} -> "
      f"{_f(e1['reward'])}, invalid-call rate {_f(e0['invalid_call_rate'])} -> {_f(e1['invalid_call_rate'])}"
    )
  return line


def text(report: dict[str, Any]) -> str:
  """The readable block printed at the end of a run."""
  lines = [f"===== summary: {report['workdir']} ====="]
  st = report["stages"]
  for stage, r in st.items():
    when = "skipped, finished " + r.get("finished", "?") if r.get("skipped") else "ran"
    lines.append(f"{stage} ({_f(r.get('seconds'), '.0f')} s, {when})")
    if stage == "demo":
      lines.append(f"  forward loss {_f(r['loss'])} vs uniform {_f(r['uniform_loss'])}")
    elif stage == "pretrain":
      lines.append(
        f"  steps {r['start_step']}->{r['steps']}: train loss {_f(r['first_train_loss'])} -> "
        f"{_f(r['last_train_loss'])}, validation {_f(r['first_validation_loss'])} -> "
        f"{_f(r['last_validation_loss'])}"
      )
      lines.append(f"  checkpoints {r['checkpoints']}, metrics {r['metrics']}")
    elif stage == "synth":
      per = ", ".join(
        f"{n} {v['valid']}/{v['candidates']}" + (" (error)" if v["error"] else "")
        for n, v in r["sources"].items()
      )
      lines.append(
        f"  {r['tasks']} tasks built of {r['candidates']} candidates tried ({per}); tasks {r['tasks_dir']}"
      )
    elif stage == "sft":
      s, g = r["sampled"], r["greedy"]
      lines.append(
        f"  {r['steps']} steps: loss {_f(r['first_loss'])} -> {_f(r['last_loss'])}; "
        f"sampled pass {_f(s['pass_rate'], '.2f')} "
        f"invalid-call rate {_f(s['invalid_call_rate'])}; greedy pass {_f(g['pass_rate'], '.2f')} "
        f"invalid {_f(g['invalid_call_rate'])}"
      )
      lines.append(f"  checkpoints {r['checkpoints']}, metrics {r['metrics']}")
    elif stage == "rl":
      k = r.get("window", 1)
      lines.append(f"  first/last {k} step(s), lambda {r.get('lambda_feedback')}: {_arm_line(r)}")
      nofb = r.get("without_feedback")
      if nofb:
        lines.append(f"  same seeds, lambda 0:      {_arm_line(nofb)}")
        if "invalid_call_rate" in r and "invalid_call_rate" in nofb:
          d_inv = r["invalid_call_rate"]["last"] - nofb["invalid_call_rate"]["last"]
          d_rew = r["reward"]["last"] - nofb["reward"]["last"]
          lines.append(
            f"  feedback effect (last {k} steps, with - without): invalid-call rate {d_inv:+.3f}, "
            f"reward {d_rew:+.3f}"
          )
      lines.append(f"  checkpoints {r.get('checkpoints')}, metrics {r.get('metrics')}")
    else:
      lines.append(
        "  " + ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("seconds", "skipped", "finished"))
      )
  total = sum(r.get("seconds", 0.0) for r in st.values())
  lines.append(
    "wall time: " + ", ".join(f"{s} {_f(r.get('seconds'), '.0f')} s" for s, r in st.items()) + "; "
    f"this run {report['seconds_this_run']:.0f} s, all stages {total:.0f} s"
  )
  lines.append(f"summary: {report['summary']}")
  return "\n".join(lines)
