"""The config layer: typed, frozen dataclasses are the one source of every default.

  config = configs.Config()                                   # the tiny CPU run, all defaults
  cd = configs.to_config_dict(config)                         # what experiments/*.py return
  config = configs.from_config(cd)                            # strict: unknown keys raise ConfigError

An experiment file (`experiments/composer25.py`) builds a `Config`, overriding only what differs from
these defaults, and returns it as an `ml_collections.ConfigDict` so `--config.x.y=` flags can set any
field. The pipeline turns it back into a `Config` before any work: an unknown key anywhere fails with
one line that names it and the nearest valid key. Values derived from others (the optimizer's schedule
length) are computed here in code, never stored, so an override of their source propagates.

One `model` and one tokenizer (`data.tokenizer`, which has the chat format's special tokens) serve every
stage: pretrain -> sft -> gate -> rl train the same weights on the same two meshes.

Nothing in `composer_jax` is imported here but `strict` (the generic conversion), `env_configs` (the rl
section's environment sub-sections) and `model/config.py` (ModelConfig and RopeConfig, re-exported):
importing it loads jax and flax through the model package, but touches no backend, so `run.py` can still
choose the device count afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composer_jax import strict
from composer_jax.env_configs import CodingEnvConfig, LedgerEnvConfig, StaleEnvConfig
from composer_jax.model.config import ModelConfig, RopeConfig
from composer_jax.strict import ConfigError, fingerprint, from_dict, plain, record, to_config_dict

__all__ = [
  "CodingEnvConfig",
  "CompileConfig",
  "Config",
  "ConfigError",
  "DataConfig",
  "DemoConfig",
  "GateConfig",
  "LedgerEnvConfig",
  "MeshConfig",
  "ModelConfig",
  "OptimizerConfig",
  "PlanConfig",
  "RLConfig",
  "RopeConfig",
  "SFTConfig",
  "ScheduleConfig",
  "StaleEnvConfig",
  "SynthConfig",
  "TrainConfig",
  "check_batch",
  "check_meshes",
  "check_path",
  "CADENCE",
  "cadence_paths",
  "fingerprint",
  "from_config",
  "identity",
  "from_dict",
  "optimizer_for",
  "plain",
  "pretrain_optimizer",
  "record",
  "resolve",
  "stage_optimizer",
  "to_config_dict",
]


# --- sections ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Both mesh shapes over the same devices (`sharding.build_meshes`); each must multiply to the
  device count."""

  dense: tuple[int, int, int] = (4, 1, 2)  # (replica, fsdp, context)
  expert: tuple[int, int] = (8, 1)  # (expert, expert_fsdp)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """The `demo` stage: one sharded forward pass and greedy decoding."""

  batch: int = 4  # divisible by replica·fsdp
  prompt_len: int = 32  # divisible by context
  decode_tokens: int = 8


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The pretraining corpus (`data.corpus`) and its tokenizer."""

  # Every stage's tokenizer (pretraining text and the chat turns of sft/gate/rl): "byte" (267 ids) | "bpe"
  # (the shipped 4,096-token BPE) | a checkpoint directory with tokenizer.json or a Kimi-family tiktoken.model
  # (init_from sets it).
  tokenizer: str = "byte"
  src_dir: str | None = None  # None: this Python's standard library
  max_files: int | None = None  # None: all files
  prefetch: int = 2  # pretraining batches packed ahead by a background thread; 0: in the training thread


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """How long a training stage runs and how often it logs, evaluates and saves: `train.schedule`,
  `sft.schedule` and `rl.schedule` are this one section, and `train.loop.fit` runs it as it is. A change
  of any field but `warmup_steps` continues the stage's checkpoint (`CADENCE`); the warm-up shapes the
  learning rate, so a checkpoint is not continued across it."""

  steps: int  # train up to this step count
  warmup_steps: int = 0  # the learning rate's linear 0 → peak (`optimizer_for`)
  log_every: int = 1
  eval_every: int = 0  # 0: no evaluation
  checkpoint_every: int = 0  # 0: only at the end
  keep_checkpoints: int = 1
  max_skipped_in_a_row: int = 10  # non-finite steps in a row that stop the run (unsaved); 0: never


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The pretraining stage (`stages/pretrain.py`, `train.pretrain`)."""

  # 60 steps: ~2-4 s/step on 2 CPU cores (tiny, 8 fake devices)
  schedule: ScheduleConfig = ScheduleConfig(
    steps=60, warmup_steps=10, log_every=5, eval_every=20, checkpoint_every=20, keep_checkpoints=2
  )
  batch_size: int = 8  # divisible by replica·fsdp
  seq_len: int = 128  # divisible by context
  eval_batches: int = 2  # fixed validation batches (the same ones every time)
  router_bias_rate: float = 1e-3  # DeepSeek-V3 §2.1.2 bias update speed γ
  peak_flops: float = 180e9  # for MFU: ~2 XLA:CPU cores; H100/H200 bf16 dense ~989e12
  grad_accum: int = 1  # micro-batches per step (batch_size/grad_accum divisible by replica·fsdp)


_WARMUP_FROM = "set train.schedule.warmup_steps, sft.schedule.warmup_steps or rl.schedule.warmup_steps"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """`optim.build_optimizer`: sharded Muon on matrices, AdamW on the rest. One learning rate for both
  branches: with Moonlight's 0.2·sqrt(max(m, n)) scale Muon's update RMS matches AdamW's."""

  learning_rate: float = 3e-3  # peak of the warmup + cosine schedule
  total_steps: int | None = None  # cosine horizon incl. warmup; None: the run's step count
  # Not a config key: the stage's `schedule.warmup_steps`, filled in by `optimizer_for`.
  warmup_steps: int = dataclasses.field(default=0, metadata={"derived": _WARMUP_FROM})
  min_lr_ratio: float = 0.1  # schedule ends at learning_rate · min_lr_ratio
  weight_decay: float = 0.1  # decoupled, × lr; Muon matrices and Adam matrices (not norms)
  muon_beta: float = 0.95
  ns_steps: int = 5
  ns_coeffs: str = "quintic"  # or "polar_express"
  rms_scale: str = "moonlight"  # or "jordan"
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  adam_eps: float = 1e-8
  grad_clip: float = 1.0  # global norm over all gradients, scaling AdamW's leaves; 0 disables
  # Also scale Muon's gradients by it: then no Newton–Schulz can start before the whole backward pass has
  # produced the norm. Off: Muon's update size is set by the orthogonalisation anyway.
  clip_muon: bool = False
  muon_dtype: str | None = None  # Newton–Schulz and its collectives ("bfloat16"); None: the param dtype
  matrix_optimizer: str = "muon"  # "adamw": AdamW on the matrices too (ablation / benchmark peer)
  qk_clip_tau: float = 100.0  # QK-clip threshold on the max attention logit (Kimi K2); 0 disables


@dataclasses.dataclass(frozen=True)
class SynthConfig:
  """The `synth` stage (`synth/build.py`)."""

  sources: str = "inflection"  # comma-separated `synth.sources.DEFAULT_SOURCES` names; "" none
  local_dir: str | None = None  # a local repository (with tests) to cut tasks from as well
  mode: str = "stub"  # "stub": body → NotImplementedError, signature kept; "remove": definition gone
  max_tasks_per_source: int | None = 2  # None: all candidates
  runs: int = 3  # baseline suite runs (flaky tests dropped)
  timeout_s: float = 300.0  # per sandboxed suite run


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The `sft` stage: the pretrained model warmed up on tool-use demonstrations of `rl.env` (`rl.sft`).

  300 packed steps: enough for the hinted teacher to make nearly every flagged turn valid (what the gate
  asks) and for most unflagged rollouts to pass; far fewer leave the turn format half learnt.
  """

  init: str = "pretrain"  # the newest pretrain checkpoint (else init_from's weights) | "random": a fresh init
  schedule: ScheduleConfig = ScheduleConfig(
    steps=300, warmup_steps=10, log_every=20, eval_every=0, checkpoint_every=100, keep_checkpoints=1
  )
  batch_size: int = 16  # rows per step
  pack_len: int = 256  # > 0: each row packs random demos up to this many tokens (~2); 0: one demo per row
  demos: int = 2000  # demonstrations generated once (seeded); batches sample from them
  lr: float = 3e-3
  mistake_fraction: float = 0.3  # toy.demonstrations: share of demos with an invalid call + error
  hint_fraction: float = 0.7  # of those, share followed by the hint message
  router_bias_rate: float = 1e-3
  eval_problems: int = 64  # fresh toy problems rolled out after SFT (sampled and greedy); 0 skips


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The `rl` stage and `rl.loop.fit`: rollouts, objective, targeted text feedback, schedule."""

  env: str = "stale"  # "stale" | "toy" | "ledger" | "coding" (tasks from stage synth, <workdir>/synth_tasks)
  # The one-command default: the stale-docs env, RL alone vs RL + feedback on the same seeds in minutes;
  # 30 steps so that the two arms can part. Toy env: problems_per_step=32.
  # eval_every: the fixed problem set, at step 0 and every N steps. Warm-up 3: a fresh optimizer state's
  # first steps are its largest.
  schedule: ScheduleConfig = ScheduleConfig(
    steps=30, warmup_steps=3, log_every=1, eval_every=15, checkpoint_every=10, keep_checkpoints=1
  )
  problems_per_step: int = 8
  group_size: int = 8  # rollouts per problem (one group = one problem seed)
  objective: str = "drgrpo"  # rl.objectives.OBJECTIVES
  advantage: str = "drgrpo"  # rl.objectives.ADVANTAGES
  tis_cap: float = 2.0  # truncated importance sampling against the sampler's log-probs: weight ≤ cap
  # targeted text feedback
  lambda_feedback: float = 1.0  # 0: RL alone; an exchange rate: the term is on the RL objective's scale
  # "loss": + λ·D(student‖teacher) on the selected tokens, reduced like the policy loss (same count);
  # "advantage": λ·clip(sg(log q − log p)) joins the selected tokens' advantages (on-policy distillation).
  feedback_mode: str = "loss"
  divergence: str = "forward_kl"  # rl.divergence.KINDS; forward: the only one that raises a token the
  # student does not sample (reverse KL's and the sampled-token gradients vanish at p(y) ≈ 1)
  divergence_top_k: int = 0  # 0: full vocabulary
  feedback_tokens: str = "first_divergence"  # | "turn": turn k's tokens up to the first where log p − log q
  divergence_threshold: float = 1.0  # ... exceeds this many nats (inclusive); "turn": all of turn k
  feedback_clip: float = 2.0  # per-token cap in nats on the divergence (loss) or |log q − log p| (advantage)
  feedback_kinds: str = ""  # comma-separated rl.feedback.KINDS to act on; "": the environment's own
  hint: str = "task"  # "task": the detector's hint; "null": a neutral note (the null-hint control arm)
  feedback_rows: int = 32  # teacher rows per step, fixed (one compiled program); 0: as many as flagged
  teacher: str = "frozen"  # "frozen": the weights RL starts from (the SFT checkpoint); "live": the current
  # weights (= the policy at rollout time: one update per batch; prefix KV reused); "ema": an EMA copy
  teacher_ema_rate: float = 0.01  # "ema": teacher ← (1 − rate)·teacher + rate·params after each step
  dynamic_sampling: bool = False  # DAPO: groups whose rewards are all equal leave the policy loss
  # Arm "penalty": the first flagged turn's sampled tokens get this much extra negative advantage (no text).
  flag_penalty: float = 0.0
  policy_gradient: bool = True  # False (arm "distill"): advantages 0, only the feedback term trains
  eval_problems: int = 64  # the fixed problem set's size (schedule.eval_every: how often)
  # optimisation
  lr: float = 3e-4  # Muon; larger rates make the reward fall on these environments
  router_bias_rate: float = 1e-3  # aux-loss-free balancing: the router bias moves by the batch's load
  # sampling and episodes
  temperature: float = 1.0
  top_k: int = 0  # sampler top-k; 0 off
  max_turns: int = 4  # the arithmetic envs need at most 3 calls
  max_turn_tokens: int = 16  # sampled tokens per assistant turn (a call is at most ~12)
  cache_len: int = 768  # sampler cache slots (shared write index: Σ over turns of the longest row)
  batch_min_len: int = 256  # a step's batch is padded to a power of two ≥ this: fewer shapes to compile
  # > 0: padded to a multiple of this instead (≥ batch_min_len): fewer padded tokens, more programs to compile
  batch_multiple: int = 0
  # The update in micro-batches of at most this many tokens (rollouts × padded length), gradients summed
  # exactly (`rl.batch.micro_batched`); 0: chosen before the stage so that the planned step at the longest
  # rollouts (cache_len) fits this host's memory (`plan.host_memory`); -1: the whole batch in one pass.
  update_tokens: int = 0
  update_memory: float = (
    0.25  # the share of this host's memory the planned update may use (rl.update_tokens 0)
  )
  # bookkeeping
  seed: int = 0
  # R3 (arXiv 2510.11370): record the sampler's experts per token and replay them in the training forward.
  routing_replay: bool = False
  compare_without_feedback: bool = True  # stage rl: then the same run with lambda_feedback 0, same seeds
  stale: StaleEnvConfig = StaleEnvConfig()
  coding: CodingEnvConfig = CodingEnvConfig()
  ledger: LedgerEnvConfig = LedgerEnvConfig()


@dataclasses.dataclass(frozen=True)
class GateConfig:  # the `gate` stage (`rl.gate`): does the hinted teacher beat the student? Before RL
  min_flagged: int = 100  # flagged turns (the first per rollout) to collect at least
  samples: int = 8  # resamples of each flagged turn per context
  rollouts_per_batch: int = 128
  max_batches: int = 6
  seed: int = 777  # problem seeds and sampling keys (apart from the RL steps' and the fixed eval set's)
  g1_min_gain: float = 0.3  # teacher - student valid rate, with its 95 % CI above 0
  g2_max_gap: float = 0.05  # |null note - student|
  g3_min_drop: float = 0.2  # teacher - wrong-content hint
  g4_min_share: float = 0.8  # turns whose mistake token the teacher makes less likely
  g4_prefix_tol: float = 0.01  # teacher may not lower the valid prefix's valid mass by more
  g5_min_gap: float = 0.2  # reward of unflagged - flagged rollouts
  g5_share: tuple[float, float] = (0.1, 0.6)  # flagged share of rollouts
  required: bool = True  # a failed gate stops the run before stage rl; False: rl runs, its summary says so


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """The `plan` stage: per-device memory, collective bytes, Newton–Schulz time.

  devices None plans the variant's own meshes; another count keeps fsdp, context and expert_fsdp and
  scales replica and expert (an error when that does not divide).
  """

  devices: int | None = None
  peak_flops: float | None = None  # FLOP/s per device for the NS time; None: train.peak_flops
  hbm_gib: float = 141.0  # memory per device the plan is checked against (H200; H100: 80)
  # share of it jax may use on GPU: it preallocates 75 % by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
  mem_fraction: float = 0.75


@dataclasses.dataclass(frozen=True)
class CompileConfig:
  """The `compile` stage: the real train step compiled ahead of time for an accelerator topology (XLA:TPU
  through libtpu runs on a CPU host), judged by the compiler's memory and cost analyses."""

  topology: str = "v5p:2x2x1"  # `jax.experimental.topologies` name, e.g. v5p:4x4x4, v5p:8x8x16
  num_slices: int = 1  # multi-slice topologies (DCN between slices)
  step: str = "train"  # "train" (pretraining step) | "rl" (the RL step) | "decode" (one sampler token)


@dataclasses.dataclass(frozen=True)
class Config:
  """One run: which stages, and every section they read."""

  variant: str = "tiny"
  seed: int = 0
  stages: str = "pretrain,synth,sft,gate,rl"  # comma-separated, run in order; a rerun skips finished ones
  force: str = ""  # stages to start over although finished ("sft,rl" or "all"); old outputs moved aside
  workdir: str | None = None  # None: run.py's --workdir, else runs/<variant>
  # An HF DeepseekV3/Kimi-K2 checkpoint dir: its config.json sets model's shapes, every stage starts from its
  # weights (pretrain and sft start from them), its tokenizer.json is data.tokenizer.
  init_from: str | None = None
  mesh: MeshConfig = MeshConfig()
  model: ModelConfig = ModelConfig()
  demo: DemoConfig = DemoConfig()
  train: TrainConfig = TrainConfig()
  optim: OptimizerConfig = OptimizerConfig()
  data: DataConfig = DataConfig()
  synth: SynthConfig = SynthConfig()
  sft: SFTConfig = SFTConfig()
  rl: RLConfig = RLConfig()
  gate: GateConfig = GateConfig()
  plan: PlanConfig = PlanConfig()
  compile: CompileConfig = CompileConfig()


# --- derived values --------------------------------------------------------------------------------


def optimizer_for(
  ocfg: OptimizerConfig, schedule: ScheduleConfig, *, lr: float | None = None, **fields: Any
) -> OptimizerConfig:
  """`ocfg` resolved for a run of `schedule`: `total_steps` None becomes `schedule.steps`, and the warm-up
  is `schedule.warmup_steps`, cut to `total_steps - 1` for very short runs (optax needs a positive decay
  length)."""
  total = max(ocfg.total_steps or schedule.steps, 2)
  lr = ocfg.learning_rate if lr is None else lr
  warmup = min(schedule.warmup_steps, total - 1)
  return dataclasses.replace(ocfg, learning_rate=lr, total_steps=total, warmup_steps=warmup, **fields)


def stage_optimizer(
  ocfg: OptimizerConfig, schedule: ScheduleConfig, *, lr: float, min_lr_ratio: float
) -> OptimizerConfig:
  """`ocfg` with a stage's own learning rate and a schedule over exactly its steps (sft, rl)."""
  return optimizer_for(
    dataclasses.replace(ocfg, total_steps=None), schedule, lr=lr, min_lr_ratio=min_lr_ratio
  )


# Fields that say how long or how often, not what is trained: a checkpoint is continued across a change
# of these (an extended run), so they stay out of the records that checkpoints are matched on. A
# schedule's `warmup_steps` is not one of them: it shapes the learning rate of the steps already taken.
CADENCE = ("steps", "total_steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints")
CADENCE += ("max_skipped_in_a_row", "eval_problems", "eval_batches", "compare_without_feedback")


def identity(section: Any) -> dict:
  """A section's fields as a plain dict without its `CADENCE` fields, in nested sections too (its
  `schedule`): what a checkpoint must match."""

  def keep(tree: dict) -> dict:
    return {k: keep(v) if isinstance(v, dict) else v for k, v in tree.items() if k not in CADENCE}

  return keep(plain(section))


def cadence_paths(section: str) -> tuple[str, ...]:
  """The dotted paths of `section`'s `CADENCE` fields, its schedule's included (a stage's `extends`)."""
  return tuple(f"{section}.{inner}{k}" for inner in ("", "schedule.") for k in CADENCE)


def pretrain_optimizer(config: Config) -> OptimizerConfig:
  """The pretrain stage's optimizer: `config.optim` over `train.schedule` (its horizon: `total_steps`, when
  set)."""
  return optimizer_for(config.optim, config.train.schedule)


# ModelConfig fields that say how to compute, not what: kept from `model` when `init_from` sets the shapes.
COMPUTE_FIELDS = ("dtype", "param_dtype", "expert_impl", "expert_block", "capacity_factor", "dispatch")
COMPUTE_FIELDS += ("router_aux_loss_coef", "remat", "init_std", "context_load_balance")


def resolve(config: Config) -> Config:
  """`config` with what `init_from` implies filled in: the checkpoint's model shapes and tokenizer."""
  if not config.init_from:
    return config
  import json
  import pathlib

  d = pathlib.Path(config.init_from)
  if not (d / "config.json").is_file():
    raise ConfigError(
      f"init_from {str(d)!r} has no config.json: point it at a Hugging Face checkpoint directory"
    )
  compute = {k: getattr(config.model, k) for k in COMPUTE_FIELDS}
  try:
    model = ModelConfig.from_hf(json.loads((d / "config.json").read_text()), **compute)
  except ValueError as e:
    raise ConfigError(f"init_from {str(d)!r}: {e}") from None
  from composer_jax.data.tokenizer import checkpoint_tokenizer  # noqa: PLC0415

  try:
    tokenizer = checkpoint_tokenizer(str(d)) or config.data.tokenizer
  except ValueError as e:
    raise ConfigError(f"init_from {str(d)!r} {e}") from None
  return dataclasses.replace(config, model=model, data=dataclasses.replace(config.data, tokenizer=tokenizer))


def check_meshes(config: Config) -> None:
  """The two meshes cover the same devices, and the batch and sequence split over them evenly."""
  import math

  dense, expert = config.mesh.dense, config.mesh.expert
  if math.prod(dense) != math.prod(expert):
    raise ConfigError(
      f"mesh.dense {dense} has {math.prod(dense)} devices but mesh.expert {expert} has {math.prod(expert)}: "
      "both meshes lay out the same devices"
    )


def check_batch(name: str, batch: int, seq: int, config: Config, micro: int = 1) -> None:
  """`batch` rows split over replica·fsdp (after `micro` micro-batches), `seq` over context."""
  replica, fsdp, context = config.mesh.dense
  if batch % micro or (batch // micro) % (replica * fsdp):
    per = f"batch / grad_accum = {batch}/{micro}" if micro > 1 else f"{batch} rows"
    raise ConfigError(f"{name}: {per} must be divisible by replica·fsdp = {replica * fsdp} (mesh.dense)")
  if seq % context:
    raise ConfigError(f"{name}: length {seq} must be divisible by context = {context} (mesh.dense)")


def from_config(cd: Any) -> Config:
  """The `Config` of an experiment's ConfigDict (or nested dict); strict (see `strict.from_dict`)."""
  return cd if isinstance(cd, Config) else from_dict(Config, plain(cd))


def check_path(dotted: str) -> None:
  """ConfigError when a `--config.` override path (e.g. "rl.stepz") names no field of `Config`."""
  strict.check_path(dotted, Config)
