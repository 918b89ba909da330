"""The pre-registered ledger-K comparison (issue 32, benchmarks/RESULTS.md) from per-seed fixed-set curves.

  rcfg = ledger_rl(rcfg, k, tokenizer)          # the ledger env at K pairs, with a whole episode's budget
  table = per_seed(runs)                        # {arm: {seed: M1 AUC, M1/M2 final, M3, guardrails}}
  result = compare(table, short=short_table)    # primary, secondary (Holm), steps-to-threshold ratio
  lines = report(result)                        # the verdict lines of the summary

Arms (benchmarks/rl_feedback.py `--arms`): alone (A), informative (B), penalty (C), feedback (D),
distill (E). Every evaluation is in the silent environment on one fixed problem set.

- M1: first-attempt mistake rate on risky pairs (`risky_first_fadd`); per seed its AUC over the eval
  curve (`stats.curve_mean`, trapezoid ÷ step range; lower is better). M2: all-correct rate
  (`pass_rate`). M3: steps until M1 ≤ 0.10, censored at the horizon (`stats.steps_to`).
- Primary: D vs B, per-seed M1 AUC, one-sided exact Wilcoxon signed-rank on B − D (H1: D lower).
- Secondary, Holm-adjusted together: D vs C and D vs A (the same test on C − D, A − D), and the
  interaction (B − D at long K) − (B − D at short K), one-sided exact paired permutation (H1: the gap
  grows with K). Needs the short-K table of the same seeds.
- Steps-to-threshold ratio M3(B) / M3(D) over seeds (ratio of means), paired bootstrap 95 % CI.
- Guardrails at the last evaluation: accuracy on non-risky pairs, invalid-call rate, the sampled
  tokens' mean −log π (an entropy estimate).
- Per arm, M1 and M2 at the last evaluation with 95 % bootstrap CIs over seeds × problems
  (`stats.two_level_ci` on each evaluation's per-problem outcomes, `problems`); the same for the
  reference policy (each seed's SFT checkpoint with the rule in its prompt, never trained), which is also
  a column of the per-seed table.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from composer_jax import configs
from composer_jax.rl import chat, stats

M1 = "risky_first_fadd"
THRESHOLD = 0.10
ALPHA = 0.05
ARMS = {"alone": "A", "informative": "B", "penalty": "C", "feedback": "D", "distill": "E"}


def per_seed(runs: dict, threshold: float = THRESHOLD) -> dict:
  """{arm: {seed: row}} from each run's fixed-set evaluations (`evals`, step 0 included)."""
  out = {}
  for arm, by_seed in runs.items():
    out[arm] = {}
    for seed, r in by_seed.items():
      ev = [e for e in r["evals"] if M1 in e]
      if not ev:
        continue
      steps, m1 = [e["step"] for e in ev], [e[M1] for e in ev]
      m3, censored = stats.steps_to(steps, m1, threshold)
      last = ev[-1]
      out[arm][seed] = {
        "m1_auc": stats.curve_mean(steps, m1),
        "m1_start": m1[0],
        "m1_final": m1[-1],
        "m2_final": last["pass_rate"],
        "m3": m3,
        "censored": censored,
        "horizon": steps[-1],
        "safe_accuracy": last.get("safe_accuracy"),
        "invalid": last["invalid_call_rate"],
        "entropy": last.get("sampled_nll"),
      }
  return out


def _paired(table: dict, a: str, b: str) -> list[str]:
  return sorted(set(table.get(a, {})) & set(table.get(b, {})), key=int)


def _gap(table: dict, worse: str, better: str, seeds: list[str]) -> list[float]:
  """Per seed, M1 AUC of `worse` minus `better` (positive: `better` made fewer first-attempt mistakes)."""
  return [table[worse][s]["m1_auc"] - table[better][s]["m1_auc"] for s in seeds]


def compare(table: dict, short: dict | None = None) -> dict:
  """The pre-registered tests on `table` (long K) and, for the interaction, `short` (short K)."""
  out: dict = {"secondary": {}}
  seeds = _paired(table, "feedback", "informative")
  if seeds:
    d = _gap(table, "informative", "feedback", seeds)
    w, p = stats.wilcoxon_greater(d)
    out["primary"] = {"seeds": seeds, "diffs": d, "mean": sum(d) / len(d), "w": w, "p": p}
    m3_b = [table["informative"][s]["m3"] for s in seeds]
    m3_d = [table["feedback"][s]["m3"] for s in seeds]
    if sum(m3_d) > 0:
      r, lo, hi = stats.ratio_ci(m3_b, m3_d)
      out["ratio"] = {"ratio": r, "lo": lo, "hi": hi, "m3_b": m3_b, "m3_d": m3_d}
      out["ratio"]["censored_b"] = sum(table["informative"][s]["censored"] for s in seeds)
      out["ratio"]["censored_d"] = sum(table["feedback"][s]["censored"] for s in seeds)
  for other in ("penalty", "alone"):
    s2 = _paired(table, "feedback", other)
    if s2:
      d = _gap(table, other, "feedback", s2)
      w, p = stats.wilcoxon_greater(d)
      out["secondary"][f"D vs {ARMS[other]}"] = {"seeds": s2, "mean": sum(d) / len(d), "w": w, "p": p}
  if short is not None:
    s3 = [s for s in seeds if s in set(_paired(short, "feedback", "informative"))]
    if s3:
      x = [
        a - b
        for a, b in zip(
          _gap(table, "informative", "feedback", s3), _gap(short, "informative", "feedback", s3), strict=True
        )
      ]
      m, p = stats.sign_flip_greater(x)
      out["secondary"]["interaction"] = {"seeds": s3, "diffs": x, "mean": m, "p": p}
  names = list(out["secondary"])
  for name, adj in zip(names, stats.holm([out["secondary"][n]["p"] for n in names]), strict=True):
    out["secondary"][name]["p_holm"] = adj
  return out


MEASURES = {"m1": M1, "m2": "all_correct"}  # per-problem [sum, count]: M2 is all_correct's [0|1, 1]


def problem_matrix(records: list[dict], name: str) -> tuple[list[list[float]], list[list[float]]]:
  """([seeds][problems] sums, counts) of measure `name` from evaluation records (one per seed, each with
  its `problems`), on the problems every record has, in the first record's order."""
  by_seed = [dict(zip(r["problems"]["seed"], r["problems"][name], strict=True)) for r in records]
  common = [p for p in records[0]["problems"]["seed"] if all(p in b for b in by_seed)]
  return [[b[p][0] for p in common] for b in by_seed], [[b[p][1] for p in common] for b in by_seed]


def last_eval_cis(runs: dict, reference: dict | None = None, n_boot: int = 20000) -> dict:
  """{arm (and "reference"): {step, seeds, problems, m1: [est, lo, hi], m2: [...]}} at each run's last
  evaluation (the reference's only one), over the seeds whose records keep per-problem outcomes: the
  mean over seeds of each seed's rate, its CI resampling seeds and problems (`stats.two_level_ci`)."""
  groups = {
    arm: {s: r["evals"][-1] for s, r in by_seed.items() if r.get("evals")} for arm, by_seed in runs.items()
  }
  if reference:
    groups["reference"] = dict(reference)
  out = {}
  for arm, recs in groups.items():
    seeds = sorted((s for s, e in recs.items() if "problems" in e), key=int)
    if not seeds:
      continue
    records = [recs[s] for s in seeds]
    row = {"step": records[0]["step"], "seeds": seeds}
    for key, name in MEASURES.items():
      if all(name in e["problems"] for e in records):
        num, den = problem_matrix(records, name)
        row[key] = list(stats.two_level_ci(num, den, n_boot=n_boot))
        row["problems"] = len(num[0])
    out[arm] = row
  return out


def _ci_text(c: list[float]) -> str:
  return f"{c[0]:.3f} [{c[1]:.3f}, {c[2]:.3f}]"


def report(result: dict) -> list[str]:
  """The comparison as summary lines: each test's numbers and whether it reaches ALPHA."""
  lines = []
  pr = result.get("primary")
  if pr is None:
    return ["- primary (D vs B): no paired seeds yet"] + last_eval_lines(result.get("last_eval", {}))
  ok = pr["p"] <= ALPHA
  lines.append(
    f"- primary, M1 AUC of B − D over {len(pr['seeds'])} seeds: mean {pr['mean']:+.3f}, one-sided exact "
    f"Wilcoxon W+ = {pr['w']:.0f}, p = {pr['p']:.4f}: {'D ahead' if ok else 'not shown'} at {ALPHA}"
  )
  for name, t in result["secondary"].items():
    what = "the gap grows with K" if name == "interaction" else f"{name} (M1 AUC, other − D)"
    lines.append(
      f"- secondary, {what}: mean {t['mean']:+.3f}, p = {t['p']:.4f}, Holm p = {t['p_holm']:.4f}: "
      f"{'shown' if t['p_holm'] <= ALPHA else 'not shown'}"
    )
  r = result.get("ratio")
  if r:
    lines.append(
      f"- steps to M1 <= {THRESHOLD}, B / D: {r['ratio']:.2f} [95 % CI {r['lo']:.2f}, {r['hi']:.2f}] "
      f"(censored at the horizon: B {r['censored_b']}, D {r['censored_d']} of {len(r['m3_b'])} seeds)"
    )
  return lines + last_eval_lines(result.get("last_eval", {}))


def last_eval_lines(cis: dict) -> list[str]:
  """`last_eval_cis` as lines: per arm, M1 and M2 with their CIs over seeds × problems."""
  lines = []
  for arm, c in cis.items():
    name = "reference (SFT, rule in prompt)" if arm == "reference" else f"{ARMS.get(arm, '?')} {arm}"
    parts = [f"{k.upper()} {_ci_text(c[k])}" for k in MEASURES if k in c]
    lines.append(
      f"- {name}, step {c['step']}, {len(c['seeds'])} seeds × {c.get('problems', 0)} problems: "
      f"{', '.join(parts)} (95 % CI, seeds × problems)"
    )
  return lines


def markdown(table: dict, reference: dict | None = None) -> str:
  """Per seed and arm: M1 AUC / M1 final / M2 final / M3 (steps, `>` when censored); with `reference`
  ({seed: its evaluation record}) a last column: the reference policy's M1 / M2."""
  arms = [a for a in ARMS if a in table]
  reference = reference or {}
  seeds = sorted({s for a in arms for s in table[a]} | set(reference), key=int)
  head = "| seed | " + " | ".join(f"{ARMS[a]} {a}: M1 AUC / M1 / M2 / M3" for a in arms)
  head += " | reference (SFT, rule in prompt): M1 / M2 |" if reference else " |"
  rows = [head, "|---" * (len(arms) + 1 + bool(reference)) + "|"]

  def cell(r):
    m3 = f"{'>' if r['censored'] else ''}{r['m3']:.0f}"
    return f"{r['m1_auc']:.3f} / {r['m1_final']:.3f} / {r['m2_final']:.3f} / {m3}"

  def ref_cell(e):
    return f"{e[M1]:.3f} / {e['pass_rate']:.3f}" if e is not None and M1 in e else "–"

  for s in seeds:
    cells = [cell(table[a][s]) if s in table[a] else "–" for a in arms]
    cells += [ref_cell(reference.get(s))] if reference else []
    rows.append(f"| {s} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def ledger_rl(rcfg: configs.RLConfig, k: int, tokenizer: str) -> configs.RLConfig:
  """`rcfg` on the ledger env at K pairs, with the turns and cache slots a whole episode needs, and a
  teacher row for every rollout (at K = 12 nearly every rollout is flagged: with fewer rows the teacher
  would see only the first ones while the penalty arm sees them all)."""
  from composer_jax.rl.envs import ledger

  turns, slots = ledger.budget(k, chat.tokenizer(tokenizer), rcfg.max_turn_tokens)
  return dataclasses.replace(
    rcfg, env="ledger", ledger=dataclasses.replace(rcfg.ledger, k=k), max_turns=turns, cache_len=slots,
    feedback_rows=rcfg.problems_per_step * rcfg.group_size,
  )  # fmt: skip


def summary(
  runs: dict, short_results: str | None = None, reference: dict | None = None
) -> tuple[list[str], dict]:
  """The comparison of `runs` (with the interaction when the short-K results file is given, and the
  reference policy's evaluations {seed: record} when given) as summary lines, and its numbers."""
  table = per_seed(runs)
  short = None
  if short_results:
    short = per_seed(json.loads(pathlib.Path(short_results).read_text())["runs"])
  result = compare(table, short)
  result["last_eval"] = last_eval_cis(runs, reference)
  if reference:
    result["reference"] = {
      s: {k: e.get(k) for k in (M1, "pass_rate", "safe_accuracy")} for s, e in reference.items()
    }
  return ["", markdown(table, reference), "", *report(result)], result
