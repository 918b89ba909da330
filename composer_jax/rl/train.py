"""The RL loop: lockstep multi-turn rollouts → rewards → advantages → feedback → one jitted Muon step.

Shape suffixes: B batch (rollouts), T time (trajectory tokens), L teacher tokens (hint + turn), V vocab.

  trajs = collect(params, cfg, envs, seeds, key, rcfg)          # KV-cache sampler, lockstep over turns
  batch = rl_batch(trajs, group_ids, infos, rcfg)                # padded arrays (+ feedback arrays)
  state, m = step(state, batch)                                  # make_rl_step(..., feedback=True/False)

Rollouts (`collect`): one cache for the whole batch; each turn appends every live row's new tokens
(observation, then the <|assistant|> header) with `sampler.extend` and samples the turn with
`sampler.decode(feed_last=True)` until a stop token (`chat.stop_ids()`); `envs.advance` executes the
call. A row whose env raises is marked failed (reward 0) by `envs`; the batch goes on.

The step (notes/rl.md §5): loss = RL loss / its count + λ · feedback loss / its count.
- RL: `policy_loss(logp, sg(logp), adv, mask, objective, sampler_logp)` — one update per batch, so π_old
  is the trainer's own recompute (ratio 1, clip fraction 0) and the sampler/trainer mismatch is corrected
  by truncated IS against the sampler's logprobs (the raw T=1 model logprobs the sampler recorded).
- Feedback: at most one turn per trajectory (the first one `feedback.detect` flags: the earliest
  mistake is the one that derails the rest). The student forward runs with a KV cache; the teacher reuses
  it: stop-gradient, slots at positions ≥ the turn's start hidden (segment id 0), then `sampler.extend`
  with hint + turn k's tokens. The teacher computes |hint| + |turn| tokens, not the whole prefix.
  Teacher logits at column j predict teacher token j+1; they are gathered onto the student's columns
  t = p - 1 for each sampled token p of turn k (column p - 1 + |hint| - start in the teacher's extension).
- λ = 0 compiles a step without the teacher; a batch with no detected turn has an all-zero feedback
  mask, so the term is exactly 0.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from composer_jax import model
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.rl import chat, envs, feedback, sampler
from composer_jax.rl.divergence import feedback_loss
from composer_jax.rl.objectives import advantages, groups_with_signal, policy_loss, policy_metrics
from composer_jax.train import metrics as metrics_lib
from composer_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class RLConfig:
  env: str = "toy"  # "toy" | "coding"
  steps: int = 20
  problems_per_step: int = 8
  group_size: int = 8  # rollouts per problem (one group = one problem seed)
  objective: str = "drgrpo"  # objectives.OBJECTIVES
  advantage: str = "drgrpo"  # objectives.ADVANTAGE_KINDS
  lambda_feedback: float = 0.0
  divergence: str = "reverse_kl"  # divergence.KINDS
  divergence_top_k: int = 0  # 0: full vocabulary
  feedback_kinds: str = ""  # comma-separated feedback.KINDS to act on; "" = FeedbackRules' default set
  # "loss": + λ·D(student‖teacher) / its own token count (the issue's form); "advantage": the sampled-token
  # estimate λ·sg(log q − log p) added to those tokens' advantages, inside the RL loss and its normaliser.
  feedback_mode: str = "loss"
  teacher: str = "live"  # "live": the current weights, reusing the student's prefix KV; "ema": an EMA copy
  teacher_ema_rate: float = 0.05  # teacher ← (1 − rate)·teacher + rate·params after each step
  dynamic_sampling: bool = False  # DAPO: groups whose rewards are all equal leave the policy loss
  eval_every: int = 0  # > 0: `fit`'s `evaluate` on a fixed problem set at step 0 and every N steps
  eval_problems: int = 64
  lr: float = 3e-4
  warmup_steps: int = 0  # linear lr warm-up: the first steps of a fresh Adam/Muon state are the largest
  temperature: float = 1.0
  top_k: int = 0  # sampler top-k; 0 off
  max_turns: int = 6
  max_turn_tokens: int = 24  # sampled tokens per assistant turn
  cache_len: int = 768  # sampler cache slots (shared write index: Σ over turns of the longest row)
  tis_cap: float = 2.0
  seed: int = 0
  log_every: int = 1
  checkpoint_every: int = 10
  keep_checkpoints: int = 1
  router_bias_rate: float = 1e-3
  # R3 (arXiv 2510.11370): record the sampler's experts per token and replay them in the training forward.
  routing_replay: bool = False


_RULES = feedback.FeedbackRules()


def bucket(n: int, minimum: int) -> int:
  """The smallest power of two ≥ max(n, minimum): a handful of shapes, so a handful of compilations."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


# --- rollouts ----------------------------------------------------------------------------------


def collect(
  params: Any,
  cfg: model.ModelConfig,
  env_list: Sequence[envs.Env],
  seeds: Sequence[int],
  key: jax.Array,
  rcfg: RLConfig,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> list[chat.Trajectory]:
  """One episode per (env, seed), all rows in lockstep through one KV cache. Never raises for one row."""
  B = len(env_list)
  trajs = [envs.begin(env, s, tok) for env, s in zip(env_list, seeds, strict=True)]
  header = chat.role_token_id(chat.ASSISTANT, tok)
  live = [t.status != chat.FAILED for t in trajs]
  cached = [0] * B  # tokens of trajs[b] already in the cache (the same ids, in order)
  routed = [[] for _ in range(B)]  # routing replay: experts of those cached tokens, chunks [n, L_moe, K]
  N = rcfg.max_turn_tokens
  cache = model.init_cache(cfg, B, rcfg.cache_len)
  index = 0
  stops = sampler.settings(rcfg.temperature, rcfg.top_k, 1.0, chat.stop_ids(tok), tok.pad_id)
  for turn in range(rcfg.max_turns):
    if not any(live):
      break
    deltas = [trajs[b].tokens[cached[b] :] + [header] if live[b] else [] for b in range(B)]
    T = bucket(max(len(d) for d in deltas), 16)
    if index + T + N > rcfg.cache_len:  # the context is full: the rows still going are truncated
      for b in range(B):
        if live[b]:
          trajs[b].status, trajs[b].reason = chat.TRUNCATED, f"cache_len {rcfg.cache_len}"
      break
    toks_BT = np.zeros((B, T), np.int32)
    lens_B = np.zeros((B,), np.int32)
    for b, d in enumerate(deltas):
      toks_BT[b, : len(d)], lens_B[b] = d, len(d)
    logits_BTV, cache, *ext_routed = sampler.extend(
      params, cfg, cache, toks_BT, lens_B, with_routing=rcfg.routing_replay
    )
    keys = jax.random.split(jax.random.fold_in(key, turn), B)
    out = sampler.decode(
      params,
      cfg,
      cache,
      sampler.last_logits(logits_BTV, jnp.asarray(lens_B)),
      keys,
      jnp.asarray(np.where(lens_B > 0, N, 0), jnp.int32),
      *stops,
      max_new_tokens=N,
      feed_last=jnp.asarray(True),
    )
    cache = out.cache
    ids_BN, lp_BN, n_B, index = jax.device_get((out.tokens, out.logprobs, out.lengths, out.cache["index"]))
    index = int(index)
    if rcfg.routing_replay:  # feed_last: every sampled token was fed, so its experts are known
      ext_BTLK, dec_BNLK = jax.device_get((ext_routed[0], out.routed_experts))
    for b in range(B):
      if not live[b]:
        continue
      n = int(n_B[b])
      cached[b] += len(deltas[b]) + n
      if rcfg.routing_replay:
        routed[b] += [ext_BTLK[b, : len(deltas[b])], dec_BNLK[b, :n]]
      if envs.advance(
        env_list[b],
        trajs[b],
        ids_BN[b, :n].tolist(),
        lp_BN[b, :n].tolist(),
        max_turns=rcfg.max_turns,
        tok=tok,
      ):
        live[b] = False
  for b in range(B):
    if live[b] and trajs[b].status == chat.COMPLETED:
      trajs[b].status, trajs[b].reason = chat.TRUNCATED, f"max_turns {rcfg.max_turns}"
    envs.finish(env_list[b], trajs[b])
    if rcfg.routing_replay:
      trajs[b].routed_experts = _routed_rows(routed[b], len(trajs[b]), cfg)
  return trajs


def _routed_rows(chunks: list[np.ndarray], n_tokens: int, cfg: model.ModelConfig) -> np.ndarray:
  """The experts of a trajectory's tokens [n_tokens, L_moe, K] (int16), aligned with its tokens: row t is
  the routing computed when token t was the model's input. Tokens never fed (those appended after
  the last decode) get -1, which the replaying forward reads as "route yourself"."""
  out = np.full((n_tokens, cfg.n_moe_layers, cfg.top_k), -1, np.int16)
  fed = np.concatenate(chunks)[:n_tokens] if chunks else out[:0]
  out[: len(fed)] = fed
  return out


def rollout_stats(trajs: Sequence[chat.Trajectory]) -> dict[str, float]:
  """Mean reward, pass rate (reward ≥ 1), invalid-call rate (invalid calls ÷ calls), failed rollouts."""
  calls = sum(t.info.get("turns", 0) for t in trajs)
  invalid = sum(t.info.get("invalid_calls", 0) for t in trajs)
  return {
    "reward": float(np.mean([t.reward for t in trajs])),
    "pass_rate": float(np.mean([t.reward >= 1.0 for t in trajs])),
    "invalid_call_rate": invalid / max(calls, 1),
    "turns_per_rollout": calls / max(len(trajs), 1),
    "failed_rollouts": float(sum(t.status == chat.FAILED for t in trajs)),
    "truncated_rollouts": float(sum(t.status == chat.TRUNCATED for t in trajs)),
    "tokens_per_rollout": float(np.mean([len(t) for t in trajs])),
  }


# --- batches -----------------------------------------------------------------------------------


def feedback_arrays(
  trajs: Sequence[chat.Trajectory],
  infos: Sequence[dict],
  pad_to: int,
  rules: feedback.FeedbackRules = _RULES,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> dict[str, np.ndarray]:
  """Teacher inputs for the flagged rows only: F = bucket(#flagged, 4) teacher rows, padding rows empty.

  fb_rows [F] (the batch row each teacher row belongs to; padding: 0), teacher_tokens [F, L] (hint +
  turn k, right-padded), teacher_lengths [F] (0: padding), hint_start [F] (student slots ≥ it are hidden
  from the teacher; `pad_to` hides nothing), fb_cols [F, N] (student column t = p - 1 of each sampled
  token p of turn k), teacher_cols [F, N] (the extension column aligned with it), fb_mask [F, N].
  The teacher and the divergence then cost F·(L + N) positions instead of B·T.
  """
  rows = []
  for b, (traj, info) in enumerate(zip(trajs, infos, strict=True)):
    found = feedback.detect(traj, info, rules, tok) if traj.status != chat.FAILED else []
    if not found:
      continue
    k, kind = found[0]
    t = feedback.teacher_inputs(traj, k, feedback.hint_ids(feedback.hint_for(kind, info, rules), tok))
    if len(t.student_positions):
      rows.append((b, t))
  F = bucket(len(rows), 4)
  L = bucket(max([len(t.tokens) - t.hint_start for _, t in rows], default=1), 32)
  N = bucket(max([len(t.student_positions) for _, t in rows], default=1), 16)
  out = {
    "fb_rows": np.zeros((F,), np.int32),
    "teacher_tokens": np.zeros((F, L), np.int32),
    "teacher_lengths": np.zeros((F,), np.int32),
    "hint_start": np.full((F,), pad_to, np.int32),
    "fb_cols": np.zeros((F, N), np.int32),
    "teacher_cols": np.zeros((F, N), np.int32),
    "fb_mask": np.zeros((F, N), np.float32),
  }
  for f, (b, t) in enumerate(rows):
    ext = t.tokens[t.hint_start :]
    n = len(t.student_positions)
    out["fb_rows"][f] = b
    out["teacher_tokens"][f, : len(ext)] = ext
    out["teacher_lengths"][f] = len(ext)
    out["hint_start"][f] = t.hint_start
    out["fb_cols"][f, :n] = t.student_positions - 1
    out["teacher_cols"][f, :n] = t.teacher_positions - 1 - t.hint_start
    out["fb_mask"][f, :n] = 1.0
  return out


def rl_batch(
  trajs: Sequence[chat.Trajectory],
  group_ids: Sequence[int],
  infos: Sequence[dict] | None = None,
  *,
  with_feedback: bool = False,
  rules: feedback.FeedbackRules = _RULES,
  tok: Tokenizer = chat.BYTE_TOKENIZER,
) -> dict[str, np.ndarray]:
  """`chat.to_arrays` (padded to a power of two) + group ids (+ `feedback_arrays` when asked).

  Trajectories that carry `routed_experts` (collected with routing_replay) add routed_experts
  [B, T, MoE layers, top_k] int16, -1 on padding and wherever unknown (the forward routes those itself).
  """
  pad_to = bucket(max(len(t) for t in trajs), 64)
  a = chat.to_arrays(trajs, pad_to, tok.pad_id)
  batch = {
    k: a[k] for k in ("tokens", "positions", "segment_ids", "loss_mask", "sampler_logprobs", "rewards")
  }
  batch["group_ids"] = np.asarray(group_ids, np.int32)
  recorded = [t.routed_experts for t in trajs if t.routed_experts is not None]
  if recorded:
    routed_BTLK = np.full((len(trajs), pad_to, *recorded[0].shape[1:]), -1, np.int16)
    for b, t in enumerate(trajs):
      if t.routed_experts is not None:
        routed_BTLK[b, : len(t.routed_experts)] = t.routed_experts
    batch["routed_experts"] = routed_BTLK
  if with_feedback:
    batch |= feedback_arrays(trajs, infos, pad_to, rules, tok)
  return batch


# --- the step ----------------------------------------------------------------------------------


def token_logp(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """log p(token t | < t) aligned with tokens (column 0 is 0), float32 [B, T]."""
  logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(logp_BT, ((0, 0), (1, 0)))


def student_forward(
  params: Any, cfg: model.ModelConfig, batch: dict, extra_slots: int, routed_experts: jax.Array | None = None
) -> tuple[jax.Array, dict]:
  """The training forward over the padded trajectories, with a cache of T + extra_slots slots that
  holds every position's latents afterwards (aux["cache"]). Logits equal the cache-free forward.
  routed_experts: the routing to replay, in `model.apply`'s layout (see `replayed_experts`)."""
  B, T = batch["tokens"].shape
  return model.apply(
    params,
    cfg,
    batch["tokens"],
    batch["positions"],
    model.init_cache(cfg, B, T + extra_slots),
    segment_ids=batch["segment_ids"],
    routed_experts=routed_experts,
  )


def replayed_experts(batch: dict, rcfg: RLConfig) -> jax.Array | None:
  """The sampler's experts as `model.apply(routed_experts=)` takes them, [L_moe, B, T, K]; None
  unless routing_replay (R3, arXiv 2510.11370: the training forward uses the inference engine's
  experts; the router still learns through the combine weights)."""
  if not rcfg.routing_replay:
    return None
  if "routed_experts" not in batch:
    raise ValueError("routing_replay needs batch['routed_experts'] (collect with routing_replay=True).")
  return jnp.moveaxis(jnp.asarray(batch["routed_experts"]), 2, 0)


_CACHE_BATCH_AXIS = {"positions": 0, "segments": 0, "latent": 1, "k_rope": 1}  # model.init_cache's layout


def cache_rows(cache: dict, rows: jax.Array) -> dict:
  """The cache of the given batch rows; the shared write index is unchanged."""
  return {k: v if k == "index" else jnp.take(v, rows, axis=_CACHE_BATCH_AXIS[k]) for k, v in cache.items()}


def teacher_logits(
  params: Any, cfg: model.ModelConfig, student_cache: dict, batch: dict, teacher_params: Any = None
) -> jax.Array:
  """Teacher logits [F, N, V] of the flagged rows, aligned with `fb_cols` (meaningful where fb_mask is 1).

  Live teacher (`teacher_params` None): the current weights with the student's prefix KV of those rows
  (stop-gradient) — the prefix is never recomputed. EMA teacher: other weights, so it encodes the rows
  itself first. Then student slots at positions ≥ hint_start are hidden (segment 0) and hint + turn k's
  tokens are appended at the cache's write index (position hint_start onwards, which `sampler.extend`
  derives from the visible slots)."""
  rows_F = batch["fb_rows"]
  T, L = batch["tokens"].shape[1], batch["teacher_tokens"].shape[1]
  if teacher_params is None:
    params = jax.lax.stop_gradient(params)
    cache = cache_rows(jax.lax.stop_gradient(student_cache), rows_F)
  else:
    params = jax.lax.stop_gradient(teacher_params)
    rows = {k: batch[k][rows_F] for k in ("tokens", "positions", "segment_ids")}
    _, aux = student_forward(params, cfg, rows, L)
    cache = aux["cache"]
  slot_S = jnp.arange(cache["segments"].shape[1])
  hide_FS = (slot_S[None, :] >= batch["hint_start"][:, None]) & (slot_S[None, :] < T)
  cache = {**cache, "segments": jnp.where(hide_FS, sampler.PAD_SEGMENT, cache["segments"])}
  logits_FLV, _ = sampler.extend(params, cfg, cache, batch["teacher_tokens"], batch["teacher_lengths"])
  aligned_FNV = jnp.take_along_axis(logits_FLV, batch["teacher_cols"][:, :, None], axis=1)
  return jax.lax.stop_gradient(aligned_FNV)


def student_feedback_logits(logits_BTV: jax.Array, batch: dict) -> jax.Array:
  """The student's logits at the feedback columns, [F, N, V] (differentiable)."""
  return logits_BTV[batch["fb_rows"][:, None], batch["fb_cols"]]


def feedback_advantages(t_logits_FNV: jax.Array, logp_BT: jax.Array, batch: dict, lam: float) -> jax.Array:
  """λ·sg(log q(y_t) − log p(y_t)) on turn k's sampled tokens y_t, 0 elsewhere, [B, T] aligned with tokens.

  The sampled-token form of the reverse KL's gradient (E_y~p[sg(log p − log q)·∇log p] = ∇KL(p‖q),
  notes/rl.md §1, on-policy distillation): as an advantage it shares the RL loss's normaliser and clip,
  so its weight against the policy gradient does not depend on how many tokens were flagged."""
  rows_F1, tok_FN = batch["fb_rows"][:, None], batch["fb_cols"] + 1
  y_FN = batch["tokens"][rows_F1, tok_FN]
  logq_FN = jnp.take_along_axis(jax.nn.log_softmax(t_logits_FNV.astype(jnp.float32), -1), y_FN[..., None], -1)
  logp_FN = jax.lax.stop_gradient(logp_BT)[rows_F1, tok_FN]
  delta_FN = jnp.where(batch["fb_mask"] > 0, lam * (logq_FN[..., 0] - logp_FN), 0.0)
  return jnp.zeros_like(logp_BT).at[rows_F1, tok_FN].add(jax.lax.stop_gradient(delta_FN))


def rl_loss(
  params: Any,
  cfg: model.ModelConfig,
  batch: dict,
  rcfg: RLConfig,
  with_feedback: bool,
  teacher_params: Any = None,
):
  """(total loss, metrics as (sum, count) pairs). `teacher_params`: the EMA teacher (None: live)."""
  mask_BT = batch["loss_mask"]
  if with_feedback:
    logits_BTV, aux = student_forward(
      params, cfg, batch, batch["teacher_tokens"].shape[1], replayed_experts(batch, rcfg)
    )
    t_logits_FNV = teacher_logits(params, cfg, aux["cache"], batch, teacher_params)
    top_k = rcfg.divergence_top_k or None
    fb_sum, fb_count = feedback_loss(
      student_feedback_logits(logits_BTV, batch),
      t_logits_FNV,
      batch["fb_mask"],
      kind=rcfg.divergence,
      top_k=top_k,
    )
  else:
    logits_BTV, aux = model.apply(
      params,
      cfg,
      batch["tokens"],
      batch["positions"],
      segment_ids=batch["segment_ids"],
      routed_experts=replayed_experts(batch, rcfg),
    )
    fb_sum = fb_count = jnp.zeros((), jnp.float32)
  logp_BT = token_logp(logits_BTV, batch["tokens"])
  adv_B = advantages(batch["rewards"], batch["group_ids"], kind=rcfg.advantage)
  adv, fb_weight = adv_B, rcfg.lambda_feedback
  keep_B = jnp.ones_like(adv_B, dtype=bool)
  if rcfg.dynamic_sampling:
    keep_B = groups_with_signal(batch["rewards"], batch["group_ids"])
  m = {}
  if with_feedback and rcfg.feedback_mode == "advantage":
    fb_adv_BT = feedback_advantages(t_logits_FNV, logp_BT, batch, rcfg.lambda_feedback)
    adv, fb_weight = adv_B[:, None] + fb_adv_BT, 0.0
    keep_B = keep_B | jnp.zeros_like(keep_B).at[batch["fb_rows"]].max(batch["teacher_lengths"] > 0)
    m["feedback_advantage"] = (jnp.sum(fb_adv_BT), fb_count)
  mask_BT = mask_BT * keep_B[:, None]
  kw = dict(objective=rcfg.objective, sampler_logp=batch["sampler_logprobs"], tis_cap=rcfg.tis_cap)
  max_len = rcfg.max_turns * rcfg.max_turn_tokens  # Dr. GRPO's constant normaliser: the token budget
  pl_sum, pl_count = policy_loss(logp_BT, jax.lax.stop_gradient(logp_BT), adv, mask_BT, max_len=max_len, **kw)
  loss = pl_sum / jnp.maximum(pl_count, 1.0) + fb_weight * fb_sum / jnp.maximum(fb_count, 1.0)
  m |= policy_metrics(logp_BT, jax.lax.stop_gradient(logp_BT), adv, mask_BT, **kw)
  m_BT = mask_BT > 0
  n = jnp.sum(m_BT).astype(jnp.float32)
  logp_all_BTV = jax.nn.log_softmax(jax.lax.stop_gradient(logits_BTV[:, :-1]).astype(jnp.float32), axis=-1)
  ent_BT = jnp.pad(-jnp.sum(jnp.exp(logp_all_BTV) * logp_all_BTV, axis=-1), ((0, 0), (1, 0)))
  m["entropy"] = (jnp.sum(jnp.where(m_BT, ent_BT, 0.0)), n)
  gap_BT = jnp.abs(batch["sampler_logprobs"] - jax.lax.stop_gradient(logp_BT))
  m["logp_abs_diff"] = (jnp.sum(jnp.where(m_BT, gap_BT, 0.0)), n)
  m["feedback_kl"] = (jax.lax.stop_gradient(fb_sum), fb_count)
  m["policy_loss"] = (jax.lax.stop_gradient(pl_sum), pl_count)
  m["advantage_abs"] = (jnp.sum(jnp.abs(adv_B)), jnp.asarray(adv_B.shape[0], jnp.float32))
  m["kept_rollouts"] = (jnp.sum(keep_B).astype(jnp.float32), jnp.asarray(adv_B.shape[0], jnp.float32))
  return loss, (m, aux)


class TeacherState(NamedTuple):
  """Optimizer state with the EMA teacher's weights next to it, so checkpoints carry the teacher."""

  inner: Any
  teacher: Any


def teacher_optimizer(tx: optax.GradientTransformation, rcfg: RLConfig) -> optax.GradientTransformation:
  """`tx` itself for the live teacher; for `teacher="ema"`, `tx` plus an EMA of the updated params
  (rate `teacher_ema_rate`) in `TeacherState.teacher`. Build the RL state's optimizer with this."""
  if rcfg.teacher not in TEACHERS:
    raise ValueError(f"unknown teacher {rcfg.teacher!r}; known: {', '.join(TEACHERS)}")
  if rcfg.teacher == "live":
    return tx
  rate = rcfg.teacher_ema_rate
  if not 0.0 < rate <= 1.0:
    raise ValueError(f"teacher_ema_rate must lie in (0, 1], got {rate}")

  def init(params):
    # A copy, not an alias: the step donates its state, and one buffer may not be donated twice.
    return TeacherState(tx.init(params), jax.tree.map(lambda p: jnp.array(p, copy=True), params))

  def update(grads, state, params=None):
    updates, inner = tx.update(grads, state.inner, params)
    new = optax.apply_updates(params, updates)
    teacher = jax.tree.map(lambda t, p: (1.0 - rate) * t + rate * p, state.teacher, new)
    return updates, TeacherState(inner, teacher)

  return optax.GradientTransformation(init, update)


TEACHERS = ("live", "ema")
FEEDBACK_MODES = ("loss", "advantage")


def check_config(rcfg: RLConfig) -> None:
  """Clear errors for settings the step would otherwise trip over at trace time."""
  if rcfg.feedback_mode not in FEEDBACK_MODES:
    raise ValueError(f"unknown feedback_mode {rcfg.feedback_mode!r}; known: {', '.join(FEEDBACK_MODES)}")
  if rcfg.teacher not in TEACHERS:
    raise ValueError(f"unknown teacher {rcfg.teacher!r}; known: {', '.join(TEACHERS)}")
  if rcfg.lambda_feedback < 0:
    raise ValueError(f"lambda_feedback must be ≥ 0, got {rcfg.lambda_feedback}")


def make_rl_step(
  cfg: model.ModelConfig,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  rcfg: RLConfig,
  *,
  with_feedback: bool,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """Jitted, donated step; a non-finite loss or gradient keeps the old params and optimizer state.
  With `rcfg.teacher == "ema"`, `tx` must be `teacher_optimizer(...)`'s (the teacher lives in its state)."""
  check_config(rcfg)
  loss_fn = functools.partial(rl_loss, cfg=cfg, rcfg=rcfg, with_feedback=with_feedback)
  ema = rcfg.teacher == "ema"

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    if ema and not isinstance(state.opt_state, TeacherState):
      raise ValueError('teacher="ema" needs the optimizer state of rl.train.teacher_optimizer(tx, rcfg).')
    teacher = state.opt_state.teacher if ema else None
    (loss, (m, aux)), grads = jax.value_and_grad(
      lambda p: loss_fn(p, batch=batch, teacher_params=teacher), has_aux=True
    )(state.params)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = model.update_router_bias(
      optax.apply_updates(state.params, updates), aux["expert_load"], rcfg.router_bias_rate
    )
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    new = TrainState(
      step=state.step + 1, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state)
    )
    out = {k: s / jnp.maximum(c, 1.0) for k, (s, c) in m.items()}
    out |= {
      "loss": loss,
      "grad_norm": grad_norm,
      "lr": jnp.asarray(schedule(state.step), jnp.float32),
      "feedback_tokens": m["feedback_kl"][1],
      "skipped": 1 - ok.astype(jnp.int32),
    }
    return new, out

  return jax.jit(step, donate_argnums=0)


# --- the loop ----------------------------------------------------------------------------------


def fit(
  state: TrainState,
  steps: dict[bool, Callable],
  make_envs: Callable[[int], tuple[list[envs.Env], list[int], list[int]]],
  cfg: model.ModelConfig,
  rcfg: RLConfig,
  *,
  writer: metrics_lib.MetricsWriter | None = None,
  save: Callable[[TrainState, bool], None] | None = None,
  log: Callable[[str], None] = print,
  rules: feedback.FeedbackRules | None = None,
  evaluate: Callable[[Any], dict[str, float]] | None = None,
) -> tuple[TrainState, dict]:
  """RL from `state.step` to `rcfg.steps`. `steps[True]`/`steps[False]`: the step with/without the
  teacher (the one without serves λ = 0 and batches without a detected turn). `make_envs(step)` gives
  (envs, seeds, group ids) for the step's P × G rollouts. A step whose rollouts or update raise is
  logged, counted in `failed_steps` and skipped; Ctrl-C saves and returns.

  `evaluate(params)` (with `rcfg.eval_every` > 0) scores the policy on a fixed problem set before the
  first step and every `eval_every` steps: the per-step training reward mixes policy and problem
  difficulty (each step draws new problems), the fixed set separates them."""
  start, history, failed_steps, interrupted = int(state.step), [], 0, False
  evals: list[dict[str, float]] = []

  def run_eval(s: int) -> None:
    if evaluate is None or rcfg.eval_every <= 0:
      return
    t = time.perf_counter()
    e = {"step": s, **evaluate(state.params)}
    evals.append(e)
    if writer is not None:
      writer.write(s, {f"eval_{k}": v for k, v in e.items() if k != "step"})
    log(
      f"[rl] eval @ step {s}: reward {e['reward']:.3f} invalid {e['invalid_call_rate']:.3f} "
      f"({time.perf_counter() - t:.1f}s)"
    )

  if rules is None:
    kinds = tuple(k for k in rcfg.feedback_kinds.split(",") if k)
    rules = feedback.FeedbackRules(kinds=kinds) if kinds else _RULES
  t_start = time.perf_counter()
  try:
    if start == 0:
      run_eval(0)
    for s in range(start + 1, rcfg.steps + 1):
      t0 = time.perf_counter()
      try:
        env_list, seeds, groups = make_envs(s)
        key = jax.random.fold_in(jax.random.key(rcfg.seed), s)
        trajs = collect(state.params, cfg, env_list, seeds, key, rcfg)
        t_roll = time.perf_counter() - t0
        stats = rollout_stats(trajs)
        use_fb = rcfg.lambda_feedback > 0
        infos = [e.info() for e in env_list]
        batch = rl_batch(trajs, groups, infos, with_feedback=use_fb, rules=rules)
        n_fb_rows = int(np.sum(batch["teacher_lengths"] > 0)) if use_fb else 0
        if use_fb and n_fb_rows == 0:
          batch = {k: v for k, v in batch.items() if k in _BASE_KEYS}
        t1 = time.perf_counter()
        state, m = steps[use_fb and n_fb_rows > 0](state, batch)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        t_update = time.perf_counter() - t1
      except Exception as e:  # noqa: BLE001 -- a failed step is logged and skipped, never stops the loop
        failed_steps += 1
        log(f"[rl] step {s} failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      rec = (
        stats
        | m
        | {
          "feedback_turns_per_rollout": n_fb_rows / len(trajs),
          "rollout_s": t_roll,
          "update_s": t_update,
          "step_s": time.perf_counter() - t0,
        }
      )
      history.append({"step": s, **rec})
      if writer is not None:
        writer.write(s, rec)
      if s % rcfg.log_every == 0 or s == rcfg.steps:
        log(
          f"[rl] step {s}/{rcfg.steps} reward {rec['reward']:.3f} pass {rec['pass_rate']:.2f} "
          f"invalid {rec['invalid_call_rate']:.3f} fb/rollout {rec['feedback_turns_per_rollout']:.2f} "
          f"fbKL {rec['feedback_kl']:.4f} ent {rec['entropy']:.3f} clip {rec['clip_frac']:.3f} "
          f"|Δlogp| {rec['logp_abs_diff']:.2e} failed {int(rec['failed_rollouts'])} "
          f"rollout {t_roll:.1f}s update {t_update:.1f}s"
        )
      if rcfg.eval_every > 0 and (s % rcfg.eval_every == 0 or s == rcfg.steps):
        run_eval(s)
      if save is not None and s % rcfg.checkpoint_every == 0:
        save(state, False)
  except KeyboardInterrupt:
    interrupted = True
    log(f"[rl] interrupted at step {int(state.step)}: saving")
  if save is not None:
    save(state, True)
  if writer is not None:
    writer.flush()
  return state, {
    "start_step": start,
    "steps": int(state.step),
    "interrupted": interrupted,
    "failed_steps": failed_steps,
    "history": history,
    "evals": evals,
    "seconds": time.perf_counter() - t_start,
  }


_BASE_KEYS = (
  "tokens",
  "positions",
  "segment_ids",
  "loss_mask",
  "sampler_logprobs",
  "rewards",
  "group_ids",
  "routed_experts",
)


def toy_envs(rcfg: RLConfig, toy_cfg: Any = None) -> Callable[[int], tuple[list, list[int], list[int]]]:
  """P problems × G rollouts per step; the problem seeds are a pure function of (seed, step)."""
  from composer_jax.rl.envs import toy

  toy_cfg = toy_cfg or toy.ToyConfig(max_turns=rcfg.max_turns)

  def make(step: int):
    rng = np.random.default_rng([rcfg.seed, step, 1])
    seeds = rng.integers(0, 1 << 30, size=rcfg.problems_per_step).tolist()
    G = rcfg.group_size
    return (
      [toy.ToyEnv(toy_cfg) for _ in range(len(seeds) * G)],
      [s for s in seeds for _ in range(G)],
      [p for p in range(len(seeds)) for _ in range(G)],
    )

  return make


def evaluate(
  params: Any,
  cfg: model.ModelConfig,
  rcfg: RLConfig,
  n: int = 64,
  *,
  seed: int = 12345,
  temperature: float | None = None,
) -> dict[str, float]:
  """Rollout statistics of `n` fresh toy problems (one rollout each) at the given temperature."""
  from composer_jax.rl.envs import toy

  rc = dataclasses.replace(rcfg, temperature=rcfg.temperature if temperature is None else temperature)
  rng = np.random.default_rng([seed])
  seeds = rng.integers(0, 1 << 30, size=n).tolist()
  env_list = [toy.ToyEnv(toy.ToyConfig(max_turns=rc.max_turns)) for _ in seeds]
  trajs = collect(params, cfg, env_list, seeds, jax.random.key(seed), rc)
  return rollout_stats(trajs)
