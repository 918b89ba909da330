"""The feedback gate: does the hinted teacher beat the student on the turns it would correct? Measured
before any RL: a teacher no better than the student has nothing to distil.

Shape suffixes: B batch (rows), T time, N tokens of a turn, V vocab.

  report = run(params, cfg, rcfg, gcfg, tok, meshes)   # rollouts -> flagged turns -> resamples -> G1..G5

On ≥ `gcfg.min_flagged` flagged turns (the first of each rollout, as the RL step uses), each turn is
resampled `gcfg.samples` times at the rollout temperature from four contexts that differ only in the
message inserted before it: none (the student), the detector's hint (the teacher), a neutral note (null
control), the hint with wrong content (`feedback.hint_for(variant=...)`). A sample is valid when the
environment accepts its call (`env.check`). Gates (thresholds in `configs.GateConfig`):

  G1  teacher − student valid rate ≥ g1, its 95 % CI above 0     the hint carries what the turn needs
  G2  |null − student| ≤ g2                                      form alone does not (no leakage by format)
  G3  teacher − wrong-content ≥ g3                               the hint's content is what it follows
  G4  at the decision token (where the sampled call leaves every valid call) the teacher gives the
      mistake less probability on ≥ g4 of the turns, and on the valid prefix before it the teacher's
      valid mass is not lower (mean difference ≥ −tolerance)    the signal points at the right token
      ("valid": syntactically, or by the calls the env names right for the turn, `turn_oracle`: the
      ledger's wrapping `fadd a b` leaves them at its `f`, where `add a b` was the right call)
  G5  flagged rollouts' reward ≤ unflagged − g5, g5_lo ≤ flagged share ≤ g5_hi
                                                                 the mistake costs, and is not rare nor all
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from composer_jax import model, sharding
from composer_jax.configs import GateConfig, RLConfig
from composer_jax.data.tokenizer import ByteTokenizer, Tokenizer
from composer_jax.rl import chat, feedback, sampler, stats
from composer_jax.rl.batch import bucket, feedback_rules
from composer_jax.rl.engine import KVCacheSampler
from composer_jax.rl.rollout import collect

TOK = chat.BYTE_TOKENIZER
CONDITIONS = ("student", "task", "null", "wrong")


# ---- the valid-call oracle -----------------------------------------------------------------------


def _int_prefix(s: str) -> bool:
  return s in ("", "-") or (s.lstrip("-").isdigit() and s.count("-") <= 1 and not s[1:].count("-"))


def call_prefix_ok(text: str, arity: dict[str, int]) -> bool:
  """Is `text` (the bytes after <|tool_call|>) a prefix of some call the environment accepts?"""
  words = text.split(" ")
  head, args = words[0], words[1:]
  if not args:
    return any(name.startswith(head) for name in arity)
  if head not in arity or len(args) > arity[head]:
    return False
  return all(a.lstrip("-").isdigit() for a in args[:-1]) and _int_prefix(args[-1])


def call_complete(text: str, arity: dict[str, int]) -> bool:
  words = text.split(" ")
  return (
    words[0] in arity
    and len(words) - 1 == arity[words[0]]
    and all(w.lstrip("-").isdigit() for w in words[1:])
  )


@dataclasses.dataclass(frozen=True)
class Syntax:
  """The syntactic oracle: any call of a known tool with its number of integer arguments is accepted."""

  arity: tuple[tuple[str, int], ...]

  def prefix_ok(self, text: str) -> bool:
    return call_prefix_ok(text, dict(self.arity))

  def complete(self, text: str) -> bool:
    return call_complete(text, dict(self.arity))


@dataclasses.dataclass(frozen=True)
class Calls:
  """An oracle that knows which calls are right at this turn (the environment says, e.g. the ledger: on
  the turn's operands, `add` and a `fadd` that does not wrap), so a call can be wrong by its meaning."""

  accepted: tuple[str, ...]

  def prefix_ok(self, text: str) -> bool:
    return any(c.startswith(text) for c in self.accepted)

  def complete(self, text: str) -> bool:
    return text in self.accepted


Oracle = Syntax | Calls


def _oracle(grammar: dict[str, int] | Oracle) -> Oracle:
  return Syntax(tuple(grammar.items())) if isinstance(grammar, dict) else grammar


def valid_next(prefix: Sequence[int], grammar: dict[str, int] | Oracle, tok: Tokenizer = TOK) -> list[int]:
  """Token ids that keep a turn's sampled prefix a prefix of an accepted call (a direct call: no prose).
  `grammar`: the tools' arity (the syntactic oracle) or an `Oracle`."""
  oracle = _oracle(grammar)
  open_id, close_id = tok.special_id("<|tool_call|>"), tok.special_id("<|/tool_call|>")
  if not prefix:
    return [open_id]
  if prefix[0] != open_id or any(tok.is_special(i) for i in prefix[1:]):  # type: ignore[attr-defined]
    return []
  text = tok.decode(list(prefix[1:]))
  out = [i for i, piece in _pieces(tok) if oracle.prefix_ok(text + piece)]
  return out + [close_id] * oracle.complete(text)


@functools.cache
def _pieces(tok: Tokenizer) -> tuple[tuple[int, str], ...]:
  """(id, text) of every non-special token that could appear in a call: printable ASCII bytes for the
  byte-level tokenizer, every vocabulary entry's decoded text for a checkpoint's."""
  if isinstance(tok, ByteTokenizer):
    return tuple((b, chr(b)) for b in range(32, 127))
  ids = (i for i in range(tok.vocab_size) if not tok.is_special(i))  # type: ignore[attr-defined]
  return tuple((i, s) for i in ids if (s := tok.decode([i])) and "\ufffd" not in s)


def decision_index(ids: Sequence[int], grammar: dict[str, int] | Oracle, tok: Tokenizer = TOK) -> int | None:
  """Index of the first token of a sampled turn that leaves every accepted call (None: it never does)."""
  oracle = _oracle(grammar)
  for i, t in enumerate(ids):
    if t not in valid_next(ids[:i], oracle, tok):
      return i
  return None


def turn_oracle(env: Any, ids: Sequence[int], tok: Tokenizer = TOK) -> Oracle:
  """The oracle for a sampled turn `ids` of `env`'s episode: the calls the environment names as right for
  that turn when it can (`env.right_calls(call)`: the ledger, whose wrapping `fadd` is well-formed but
  wrong), else the syntactic one from the tools' arity."""
  right = getattr(env, "right_calls", None)
  if right is not None:
    calls = right(chat.parse_tool_call(list(ids), tok))
    if calls is not None:
      return Calls(tuple(calls))
  return Syntax(tuple(env.info()["arity"]))


# ---- flagged turns and their contexts ------------------------------------------------------------


@dataclasses.dataclass
class Flagged:
  traj: chat.Trajectory
  env: Any
  k: int
  kind: str
  hints: dict[str, list[int]]  # condition -> message ids inserted before turn k ([] for the student)

  def context(self, condition: str) -> list[int]:
    s = self.traj.spans[self.k][0]  # turn k starts with its <|assistant|> header
    return self.traj.tokens[:s] + self.hints[condition] + [self.traj.tokens[s]]


def collect_flagged(
  params: Any, cfg: model.ModelConfig, rcfg: RLConfig, gcfg: GateConfig, tok: Tokenizer, meshes: Any = None
):
  """Rollouts of fresh problems (seeds from `gcfg.seed`) until ≥ min_flagged first-flagged turns.
  Returns (all trajectories, their envs, the Flagged list)."""
  from composer_jax.rl.envs import factories

  rules = feedback_rules(rcfg)
  engine = KVCacheSampler(cfg, rcfg, tok, meshes)
  engine.update_weights(params)
  trajs, env_all, flagged = [], [], []
  for i in range(gcfg.max_batches):
    env_list, seeds = factories.fixed_set(rcfg, gcfg.rollouts_per_batch, seed=gcfg.seed + i)
    batch = collect(engine, env_list, seeds, jax.random.key(gcfg.seed + i), rcfg, tok)
    for traj, env in zip(batch, env_list, strict=True):
      found = feedback.detect(traj, env.info(), rules, tok) if traj.status != chat.FAILED else []
      if found:
        k, kind = found[0]
        hints = {"student": []} | {
          v: feedback.hint_ids(feedback.hint_at(traj, k, kind, env.info(), rules, variant=v, tok=tok), tok)
          for v in ("task", "null", "wrong")
        }
        flagged.append(Flagged(traj, env, k, kind, hints))
    trajs += batch
    env_all += env_list
    logging.info("[gate] batch %d: %d rollouts, %d flagged turns so far", i + 1, len(trajs), len(flagged))
    if len(flagged) >= gcfg.min_flagged:
      break
  return trajs, env_all, flagged


# ---- resampling ------------------------------------------------------------------------------------


def _padded(rows: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  toks_BT = np.zeros((len(rows), width), np.int32)
  for b, r in enumerate(rows):
    toks_BT[b, : len(r)] = r
  return toks_BT, np.array([len(r) for r in rows], np.int32)


def resample_valid(
  params: Any, cfg: model.ModelConfig, rcfg: RLConfig, contexts: Sequence[list[int]], envs: Sequence[Any],
  samples: int, key: jax.Array, tok: Tokenizer, meshes: Any = None, chunk: int = 256,
) -> np.ndarray:  # fmt: skip
  """[len(contexts), samples] bool: does `envs[i]` accept the call of a turn sampled after context i?"""
  rows = [(i, c) for i, c in enumerate(contexts) for _ in range(samples)]
  P = bucket(max(len(c) for c in contexts), 64)
  N = rcfg.max_turn_tokens
  ok = np.zeros(len(rows), bool)
  for start in range(0, len(rows), chunk):
    part = rows[start : start + chunk]
    part += [part[-1]] * (chunk - len(part))  # one shape per P bucket
    toks, lens = _padded([c for _, c in part], P)
    out = sampler.sample(
      params, cfg, toks, lens, jax.random.fold_in(key, start), max_new_tokens=N, temperature=rcfg.temperature,
      top_k=rcfg.top_k, stop_tokens=chat.stop_ids(tok), pad_id=tok.pad_id, meshes=meshes,
    )  # fmt: skip
    ids_BN, n_B = sharding.host((out.tokens, out.lengths))
    for b in range(min(chunk, len(rows) - start)):
      call = chat.parse_tool_call(ids_BN[b, : int(n_B[b])].tolist(), tok)
      ok[start + b] = envs[part[b][0]].check(call) == ""
  return ok.reshape(len(contexts), samples)


# ---- the decision token ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg", "meshes"))
def _log_softmax(params: Any, cfg: model.ModelConfig, tokens_BT: jax.Array, meshes: Any = None) -> jax.Array:
  logits_BTV = model.apply(params, cfg, tokens_BT, meshes=meshes)[0]
  return jax.nn.log_softmax(logits_BTV.astype(jnp.float32), -1)


def _logp_rows(
  params: Any, cfg: model.ModelConfig, rows: Sequence[Sequence[int]], meshes: Any = None, chunk: int = 64
) -> list:
  """log-softmax [len(row), V] of every row (float32, numpy), in padded chunks."""
  T = bucket(max(len(r) for r in rows), 64)
  out = []
  for start in range(0, len(rows), chunk):
    part = list(rows[start : start + chunk])
    toks, lens = _padded(part + [part[-1]] * (chunk - len(part)), T)
    logp_BTV = sharding.host(_log_softmax(params, cfg, jnp.asarray(toks), meshes))
    out += [logp_BTV[b, : int(lens[b])] for b in range(len(part))]
  return out


def decision_points(flagged: Sequence[Flagged], tok: Tokenizer = TOK) -> list[tuple]:
  """(flagged turn, positions of its sampled tokens, their ids, decision index, oracle) for each flagged
  turn that has a decision token under its oracle (`turn_oracle`)."""
  items = []
  for f in flagged:
    s, e = f.traj.spans[f.k]
    pos = [p for p in range(s, e) if f.traj.loss_mask[p]]
    ids = [f.traj.tokens[p] for p in pos]
    oracle = turn_oracle(f.env, ids, tok)
    j = decision_index(ids, oracle, tok)
    if j is not None:
      items.append((f, pos, ids, j, oracle))
  return items


def decision_stats(
  params: Any, cfg: model.ModelConfig, flagged: Sequence[Flagged], tok: Tokenizer = TOK, meshes: Any = None
) -> list[dict]:
  """Per flagged turn with a decision token j: p(mistake) under student and teacher, valid mass at j
  and on the valid prefix (positions < j) under both."""
  items = decision_points(flagged, tok)
  if not items:
    return []
  student = _logp_rows(
    params, cfg, [f.traj.tokens[:e] for f, *_ in items for e in [f.traj.spans[f.k][1]]], meshes
  )
  teacher_rows = [feedback.teacher_inputs(f.traj, f.k, f.hints["task"]).tokens.tolist() for f, *_ in items]
  teacher = _logp_rows(params, cfg, teacher_rows, meshes)
  out = []
  for (f, pos, ids, j, oracle), ls, lt in zip(items, student, teacher, strict=True):
    sh = len(f.hints["task"])

    def mass(lp, i, shift, pos=pos, ids=ids, oracle=oracle):
      """Probability of the tokens that keep the prefix ids[:i] valid, at the position predicting ids[i]."""
      return float(np.exp(lp[pos[i] - 1 + shift, valid_next(ids[:i], oracle, tok)]).sum())

    out.append({
      "kind": f.kind,
      "p_student": float(np.exp(ls[pos[j] - 1, ids[j]])),
      "p_teacher": float(np.exp(lt[pos[j] - 1 + sh, ids[j]])),
      "valid_student": mass(ls, j, 0),
      "valid_teacher": mass(lt, j, sh),
      "prefix_gap": float(np.mean([mass(lt, i, sh) - mass(ls, i, 0) for i in range(j)])) if j else 0.0,
    })  # fmt: skip
  return out


# ---- the report ----------------------------------------------------------------------------------------


def _ci(x: Sequence[float]) -> dict:
  m, lo, hi = stats.mean_ci(x)
  return {"mean": m, "lo": lo, "hi": hi, "n": len(x)}


def _fmt(c: dict) -> str:
  return f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"


def _g4(decisions: list[dict], g: GateConfig) -> tuple[bool, str, dict]:
  lowered = float(np.mean([d["p_teacher"] < d["p_student"] for d in decisions])) if decisions else 0.0
  prefix = float(np.mean([d["prefix_gap"] for d in decisions])) if decisions else 0.0
  ok = bool(decisions) and lowered >= g.g4_min_share and prefix >= -g.g4_prefix_tol
  why = (
    f"mistake token lowered on {lowered:.2f} of {len(decisions)} turns (need >= {g.g4_min_share}); "
    f"valid-prefix mass teacher - student {prefix:+.4f} (need >= -{g.g4_prefix_tol})"
  )
  return ok, why, {"lowered": lowered, "prefix_gap": prefix, "n": len(decisions)}


def _g5(trajs: list, flagged_rows: set, g: GateConfig) -> tuple[bool, str, dict]:
  rewards = np.array([t.reward for t in trajs])
  is_f = np.array([i in flagged_rows for i in range(len(trajs))])
  share = float(is_f.mean())
  r_f = float(rewards[is_f].mean()) if is_f.any() else float("nan")
  r_u = float(rewards[~is_f].mean()) if (~is_f).any() else float("nan")
  lo, hi = g.g5_share
  ok = lo <= share <= hi and r_f <= r_u - g.g5_min_gap
  why = (
    f"{share:.2f} of {len(trajs)} rollouts flagged (need {lo}-{hi}); reward flagged {r_f:+.3f} vs "
    f"unflagged {r_u:+.3f} (need <= unflagged - {g.g5_min_gap})"
  )
  return ok, why, {"share": share, "reward_flagged": r_f, "reward_unflagged": r_u}


def evaluate(
  valid: dict[str, np.ndarray], decisions: list[dict], trajs: list, flagged_rows: set, g: GateConfig
):
  """G1..G5 from per-turn valid rates (condition -> [F]), decision stats and the rollouts (indices of
  the flagged ones in `flagged_rows`)."""
  g1 = _ci(valid["task"] - valid["student"])
  g2 = _ci(valid["null"] - valid["student"])
  g3 = _ci(valid["task"] - valid["wrong"])
  gates = {
    "G1": (
      g1["mean"] >= g.g1_min_gain and g1["lo"] > 0,
      f"teacher - student valid rate {_fmt(g1)} (need >= {g.g1_min_gain} with the CI above 0)",
      g1,
    ),
    "G2": (abs(g2["mean"]) <= g.g2_max_gap, f"null - student {_fmt(g2)} (need |.| <= {g.g2_max_gap})", g2),
    "G3": (g3["mean"] >= g.g3_min_drop, f"teacher - wrong-content {_fmt(g3)} (need >= {g.g3_min_drop})", g3),
    "G4": _g4(decisions, g),
    "G5": _g5(trajs, flagged_rows, g),
  }
  out: dict[str, Any] = {"valid_rate": {c: float(np.mean(x)) for c, x in valid.items()}}
  out["gates"] = {k: {"pass": bool(p), "why": why, **num} for k, (p, why, num) in gates.items()}
  out["passed"] = all(x["pass"] for x in out["gates"].values())
  if decisions:
    out["decision"] = {
      k: float(np.mean([d[k] for d in decisions]))
      for k in ("p_student", "p_teacher", "valid_student", "valid_teacher", "prefix_gap")
    }
  return out


def run(
  params: Any, cfg: model.ModelConfig, rcfg: RLConfig, gcfg: GateConfig, tok: Tokenizer, meshes: Any = None
) -> dict:
  """Collect, resample, score the decision tokens and evaluate the gates (see the module docstring)."""
  trajs, envs, flagged = collect_flagged(params, cfg, rcfg, gcfg, tok, meshes)
  if not flagged:
    return {"passed": False, "flagged": 0, "rollouts": len(trajs), "gates": {}, "why": "no flagged turn"}
  contexts = [f.context(c) for c in CONDITIONS for f in flagged]
  ok = resample_valid(
    params, cfg, rcfg, contexts, [f.env for _ in CONDITIONS for f in flagged], gcfg.samples,
    jax.random.key(gcfg.seed), tok, meshes,
  )  # fmt: skip
  F = len(flagged)
  valid = {c: ok[i * F : (i + 1) * F].mean(1) for i, c in enumerate(CONDITIONS)}
  decisions = decision_stats(params, cfg, flagged, tok, meshes)
  rows = {id(f.traj) for f in flagged}
  report = evaluate(valid, decisions, trajs, {i for i, t in enumerate(trajs) if id(t) in rows}, gcfg)
  kinds = sorted({f.kind for f in flagged})
  report["per_kind"] = {
    k: {c: float(np.mean([valid[c][i] for i, f in enumerate(flagged) if f.kind == k])) for c in CONDITIONS}
    | {"n": sum(f.kind == k for f in flagged)}
    for k in kinds
  }
  report |= {"flagged": F, "rollouts": len(trajs), "samples": gcfg.samples}
  for name, gate in report["gates"].items():
    logging.info("[gate] %s %s: %s", name, "pass" if gate["pass"] else "FAIL", gate["why"])
  return report
