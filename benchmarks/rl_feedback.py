"""RL alone (λ = 0) vs RL + targeted text feedback (λ > 0) on the toy tool env, from one SFT checkpoint.

  python benchmarks/rl_feedback.py --workdir=runs/rl_feedback --steps=20 --seeds=0,1,2 \\
      --out=runs/rl_feedback/summary.md                      # SFT once (cached), then 2 arms x 3 seeds
  python benchmarks/rl_feedback.py --workdir=runs/rl_feedback --coding_only   # coding env, 1 RL step

Per step and seed: mean reward and invalid-tool-call rate (invalid calls ÷ calls) of the step's rollouts
(before its update). Plots: benchmarks/plots/rl_feedback_{reward,invalid}.png (mean over seeds, band =
min..max). Also the RL step time with feedback ÷ without: the same rollout batch through both jitted
steps (compiled first, median of repeats), and the in-loop update times. `--coding` adds one RL step on
the coding env over the synthetic fixture task of tests/test_synth_tasks.py (needs bubblewrap).
Models and settings: experiments/composer25.py `rl.model` overrides, one CPU device (meshes None).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))

from composer_jax import configs, optim, train  # noqa: E402
from composer_jax.rl import batch as rl_batch_lib  # noqa: E402
from composer_jax.rl import loop as rl_loop  # noqa: E402
from composer_jax.rl import rollout  # noqa: E402
from composer_jax.rl import step as rl_step  # noqa: E402
from composer_jax.rl.envs import factories  # noqa: E402
from composer_jax.stages import rl as rl_stage  # noqa: E402
from composer_jax.stages import sft as sft_stage  # noqa: E402


def experiment_config():
  spec = importlib.util.spec_from_file_location("composer25", ROOT / "experiments" / "composer25.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return configs.from_config(mod.get_config("tiny"))


def fresh_state(config, cfg, rcfg, params):
  ocfg = rl_stage.rl_optimizer(config, rcfg)
  tx = optim.build_optimizer(cfg, ocfg, None)
  tx = rl_step.teacher_optimizer(tx, rcfg)
  state = train.TrainState(
    step=jax.numpy.zeros((), jax.numpy.int32), params=params, opt_state=tx.init(params)
  )
  return state, tx, optim.lr_schedule(ocfg)


def copy_params(params):
  return jax.tree.map(lambda x: x.copy(), params)  # the steps donate their state


def run_arm(config, cfg, rcfg, params, log):
  state, tx, schedule = fresh_state(config, cfg, rcfg, copy_params(params))
  steps = {fb: rl_step.make_rl_step(cfg, tx, schedule, rcfg, with_feedback=fb) for fb in (False, True)}
  evaluate = functools.partial(rollout.evaluate, cfg=cfg, rcfg=rcfg, n=rcfg.eval_problems)
  _, summary = rl_loop.fit(state, steps, factories.toy_envs(rcfg), cfg, rcfg, evaluate=evaluate)
  return summary["history"], summary["evals"]


def step_time_ratio(config, cfg, rcfg, params, repeats=5):
  """Median seconds of the jitted step on the same batch with the teacher vs without."""
  env_list, seeds, groups = factories.toy_envs(rcfg)(10_000)
  trajs = rollout.collect(params, cfg, env_list, seeds, jax.random.key(7), rcfg)
  batch = rl_batch_lib.rl_batch(trajs, groups, [e.info() for e in env_list], with_feedback=True)
  base = {k: v for k, v in batch.items() if k in rl_batch_lib.BASE_KEYS}
  out = {}
  for fb, b in ((False, base), (True, batch)):
    state, tx, schedule = fresh_state(config, cfg, rcfg, copy_params(params))
    step = rl_step.make_rl_step(
      cfg, tx, schedule, dataclasses.replace(rcfg, lambda_feedback=0.5), with_feedback=fb
    )
    state, m = step(state, b)  # compile
    jax.block_until_ready(m)
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      state, m = step(state, b)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t0)
    out[fb] = statistics.median(times)
  n_fb = int(np.sum(batch["teacher_lengths"] > 0))
  return out[True] / out[False], out, n_fb, batch["tokens"].shape, batch["teacher_tokens"].shape


def coding_check(config, cfg, params, workdir, log):
  """One RL step on the coding env over the fixture task(s): rollouts, sandboxed grading, monitor, update."""
  sys.path.insert(0, str(ROOT / "tests"))
  from test_synth_tasks import fixture_env  # the fixture repository of the synth tests

  from composer_jax.rl.envs import coding
  from composer_jax.synth import tasks

  src, venv = fixture_env()
  task_list = tasks.make_tasks(src, venv=venv, max_tasks=2, runs=2)
  rcfg = configs.RLConfig(
    env="coding", steps=1, problems_per_step=len(task_list), group_size=2, max_turns=3, max_turn_tokens=48,
    cache_len=4096, lambda_feedback=0.5,
  )  # fmt: skip
  ccfg = coding.CodingConfig(max_turns=rcfg.max_turns, max_output_chars=400, tool_timeout_s=60.0)
  root = pathlib.Path(workdir, "coding_episodes")

  def make(step):
    env_list = [
      coding.CodingEnv(t, root / f"{step}-{i}", ccfg) for i, t in enumerate(task_list) for _ in range(2)
    ]
    return (
      env_list,
      [g for _ in task_list for g in range(2)],
      [i for i in range(len(task_list)) for _ in range(2)],
    )

  state, tx, schedule = fresh_state(config, cfg, rcfg, copy_params(params))
  steps = {fb: rl_step.make_rl_step(cfg, tx, schedule, rcfg, with_feedback=fb) for fb in (False, True)}
  t0 = time.perf_counter()
  _, summary = rl_loop.fit(state, steps, make, cfg, rcfg)
  return {"tasks": [t.instance_id for t in task_list], "seconds": time.perf_counter() - t0, **summary}


def band(histories, key):
  arr = np.array([[h[key] for h in hist] for hist in histories])  # [seeds, steps]
  return arr.mean(0), arr.min(0), arr.max(0), arr


def summarise_evals(evals):
  """Fixed-set evaluation: reward and invalid-call rate before RL and after the last step, per arm."""
  lines = [
    "| arm (fixed eval set) | reward, step 0 | reward, end | invalid-call rate, step 0 | invalid, end |",
    "|---|---|---|---|---|",
  ]
  for arm, runs in evals.items():
    cells = [arm]
    for key in ("reward", "invalid_call_rate"):
      first = np.array([r[0][key] for r in runs])
      last = np.array([r[-1][key] for r in runs])
      cells += [f"{first.mean():.3f} ± {first.std():.3f}", f"{last.mean():.3f} ± {last.std():.3f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(results, key, label, path, x=None):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.6))
  for arm, histories in results.items():
    mean, lo, hi, _ = band(histories, key)
    xs = np.array([h[x] for h in histories[0]]) if x else np.arange(1, len(mean) + 1)
    ax.plot(xs, mean, label=f"{arm} (mean of {len(histories)} seeds)")
    ax.fill_between(xs, lo, hi, alpha=0.2)
  ax.set_xlabel("RL step")
  ax.set_ylabel(label)
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def summarise(results, k=3):
  lines = [
    "| arm | reward first " + f"{k} steps | reward last {k} steps | invalid-call rate first {k} | "
    f"invalid-call rate last {k} | feedback turns/rollout (mean) |",
    "|---|---|---|---|---|---|",
  ]
  for arm, histories in results.items():
    cells = [arm]
    for key in ("reward", "invalid_call_rate"):
      *_, arr = band(histories, key)
      first, last = arr[:, :k].mean(1), arr[:, -k:].mean(1)  # per seed
      cells += [f"{first.mean():.3f} ± {first.std():.3f}", f"{last.mean():.3f} ± {last.std():.3f}"]
    cells.append(f"{band(histories, 'feedback_turns_per_rollout')[0].mean():.3f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", default="runs/rl_feedback")
  ap.add_argument("--sft_steps", type=int, default=None, help="default: experiments/composer25.py sft.steps")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--lambda_feedback", type=float, default=0.5)
  ap.add_argument("--problems", type=int, default=8)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--lr", type=float, default=None)
  ap.add_argument("--out", default=None, help="also write the markdown summary here")
  ap.add_argument("--plots", default=str(ROOT / "benchmarks" / "plots"))
  ap.add_argument("--feedback_kinds", default="", help='e.g. "unknown_tool"; "": FeedbackRules default')
  ap.add_argument("--arms", default="both", choices=("both", "alone", "feedback"))
  ap.add_argument("--feedback_mode", default=None, choices=rl_step.FEEDBACK_MODES)
  ap.add_argument("--teacher", default=None, choices=rl_step.TEACHERS)
  ap.add_argument("--objective", default=None)
  ap.add_argument("--dynamic_sampling", action="store_true")
  ap.add_argument("--warmup", type=int, default=None, help="RL lr warm-up steps")
  ap.add_argument("--matrix_optimizer", default=None, choices=("muon", "adamw"))
  ap.add_argument("--adam_eps", type=float, default=None, help="AdamW epsilon (default: config.optim)")
  ap.add_argument("--weight_decay", type=float, default=None, help="default: config.optim")
  ap.add_argument("--router_bias_rate", type=float, default=None, help="default: config.rl")
  ap.add_argument("--eval_every", type=int, default=5, help="fixed-set evaluation every N steps; 0 off")
  ap.add_argument("--eval_problems", type=int, default=64)
  ap.add_argument("--skip_ratio", action="store_true", help="skip the step-time ratio measurement")
  ap.add_argument("--tag", default="", help="plot file suffix")
  ap.add_argument("--coding", action="store_true", help="also run 1 RL step on the coding env")
  ap.add_argument("--coding_only", action="store_true")
  args = ap.parse_args()

  config = experiment_config()
  optim_fields = {
    f: getattr(args, f) for f in ("matrix_optimizer", "adam_eps", "weight_decay") if getattr(args, f)
  }
  config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, **optim_fields))
  if args.sft_steps is not None:
    config = dataclasses.replace(config, sft=dataclasses.replace(config.sft, steps=args.sft_steps))
  cfg = configs.rl_model(config)
  workdir = str(pathlib.Path(args.workdir).absolute())
  params = sft_stage.load_params(workdir, cfg)
  if params is None:
    sft_stage.run(config, workdir)
    params = sft_stage.load_params(workdir, cfg)
  sft_info = (
    json.loads(pathlib.Path(workdir, "sft.json").read_text())
    if pathlib.Path(workdir, "sft.json").exists()
    else {}
  )
  report = ["## RL + targeted text feedback vs RL alone (toy tool env)", ""]
  if sft_info:
    for name in ("sampled", "greedy"):
      ev = sft_info.get(f"eval_{name}")
      if ev:
        report.append(
          f"- SFT checkpoint ({sft_info['steps']} steps), {name}: pass rate {ev['pass_rate']:.2f}, "
          f"invalid-call rate {ev['invalid_call_rate']:.3f}, turns/rollout {ev['turns_per_rollout']:.2f}"
        )

  if args.coding or args.coding_only:
    res = coding_check(config, cfg, params, workdir, print)
    h = res["history"]
    line = f"- coding env, tasks {res['tasks']}, 1 RL step ({len(res['tasks'])}x2 rollouts): " + (
      f"reward {h[0]['reward']:.2f}, invalid-call rate {h[0]['invalid_call_rate']:.2f}, failed rollouts "
      f"{int(h[0]['failed_rollouts'])}, feedback turns/rollout {h[0]['feedback_turns_per_rollout']:.2f}, "
      f"update finite loss {np.isfinite(h[0]['loss'])}, {res['seconds']:.0f}s"
      if h
      else f"step failed ({res['failed_steps']} failed steps)"
    )
    report.append(line)
    print(line, flush=True)
    if args.coding_only:
      print("\n".join(report))
      return

  base = dataclasses.replace(
    config.rl,
    steps=args.steps,
    problems_per_step=args.problems,
    group_size=args.group,
    feedback_kinds=args.feedback_kinds,
  )
  for field in ("lr", "feedback_mode", "teacher", "objective", "router_bias_rate"):
    if getattr(args, field) is not None:
      base = dataclasses.replace(base, **{field: getattr(args, field)})
  if args.dynamic_sampling:
    base = dataclasses.replace(base, dynamic_sampling=True)
  base = dataclasses.replace(base, eval_every=args.eval_every, eval_problems=args.eval_problems)
  if args.warmup is not None:
    base = dataclasses.replace(base, warmup_steps=args.warmup)
  ratio, times, n_fb, shape, tshape = (
    (float("nan"), {True: float("nan"), False: float("nan")}, 0, (), ())
    if args.skip_ratio
    else step_time_ratio(config, cfg, base, params)
  )
  seeds = [int(s) for s in args.seeds.split(",")]
  results, evals = {}, {}
  arms = [("RL alone", 0.0), (f"RL + feedback (λ={args.lambda_feedback})", args.lambda_feedback)]
  arms = {"both": arms, "alone": arms[:1], "feedback": arms[1:]}[args.arms]
  for arm, lam in arms:
    results[arm] = []
    for seed in seeds:
      rcfg = dataclasses.replace(base, lambda_feedback=lam, seed=seed)
      print(f"== {arm}, seed {seed}", flush=True)
      hist, ev = run_arm(config, cfg, rcfg, params, print)
      results[arm].append(hist)
      evals.setdefault(arm, []).append(ev)
  plots = pathlib.Path(args.plots)
  plots.mkdir(parents=True, exist_ok=True)
  plot(results, "reward", "mean reward", plots / f"rl_feedback_reward{args.tag}.png")
  plot(results, "invalid_call_rate", "invalid calls / calls", plots / f"rl_feedback_invalid{args.tag}.png")
  if args.eval_every > 0:
    plot(evals, "reward", "eval reward (fixed problems)", plots / f"rl_feedback_eval{args.tag}.png", x="step")
    report_evals = summarise_evals(evals)
  else:
    report_evals = ""
  upd = {  # the first step of each run compiles
    arm: statistics.median([h["step_s"] for hist in hs for h in hist[1:]] or [float("nan")])
    for arm, hs in results.items()
  }
  report += [
    f"- {len(seeds)} seeds per arm, {args.steps} RL steps x {args.problems} problems x {args.group} "
    f"rollouts, {base.objective}/{base.advantage}, lr {base.lr}, temperature {base.temperature}, "
    f"feedback_mode {base.feedback_mode}, teacher {base.teacher}, dynamic_sampling {base.dynamic_sampling}; "
    "mean ± std over seeds of each seed's mean over the first / last 3 steps "
    "(rollouts before that step's update)",
    "",
    summarise(results),
    "",
    report_evals,
    "",
    f"- RL step time with feedback ÷ without: {ratio:.2f}x (same batch {shape} with {n_fb} feedback rows, "
    f"teacher extension {tshape}; {times[True]:.3f}s vs {times[False]:.3f}s, median of 5 after compile)",
    "- in-loop median update seconds: " + ", ".join(f"{a}: {s:.2f}s" for a, s in upd.items()),
    f"- plots: {plots / f'rl_feedback_reward{args.tag}.png'}, {plots / f'rl_feedback_invalid{args.tag}.png'}",
    f"- feedback kinds: {base.feedback_kinds or 'FeedbackRules default'}",
  ]
  text = "\n".join(report)
  print(text, flush=True)
  raw = {arm: hs for arm, hs in results.items()}
  pathlib.Path(workdir, f"rl_feedback{args.tag}.json").write_text(
    json.dumps({"results": raw, "evals": evals, "ratio": ratio}, indent=1)
  )
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
  main()
