"""Stage `rl`: multi-turn RL with targeted text feedback from the SFT checkpoint.

  <workdir>/rl (checkpoints), rl_metrics/ (JSONL), rl_episodes/ (coding env checkouts), rl.json; with
  `rl.compare_without_feedback` and λ > 0 also the λ = 0 arm on the same problems and seeds
  (rl_nofb, rl_nofb_metrics, rl_nofb_episodes), for the summary's side-by-side.

Starts from the SFT checkpoint's weights (or `init_from`'s), on the same two meshes as pretraining, and
logs which. Resumes mid-run from the newest checkpoint: the problems and sampling keys of step s are pure
functions of (seed, s). A resumed arm's summary has the whole run's history and evaluations, as if it had
never stopped: those before the resume are read back from its metrics file, their per-problem outcomes
from the checkpoint's data state (`rollout.ProblemLog`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import jax
from absl import logging

from composer_jax import backend, configs, optim, sharding
from composer_jax.configs import Config, RLConfig
from composer_jax.plan import host
from composer_jax.stages import outputs, sft, weights
from composer_jax.stages.record import Interrupted, Stage


def rl_optimizer(config: Config, rcfg: RLConfig) -> configs.OptimizerConfig:
  return configs.stage_optimizer(config.optim, rcfg.schedule, lr=rcfg.lr, min_lr_ratio=1.0)


def run(config: Config, workdir: str) -> dict[str, Any]:
  """The feedback arm, then (with `compare_without_feedback` and λ > 0) the λ = 0 arm from the same SFT
  params on the same problems and seeds; its summary is `without_feedback` in the returned dict."""
  rcfg = dataclasses.replace(config.rl, update_tokens=update_budget(config))
  summary = run_arm(config, workdir, rcfg, "rl")
  if rcfg.compare_without_feedback and rcfg.lambda_feedback > 0:
    logging.info("[rl] the same run without feedback (lambda_feedback 0), same problems and seeds")
    nofb = dataclasses.replace(rcfg, lambda_feedback=0.0)
    summary["without_feedback"] = run_arm(config, workdir, nofb, "rl_nofb")
  pathlib.Path(workdir, "rl.json").write_text(json.dumps(summary, indent=1))
  return summary


def update_budget(config: Config) -> int:
  """`rl.update_tokens` to run with: on CPU (every device a slice of this host's memory) checked against, or
  chosen to fit, `rl.update_memory` of the host at the longest rollouts (`plan.host`), said in one line
  when micro-batches are chosen; on GPU/TPU as configured (0: one pass; `plan` checks HBM)."""
  if backend.platform() != "cpu":
    return config.rl.update_tokens
  tokens, line = host.resolve_update_tokens(config)
  if line:
    logging.info("%s", line)
  return tokens


def run_arm(config: Config, workdir: str, rcfg: RLConfig, name: str) -> dict[str, Any]:
  """One RL run into `<workdir>/<name>` (checkpoints) and `<workdir>/<name>_metrics`, on both meshes."""
  from composer_jax import train
  from composer_jax.rl import chat, loop, rollout, step
  from composer_jax.rl.envs import factories
  from composer_jax.rl.loss import LossSettings
  from composer_jax.train import loop as train_loop
  from composer_jax.train import step as step_lib

  cfg = config.model
  meshes = sharding.make_meshes(config)
  tok = chat.tokenizer(config.data.tokenizer)
  ocfg = rl_optimizer(config, rcfg)
  tx = step.teacher_optimizer(optim.build_optimizer(cfg, ocfg, meshes), rcfg)  # the teacher in opt state
  record = configs.record(
    model=cfg, optim=configs.identity(ocfg), rl=configs.identity(rcfg), seed=config.seed
  )
  make_envs = factories.factory(rcfg, workdir, pathlib.Path(workdir, f"{name}_episodes"))
  # the fixed problem set (rl.schedule.eval_every, rl.eval_problems): step-to-step noise-free progress
  # (each evaluation's per-problem outcomes are kept beside it: the bootstrap over problems needs them)
  evaluate = None
  if rcfg.env in factories.MAKE_ONE and rcfg.schedule.eval_every > 0:
    evaluate = rollout.ProblemLog(
      functools.partial(
        rollout.evaluate_problems, cfg=cfg, rcfg=rcfg, tok=tok, meshes=meshes, n=rcfg.eval_problems
      )
    )
  metrics_dir = pathlib.Path(workdir, f"{name}_metrics")
  notes = {"total_steps": ocfg.total_steps}
  keep = rcfg.schedule.keep_checkpoints
  with outputs.opened(pathlib.Path(workdir, name), record, keep, metrics_dir, notes) as out:
    state, source, data_state = _start(config, workdir, name, out, tx, meshes, ocfg)
    if evaluate is not None:
      evaluate.resume(data_state)  # the outcomes of the evaluations before the resume
    logging.info(
      "[%s] weights from %s; env %s, %d steps x %d problems x %d rollouts, %s/%s, lambda_feedback %s "
      "(%s, %s form, %s teacher, %s tokens, %s hint)",
      name, source, rcfg.env, rcfg.schedule.steps, rcfg.problems_per_step, rcfg.group_size, rcfg.objective,
      rcfg.advantage, rcfg.lambda_feedback, rcfg.divergence, rcfg.feedback_mode, rcfg.teacher,
      rcfg.feedback_tokens, rcfg.hint,
    )  # fmt: skip
    train_step = step_lib.make_step(
      step.loss_fn(cfg, LossSettings.of(rcfg), meshes), tx, cfg, schedule=optim.lr_schedule(ocfg),
      meshes=meshes, state_sharding=train.state.state_shardings(state),
      router_bias_rate=rcfg.router_bias_rate,
    )  # fmt: skip
    hooks = loop.hooks(
      make_envs, cfg, rcfg, tok, meshes=meshes, evaluate=evaluate, check=out.check, writer=out.writer,
      save=lambda st, final: out.ckpt.save(st, {} if evaluate is None else evaluate.saved(), force=final),
    )  # fmt: skip
    state, result = train_loop.fit(state, train_step, rcfg.schedule, hooks, name=name)
  if result.interrupted:
    raise Interrupted(f"{name} stopped at step {result.steps} and saved its checkpoint")
  result = result.with_earlier(metrics_dir / "metrics.jsonl", "reward", "eval_reward")  # after a resume
  summary = result.summary("reward", "eval_reward")
  summary["evals"] = _unprefixed(result.evals)
  if evaluate is not None:
    summary["evals"] = evaluate.attach(summary["evals"])
  summary |= {
    "init": source,
    "lambda_feedback": rcfg.lambda_feedback,
    "rollouts_per_step": rcfg.problems_per_step * rcfg.group_size,
    "checkpoints": str(out.ckpt.directory),
    "metrics": str((metrics_dir / "metrics.jsonl").absolute()),
  }
  h = summary["history"]
  if h:
    logging.info(
      "[%s] reward %.3f -> %.3f, invalid-call rate %.3f -> %.3f, %.0fs",
      name, h[0]["reward"], h[-1]["reward"], h[0]["invalid_call_rate"], h[-1]["invalid_call_rate"],
      summary["seconds"],
    )  # fmt: skip
  return summary


def eval_history(path: pathlib.Path) -> list[dict]:
  """The fixed-set evaluations of a metrics JSONL as {step, reward, ...} (the `eval_` prefix dropped)."""
  from composer_jax.train import metrics

  return _unprefixed(metrics.read_history(path, "eval_reward"))


def _unprefixed(records: list[dict]) -> list[dict]:
  """Fixed-set evaluation records as {step, reward, ...}: the `eval_` metrics without their prefix."""
  return [
    {"step": r["step"]} | {k.removeprefix("eval_"): v for k, v in r.items() if k.startswith("eval_")}
    for r in records
  ]


def _start(
  config: Config, workdir: str, name: str, out: outputs.Outputs, tx: Any, meshes: Any, ocfg: Any
) -> tuple[Any, str, dict | None]:
  """(state, where its weights came from, data state): the arm's own newest good checkpoint, else the SFT
  checkpoint's params (or `init_from`'s weights) with a fresh optimizer state, whose teacher they are."""
  from composer_jax import train

  if out.ckpt.latest_step() is not None:  # restored into an abstract template: no weights read or made
    state, data = outputs.resume(out, train.state.abstract_state(config.model, tx, meshes), name, ocfg)
    return state, f"{out.ckpt.directory}/{int(state.step)} (resumed)", data
  params, source = weights.starting_params(config, workdir, "sft", meshes)
  state = train.create_state(config.model, tx, jax.random.key(config.seed), meshes, params=params)
  return state, source, None


def _window_means(values: list[float]) -> tuple[float, float, int]:
  """(mean of the first k, mean of the last k, k) with k = max(1, min(3, len // 3)): single steps of a few
  dozen rollouts are noisy."""
  k = max(1, min(3, len(values) // 3))
  return sum(values[:k]) / k, sum(values[-k:]) / k, k


def _arm(s: dict) -> dict:
  h = s.get("history") or []
  out: dict[str, Any] = dict(
    steps=s.get("steps"), lambda_feedback=s.get("lambda_feedback"), failed_steps=s.get("failed_steps")
  )
  if h:
    for key in ("reward", "pass_rate", "invalid_call_rate"):
      first, last, k = _window_means([r.get(key, 0.0) for r in h])
      out[key] = dict(first=first, last=last)
    out["window"] = k
    for key in ("feedback_turns_per_rollout", "feedback_kl"):
      out[key] = sum(r.get(key, 0.0) for r in h) / len(h)
  evals = s.get("evals") or []
  if len(evals) > 1:  # the fixed problem set, before the first step and after the last evaluated one
    keep = ("step", "reward", "invalid_call_rate")
    out["eval"] = dict(first={k: evals[0].get(k) for k in keep}, last={k: evals[-1].get(k) for k in keep})
  return out | {k: s[k] for k in ("checkpoints", "metrics") if k in s}


def _effect(r: dict, nofb: dict) -> dict | None:
  """With − without feedback, on the fixed problems after the last evaluation when both arms have them
  (else the training rollouts' last window): reward, invalid-call rate, and whether feedback is ahead on
  both (higher reward, invalid-call rate no higher)."""
  if "eval" in r and "eval" in nofb:
    a, b, where = (
      r["eval"]["last"],
      nofb["eval"]["last"],
      f"fixed problems at step {r['eval']['last']['step']}",
    )
  elif "reward" in r and "reward" in nofb:
    a, b = ({k: x[k]["last"] for k in ("reward", "invalid_call_rate")} for x in (r, nofb))
    where = f"training rollouts, last {r.get('window', 1)} steps"
  else:
    return None
  d_rew, d_inv = a["reward"] - b["reward"], a["invalid_call_rate"] - b["invalid_call_rate"]
  return {"where": where, "reward": d_rew, "invalid_call_rate": d_inv, "ahead": d_rew > 0 and d_inv <= 0}


def _summarize(s: dict, w: pathlib.Path) -> dict:
  out = _arm(s)
  if s.get("without_feedback"):
    out["without_feedback"] = _arm(s["without_feedback"])
    out["effect"] = _effect(out, out["without_feedback"])
  return out


def _f(x: Any, fmt: str = ".3f") -> str:
  return "n/a" if x is None else format(x, fmt)


def _ff(a: dict, key: str) -> str:
  return f"{_f(a[key]['first'])} -> {_f(a[key]['last'])}"


def _eval_line(a: dict) -> str:
  e0, e1 = a["eval"]["first"], a["eval"]["last"]
  return (
    f"reward {_f(e0['reward'])} -> {_f(e1['reward'])}, invalid-call rate {_f(e0['invalid_call_rate'])} -> "
    f"{_f(e1['invalid_call_rate'])}"
  )


def _train_line(a: dict) -> str:
  if "reward" not in a:
    return f"{a.get('steps')} steps, no step finished"
  return (
    f"reward {_ff(a, 'reward')}, pass {_ff(a, 'pass_rate')}, invalid-call rate "
    f"{_ff(a, 'invalid_call_rate')}, feedback turns/rollout {_f(a['feedback_turns_per_rollout'], '.2f')}, "
    f"feedback KL {_f(a['feedback_kl'], '.4f')}"
  )


def _lines(r: dict) -> list[str]:
  """Fixed problems first (the comparison), then the training stream, then where things are."""
  nofb, lam = r.get("without_feedback"), r.get("lambda_feedback")
  arms = [(f"RL + feedback (lambda {lam})" if lam else "RL", r)] + (
    [("RL alone, same seeds", nofb)] if nofb else []
  )
  lines = []
  if "eval" in r:
    e = r["eval"]
    lines.append(f"  fixed problems, step {e['first']['step']} -> {e['last']['step']}:")
    lines += [f"    {name + ':':<30} {_eval_line(a)}" for name, a in arms if "eval" in a]
  eff = r.get("effect")
  if eff:
    verdict = "feedback ahead on both" if eff["ahead"] else "feedback NOT ahead"
    lines.append(
      f"  feedback effect ({eff['where']}, with - without): reward {eff['reward']:+.3f}, invalid-call rate "
      f"{eff['invalid_call_rate']:+.3f}: {verdict}"
    )
  k = r.get("window", 1)
  lines.append(f"  training rollouts, first/last {k} step(s):")
  lines += [f"    {name + ':':<30} {_train_line(a)}" for name, a in arms]
  lines.append(f"  checkpoints {r.get('checkpoints')}, metrics {r.get('metrics')}")
  return lines


def _ledger_problems(r: RLConfig, tok: Any) -> list[str]:
  """Turns and cache slots for a whole ledger episode: a rollout cut short would score 0 silently."""
  from composer_jax.rl.envs import ledger

  turns, slots = ledger.budget(r.ledger.k, tok, r.max_turn_tokens)
  out = []
  if r.max_turns < turns:
    out.append(f"rl.max_turns {r.max_turns} < {turns} (ledger K={r.ledger.k}: K entries, done, redos)")
  if r.cache_len < slots:
    out.append(f"rl.cache_len {r.cache_len} < {slots} (ledger K={r.ledger.k} at {turns} turns)")
  return out


def _check(config: Config) -> None:
  from composer_jax.rl import chat, objectives, step
  from composer_jax.rl.envs import factories

  sft.check_chat(config)
  r = config.rl
  problems = []
  if r.env not in factories.FACTORIES:
    problems.append(f"rl.env {r.env!r}: known {', '.join(factories.FACTORIES)}")
  if r.objective not in objectives.OBJECTIVES:
    problems.append(f"rl.objective {r.objective!r}: known {', '.join(objectives.OBJECTIVES)}")
  if r.advantage not in objectives.ADVANTAGES:
    problems.append(f"rl.advantage {r.advantage!r}: known {', '.join(objectives.ADVANTAGES)}")
  try:
    step.check_config(r)
  except ValueError as e:
    problems.append(f"rl: {e}")
  if r.env == "ledger":
    problems += _ledger_problems(r, chat.tokenizer(config.data.tokenizer))
  replica, fsdp, _ = config.mesh.dense
  rows = r.problems_per_step * r.group_size
  if rows % (replica * fsdp):  # fine for a small run; at scale every device would hold every rollout
    logging.warning(
      "[rl] rl.problems_per_step × group_size = %d rows do not split over replica·fsdp = %d: every "
      "device holds all of them", rows, replica * fsdp,
    )  # fmt: skip
  if problems:
    raise configs.ConfigError("; ".join(problems))


STAGE = Stage(
  name="rl",
  run=run,
  check=_check,
  doc="multi-turn RL with targeted text feedback from the SFT checkpoint (and the same run without)",
  depends=("seed", "model", "optim", "rl", "data.tokenizer", "init_from"),
  outputs=("rl", "rl_metrics", "rl_episodes", "rl_nofb", "rl_nofb_metrics", "rl_nofb_episodes", "rl.json"),
  upstream=lambda config: ("sft", "synth") if config.rl.env == "coding" else ("sft",),
  extends=configs.cadence_paths("rl"),
  summarize=_summarize,
  lines=_lines,
)
