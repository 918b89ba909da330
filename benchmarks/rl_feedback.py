"""RL alone vs RL + targeted text feedback vs controls, paired over seeds, from SFT checkpoints.

  python benchmarks/rl_feedback.py --workdir=runs/rl_feedback --seeds=0,1,2,3,4,5 --steps=30 \\
      --out=runs/rl_feedback/summary.md   # pretrain + SFT once (cached), the gate, then 3 arms x 6 seeds
  python benchmarks/rl_feedback.py --workdir=runs/rl_feedback --coding_only     # coding env, 1 RL step
  python benchmarks/rl_feedback.py --workdir=runs/ledger --ledger_k=12 --sft_per_seed \\
      --arms=alone,informative,penalty,feedback,distill --tag=_ledger12 \\
      --short_results=runs/ledger/rl_feedback_ledger3.json   # ledger-K (issue 32), each seed its own SFT

The stack is the `run.py` pipeline's: the tiny variant's model pretrained, SFT'd and RL-trained on both
meshes (8 CPU devices; `--one_device`: both meshes on one device) with sharded Muon; each arm is the rl
stage's own `run_arm`.

Arms (`--arms`): `alone` (λ = 0), `feedback` (the config's feedback settings), `null` (the same loss, a
neutral note as the "hint": `rl.hint=null`), and for the ledger env `informative` (λ = 0, the hint as the
tool's reply to a wrapping fadd, the entry redone: `rl.ledger.informative`), `penalty` (λ = 0, the first
flagged turn's tokens get −`--flag_penalty` advantage), `distill` (the feedback term alone:
`rl.policy_gradient=False`). Within a seed every arm starts from the same SFT checkpoint and sees the same
problems and sampling keys at every step (pure functions of (rl.seed, step)); all arms are scored on one
fixed set of new problems (`--eval_problems`, every `--eval_every` steps), in the silent env for the ledger.
With `--sft_per_seed` each seed has its own pretrain and SFT run (`<workdir>/seed<s>`, `seed` = s);
otherwise every seed starts from one checkpoint. `--ledger_k=K` selects the ledger env at K pairs with
the turn and cache budget of K (`ledger.budget`); its SFT stage is run at `--sft_k`'s budget whatever K,
so runs at several K share each seed's SFT checkpoint. The ledger's verdict is `ledger_compare`'s.

For the ledger, each seed's reference policy (its SFT checkpoint, never trained, with the rule in the
prompt: `rl.ledger.rule_in_prompt`) is scored on the same fixed set first (`--no_reference` skips it), and
every evaluation keeps each problem's outcome (`problems`: seed, reward, each measure's [sum, count]) for
`ledger_compare`'s bootstrap over seeds × problems.

Primary metrics per seed: the fixed-set reward after the last step and the area under the fixed-set
reward curve (`rl.stats.curve_mean`: trapezoid ÷ step range). The comparison passes when the one-sided
exact Wilcoxon signed-rank test of feedback − alone gives p ≤ 0.05 on both, the mean improvement is ≥ 0.10
on both, the final invalid-call rate with feedback is at or below RL alone's in every seed, and the null arm
does not beat RL alone (p > 0.05 and mean final-reward difference < 0.05). Results are saved after every
run (`<workdir>/rl_feedback<tag>.json`); a rerun skips the (arm, seed) pairs already there.
Plots: benchmarks/plots/rl_feedback_{eval,invalid,train}<tag>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

# The meshes' 8 devices (as run.py and the tests), or one with --one_device: research cells on a 2-core host
# pay 8 fake devices' collectives for nothing. Read before parsing: the count must be set before jax starts.
ONE_DEVICE = "--one_device" in sys.argv[1:]
jax.config.update("jax_num_cpu_devices", 1 if ONE_DEVICE else 8)
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))

import ledger_compare  # noqa: E402  (benchmarks/, on the path above)

from composer_jax import configs, optim, pipeline, sharding, train  # noqa: E402
from composer_jax.rl import chat, stats  # noqa: E402
from composer_jax.rl import loop as rl_loop  # noqa: E402
from composer_jax.rl import step as rl_step  # noqa: E402
from composer_jax.rl.loss import LossSettings  # noqa: E402
from composer_jax.stages import rl as rl_stage  # noqa: E402
from composer_jax.stages import weights  # noqa: E402
from composer_jax.train import loop as train_loop  # noqa: E402
from composer_jax.train import step as step_lib  # noqa: E402

ARMS = ("alone", "feedback", "null", "informative", "penalty", "distill")
LABEL = {
  "alone": "RL alone",
  "feedback": "RL + feedback",
  "null": "RL + null hint",
  "informative": "RL + informative error",
  "penalty": "RL + detector penalty",
  "distill": "distillation only",
}


def experiment_config():
  spec = importlib.util.spec_from_file_location("composer25", ROOT / "experiments" / "composer25.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return configs.from_config(mod.get_config("tiny"))


def arm_config(base: configs.RLConfig, arm: str, seed: int, flag_penalty: float = 1.0) -> configs.RLConfig:
  """The arm's rl section: the base's settings with only what the arm changes (λ, hint, env mode, penalty,
  policy gradient); an arm's own setting never leaks into another."""
  if arm not in ARMS:
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
  if arm == "informative" and base.env != "ledger":
    raise ValueError("arm informative needs rl.env=ledger (the env that answers a wrapping fadd)")
  env = dataclasses.replace(base.ledger, informative=arm == "informative")
  r = dataclasses.replace(
    base, seed=seed, hint="null" if arm == "null" else "task", flag_penalty=0.0,
    policy_gradient=arm != "distill", ledger=env,
  )  # fmt: skip
  if arm in ("alone", "informative", "penalty"):
    r = dataclasses.replace(r, lambda_feedback=0.0)
  return dataclasses.replace(r, flag_penalty=flag_penalty) if arm == "penalty" else r


def run_arm(config, workdir, rcfg, name):
  """One arm through the rl stage's own `run_arm` (checkpoints under <workdir>/<name>)."""
  summary = rl_stage.run_arm(config, workdir, rcfg, name)
  return {"history": summary["history"], "evals": summary["evals"], "seconds": summary["seconds"]}


def reference_config(rcfg: configs.RLConfig) -> configs.RLConfig:
  """The reference policy's settings (issue 32): the arms' fixed set in the silent env, the rule at the
  end of every prompt; nothing else changes."""
  return dataclasses.replace(
    rcfg, ledger=dataclasses.replace(rcfg.ledger, rule_in_prompt=True, informative=False)
  )


def reference(config, workdir) -> dict:
  """The reference, not trained: the seed's SFT checkpoint evaluated on the arms' fixed set (same problems,
  sampling key and temperature) with the rule in its prompt. An evaluation record like the arms' (step 0),
  with its per-problem outcomes."""
  from composer_jax.rl import rollout

  t0 = time.perf_counter()
  rcfg = reference_config(config.rl)
  meshes = sharding.make_meshes(config)
  params, source = weights.starting_params(config, workdir, "sft", meshes)
  scores, problems = rollout.evaluate_problems(
    params, config.model, rcfg, chat.tokenizer(config.data.tokenizer), meshes=meshes, n=rcfg.eval_problems
  )
  source = source.replace(str(pathlib.Path(workdir)) + os.sep, "")  # no machine path in the results
  return {"step": 0, **scores, "problems": problems, "source": source, "seconds": time.perf_counter() - t0}


def coding_check(config, workdir):
  """One RL step on the coding env over the fixture task(s): rollouts, sandboxed grading, monitor, update."""
  sys.path.insert(0, str(ROOT / "tests"))
  from test_synth_tasks import fixture_env  # the fixture repository of the synth tests

  from composer_jax.rl.envs import coding
  from composer_jax.synth import tasks

  src, venv = fixture_env()
  task_list = tasks.make_tasks(src, venv=venv, max_tasks=2, runs=2)
  one_step = dataclasses.replace(configs.RLConfig().schedule, steps=1)
  rcfg = configs.RLConfig(
    env="coding", schedule=one_step, problems_per_step=len(task_list), group_size=2, max_turns=3,
    max_turn_tokens=48, cache_len=4096, lambda_feedback=1.0,
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

  cfg, meshes = config.model, sharding.make_meshes(config)
  ocfg = rl_stage.rl_optimizer(config, rcfg)
  tx = rl_step.teacher_optimizer(optim.build_optimizer(cfg, ocfg, meshes), rcfg)
  params, _ = weights.starting_params(config, workdir, "sft", meshes)
  state = train.create_state(cfg, tx, jax.random.key(0), meshes, params=params)
  step = step_lib.make_step(
    rl_step.loss_fn(cfg, LossSettings.of(rcfg), meshes), tx, cfg, schedule=optim.lr_schedule(ocfg),
    meshes=meshes, state_sharding=train.state.state_shardings(state),
  )  # fmt: skip
  hooks = rl_loop.hooks(make, cfg, rcfg, chat.tokenizer(config.data.tokenizer), meshes=meshes)
  t0 = time.perf_counter()
  _, result = train_loop.fit(state, step, rcfg.schedule, hooks, name="coding")
  summary = result.summary("reward")
  return {"tasks": [t.instance_id for t in task_list], "seconds": time.perf_counter() - t0, **summary}


# ---- statistics and report ---------------------------------------------------------------------------


def per_seed(runs: dict) -> dict:
  """{arm: {seed: {final, auc, invalid, invalid0, reward0}}} from the fixed-set evaluations."""
  out = {}
  for arm, by_seed in runs.items():
    out[arm] = {}
    for seed, r in by_seed.items():
      ev = r["evals"]
      out[arm][seed] = {
        "final": ev[-1]["reward"],
        "auc": stats.curve_mean([e["step"] for e in ev], [e["reward"] for e in ev]),
        "invalid": ev[-1]["invalid_call_rate"],
        "reward0": ev[0]["reward"],
        "invalid0": ev[0]["invalid_call_rate"],
      }
  return out


def verdict(table: dict) -> tuple[list[str], bool]:
  """The comparison's criteria (module docstring) as lines, and whether all hold."""
  lines, ok = [], True
  seeds = sorted(set(table.get("alone", {})) & set(table.get("feedback", {})), key=int)
  if not seeds:
    return ["- no paired seeds yet"], False
  for key, name in (("final", "final fixed-set reward"), ("auc", "area under the eval curve")):
    d = [table["feedback"][s][key] - table["alone"][s][key] for s in seeds]
    w, p = stats.wilcoxon_greater(d)
    good = p <= 0.05 and np.mean(d) >= 0.10
    ok &= good
    lines.append(
      f"- {name}, feedback - alone over {len(seeds)} seeds: mean {np.mean(d):+.3f} (min {min(d):+.3f}), "
      f"one-sided Wilcoxon W+ = {w:.0f}, p = {p:.4f}: {'pass' if good else 'FAIL'} "
      "(need p <= 0.05, mean >= 0.10)"
    )
  worse = [s for s in seeds if table["feedback"][s]["invalid"] > table["alone"][s]["invalid"]]
  ok &= not worse
  lines.append(
    f"- final invalid-call rate, feedback <= alone in every seed: {'pass' if not worse else 'FAIL'}"
    + (f" (seeds {', '.join(worse)} worse)" if worse else "")
  )
  nseeds = sorted(set(table.get("alone", {})) & set(table.get("null", {})), key=int)
  if nseeds:
    d = [table["null"][s]["final"] - table["alone"][s]["final"] for s in nseeds]
    w, p = stats.wilcoxon_greater(d)
    good = not (p <= 0.05 or np.mean(d) >= 0.05)
    ok &= good
    lines.append(
      f"- null hint - alone, final reward over {len(nseeds)} seeds: mean {np.mean(d):+.3f}, p = {p:.4f}: "
      f"{'pass (does not beat RL alone)' if good else 'FAIL (beats RL alone)'}"
    )
  return lines, ok


def markdown(table: dict) -> str:
  arms = [a for a in ARMS if a in table]
  seeds = sorted({s for a in arms for s in table[a]}, key=int)
  head = "| seed | " + " | ".join(f"{LABEL[a]}: final / AUC / invalid" for a in arms) + " |"
  rows = [head, "|---" * (len(arms) + 1) + "|"]
  for s in seeds:
    cells = [
      f"{table[a][s]['final']:.3f} / {table[a][s]['auc']:.3f} / {table[a][s]['invalid']:.3f}"
      if s in table[a]
      else "–"
      for a in arms
    ]
    rows.append(f"| {s} | " + " | ".join(cells) + " |")
  means = [
    " / ".join(f"{np.mean([table[a][s][k] for s in table[a]]):.3f}" for k in ("final", "auc", "invalid"))
    for a in arms
  ]
  rows.append("| mean | " + " | ".join(means) + " |")
  return "\n".join(rows)


_CURVES = (
  ("reward", "evals", "fixed-set reward", "eval"),
  ("invalid_call_rate", "evals", "fixed-set invalid-call rate", "invalid"),
  ("reward", "history", "training reward (each step's rollouts)", "train"),
)
_LEDGER_CURVES = (
  (ledger_compare.M1, "evals", "M1: first-attempt fadd on risky pairs (silent env)", "m1"),
  ("pass_rate", "evals", "M2: all entries right (silent env)", "m2"),
)


def plot(runs: dict, plots: pathlib.Path, tag: str, curves=_CURVES) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = []
  for key, src, label, name in curves:
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for i, (arm, by_seed) in enumerate(runs.items()):
      curves = [r[src] for r in by_seed.values()]
      xs = np.array([e["step"] for e in curves[0]])
      ys = np.array([[e[key] for e in c] for c in curves if len(c) == len(xs)])
      for y in ys:
        ax.plot(xs, y, color=f"C{i}", alpha=0.25, lw=0.8)
      ax.plot(xs, ys.mean(0), color=f"C{i}", lw=2, label=f"{LABEL[arm]} (mean of {len(ys)} seeds)")
    ax.set_xlabel("RL step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = plots / f"rl_feedback_{name}{tag}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
  return paths


# ---- main ------------------------------------------------------------------------------------------


_EVAL_KEYS = ("step", "reward", "pass_rate", "invalid_call_rate")
_EVAL_KEYS += (ledger_compare.M1, "safe_accuracy", "attempted", "all_correct", "sampled_nll", "problems")
_STEP_KEYS = ("step", "reward", "pass_rate", "invalid_call_rate", "feedback_turns_per_rollout", "entropy")
_STEP_KEYS += (ledger_compare.M1,)


def compact(runs: dict) -> dict:
  """The curves the notebook and RESULTS read: fixed-set evals (with each problem's outcome, for the
  bootstrap over problems) and a few per-step training numbers."""
  return {
    arm: {
      seed: {
        "evals": [{k: e[k] for k in _EVAL_KEYS if k in e} for e in r["evals"]],
        "history": [{k: h[k] for k in _STEP_KEYS if k in h} for h in r["history"]],
      }
      for seed, r in by_seed.items()
    }
    for arm, by_seed in runs.items()
  }


def parse():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", default="runs/rl_feedback")
  ap.add_argument("--seeds", default="0,1,2,3,4,5")
  ap.add_argument("--arms", default="alone,feedback,null")
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--eval_every", type=int, default=5)
  ap.add_argument("--eval_problems", type=int, default=128)
  ap.add_argument("--gate", action="store_true", help="run the gate on the SFT checkpoint first (gate.json)")
  ap.add_argument(
    "--past_failed_gate", action="store_true", help="run the arms even when the gate fails (not a result)"
  )
  ap.add_argument("--set", action="append", default=[], help="override, e.g. --set rl.lambda_feedback=0.5")
  ap.add_argument("--tag", default="", help="results and plot file suffix")
  ap.add_argument("--one_device", action="store_true", help="every stage on a mesh of one CPU device")
  ap.add_argument("--out", default=None, help="also write the markdown summary here")
  ap.add_argument("--plots", default=str(ROOT / "benchmarks" / "plots"))
  ap.add_argument("--results", default=None, help="also write compact results (and the gate) to this folder")
  ap.add_argument("--coding_only", action="store_true", help="1 RL step on the coding env, then stop")
  ap.add_argument("--ledger_k", type=int, default=0, help="the ledger env with K pairs (0: the config's env)")
  ap.add_argument("--sft_k", type=int, default=12, help="ledger: the K whose budget the SFT stage runs at")
  ap.add_argument("--flag_penalty", type=float, default=1.0, help="arm penalty's extra negative advantage")
  ap.add_argument("--sft_per_seed", action="store_true", help="each seed its own pretrain + SFT run")
  ap.add_argument("--short_results", default=None, help="ledger: the short-K results JSON (interaction)")
  ap.add_argument(
    "--no_reference", action="store_true", help="ledger: skip the reference policy (SFT, rule in prompt)"
  )
  return ap.parse_args()


def build_config(args):
  cd = configs.to_config_dict(experiment_config())
  for item in args.set:  # dotted overrides, typed by the dataclasses (strict)
    path, _, value = item.partition("=")
    node = cd
    *parents, leaf = path.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = type(node[leaf])(value) if not isinstance(node[leaf], bool) else value.lower() == "true"
  cd.rl.schedule.update(steps=args.steps, eval_every=args.eval_every)
  cd.rl.eval_problems = args.eval_problems
  config = configs.from_config(cd)
  if args.one_device:
    config = dataclasses.replace(config, mesh=configs.MeshConfig(dense=(1, 1, 1), expert=(1, 1)))
  if args.ledger_k:
    config = dataclasses.replace(
      config, rl=ledger_compare.ledger_rl(config.rl, args.ledger_k, config.data.tokenizer)
    )
  return config


_PREPARED: set[str] = set()


def prepare(config, args, workdir: str, seed: str) -> tuple:
  """(config, workdir) of a seed's arms, after pretrain -> sft (-> gate) ran there as run.py runs them
  (finished stages with this config are skipped): `<workdir>/seed<s>` with `seed` = s under
  `--sft_per_seed`, else `workdir` for every seed. Exits when the gate failed (unless told to go on)."""
  if args.sft_per_seed:
    config, workdir = dataclasses.replace(config, seed=int(seed)), str(pathlib.Path(workdir, f"seed{seed}"))
  if workdir in _PREPARED:
    return config, workdir
  _PREPARED.add(workdir)
  upstream = config
  if config.rl.env == "ledger":  # one SFT per seed for every K: the stages at --sft_k's budget
    upstream = dataclasses.replace(
      config, rl=ledger_compare.ledger_rl(config.rl, args.sft_k, config.data.tokenizer)
    )
  stages = "pretrain,sft,gate" if args.gate else "pretrain,sft"
  pipeline.run(dataclasses.replace(upstream, stages=stages), workdir)
  if args.gate:
    g = json.loads(pathlib.Path(workdir, "gate.json").read_text())
    print(f"- gate ({workdir}): {'PASS' if g['passed'] else 'FAIL'}", flush=True)
    for k, v in g.get("gates", {}).items():
      print(f"  - {k} {'pass' if v['pass'] else 'FAIL'}: {v['why']}", flush=True)
    if not g["passed"] and not args.past_failed_gate:  # a comparison on a failed precondition is no result
      sys.exit(f"the gate failed on the SFT checkpoint of {workdir}; no RL run (--past_failed_gate to go on)")
  return config, workdir


def main():
  args = parse()
  config = build_config(args)
  workdir = str(pathlib.Path(args.workdir).absolute())
  if args.coding_only:
    pipeline.run(dataclasses.replace(config, stages="pretrain,sft"), workdir)
    res = coding_check(config, workdir)
    print(
      json.dumps({k: v for k, v in res.items() if k != "history"} | {"history": res["history"]}, default=str)
    )
    return
  report = [f"## {', '.join(LABEL[a] for a in args.arms.split(','))} ({config.rl.env} env){args.tag}", ""]
  path = pathlib.Path(workdir, f"rl_feedback{args.tag}.json")
  saved = json.loads(path.read_text()) if path.exists() else {}
  runs, references = saved.get("runs", {}), saved.get("reference", {})
  gates = {}

  def save():  # after every run: a run cut short keeps what finished
    body = {"runs": runs, "reference": references, "rl": configs.plain(config.rl)}
    path.write_text(json.dumps(body, indent=1, default=str))

  # Seed-major: each seed's arms finish together, so a run cut short still leaves complete pairs.
  for seed in args.seeds.split(","):
    config_s, workdir_s = prepare(config, args, workdir, seed)
    if pathlib.Path(workdir_s, "gate.json").exists():
      gates[seed] = json.loads(pathlib.Path(workdir_s, "gate.json").read_text())
    if config_s.rl.env == "ledger" and not args.no_reference and seed not in references:
      ref = references[seed] = reference(config_s, workdir_s)
      m1 = ref.get(ledger_compare.M1, float("nan"))
      print(
        f"== reference (SFT, rule in prompt), seed {seed}: M1 {m1:.3f}, all correct {ref['pass_rate']:.3f}, "
        f"{ref['seconds']:.0f} s",
        flush=True,
      )
      save()
    for arm in args.arms.split(","):
      if len(runs.get(arm, {}).get(seed, {}).get("history", [])) >= args.steps:
        continue  # finished before
      print(f"== {LABEL[arm]}, seed {seed}", flush=True)
      rcfg = arm_config(config_s.rl, arm, int(seed), args.flag_penalty)
      r = runs.setdefault(arm, {})[seed] = run_arm(config_s, workdir_s, rcfg, f"rl_{arm}_{seed}{args.tag}")
      ev = r["evals"]
      print(
        f"   fixed-set reward {ev[0]['reward']:.3f} -> {ev[-1]['reward']:.3f}, invalid-call rate "
        f"{ev[0]['invalid_call_rate']:.3f} -> {ev[-1]['invalid_call_rate']:.3f}, {r['seconds']:.0f} s",
        flush=True,
      )
      save()
  plots = pathlib.Path(args.plots)
  plots.mkdir(parents=True, exist_ok=True)
  r = config.rl
  report += [
    f"- {r.schedule.steps} RL steps x {r.problems_per_step} problems x {r.group_size} rollouts, "
    f"{r.objective}, lr {r.lr}; "
    f"feedback: λ {r.lambda_feedback}, {r.feedback_mode} form, {r.divergence}, {r.teacher} teacher, "
    f"{r.feedback_tokens} tokens (threshold {r.divergence_threshold}), clip {r.feedback_clip}; fixed set "
    f"{r.eval_problems} problems every {r.schedule.eval_every} steps; SFT "
    f"{'per seed' if args.sft_per_seed else 'shared by the seeds'}",
    "",
    markdown(per_seed(runs)),
  ]
  comparison = None
  if r.env == "ledger":
    lines, comparison = ledger_compare.summary(runs, args.short_results, references)
    report += lines + ["- plots: " + ", ".join(plot(runs, plots, args.tag, _CURVES + _LEDGER_CURVES))]
  else:
    lines, ok = verdict(per_seed(runs))
    report += [
      "",
      *lines,
      f"- comparison: {'PASS' if ok else 'FAIL'}",
      "- plots: " + ", ".join(plot(runs, plots, args.tag)),
    ]
  if args.results:
    out = pathlib.Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    body = {"runs": compact(runs), "rl": configs.plain(config.rl), "sft": configs.plain(config.sft)}
    body |= {"reference": references} if references else {}
    body |= {"sft_per_seed": args.sft_per_seed} | ({"comparison": comparison} if comparison else {})
    (out / f"rl_feedback{args.tag}.json").write_text(json.dumps(body, indent=None, default=str) + "\n")
    if gates:
      gate = gates if args.sft_per_seed else next(iter(gates.values()))
      (out / f"rl_feedback_gate{args.tag}.json").write_text(json.dumps(gate, indent=1) + "\n")
  text = "\n".join(report)
  print(text, flush=True)
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
  main()
