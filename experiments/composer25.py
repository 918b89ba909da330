"""Composer 2.5 reproduction on a Kimi-K2.5-shaped (DeepSeek-V3 family) MoE transformer.

  python run.py --config=experiments/composer25.py                     # tiny: all stages, ~9 min
  python run.py --config=experiments/composer25.py:moonlight_16b       # Moonlight-16B-A3B shapes, 64 devices
  python run.py --config=experiments/composer25.py:kimi_k25_1t         # Kimi K2.5 (1T) shapes, 1024 devices
  python run.py --config=experiments/composer25.py --config.model.n_layers=2 --config.demo.decode_tokens=4
  python run.py --config=experiments/composer25.py --config.mesh.dense='(2,2,2)' --workdir=runs/tiny_2x2x2
  python run.py --config=experiments/composer25.py --config.stages=demo               # tiny: ~a minute
  python run.py --config=experiments/composer25.py --config.stages=pretrain --config.train.steps=400

`stages` is a comma-separated list run in order; tiny's default is pretrain,synth,sft,rl (the others:
demo,pretrain). The run ends with a summary (losses, tasks built, SFT and RL rates, the feedback effect,
where checkpoints and metrics are), also in <workdir>/summary.json. Rerunning a command skips the stages
it finished with the same config (<workdir>/stages/<stage>.json), reruns those whose config changed and
resumes an interrupted stage from its last checkpoint; `--config.force=sft,rl` (or `all`) starts stages
over, their old outputs moved to <workdir>/stages/previous/.
  demo      build the sharded model on both meshes, print the parameter/sharding table, one forward
            pass, greedy-decode a few tokens.
  pretrain  next-token training on the stdlib corpus (built under <workdir>/tfds), sharded Muon +
            AdamW, validation every `train.eval_every` steps, checkpoints in <workdir>/checkpoints
            (rerun the same command to resume; Ctrl-C saves first), metrics in <workdir>/metrics.
  synth     feature-deletion coding tasks from `synth.sources` (pinned PyPI sdists, cached under
            <workdir>/synth_sources; tiny: 2 tasks of inflection) and `synth.local_dir`: one progress line
            per candidate, a summary table per source, tasks in the TFDS dataset <workdir>/synth_tasks,
            summary <workdir>/synth.json (Ctrl-C writes the tasks built so far; a rerun reuses finished
            sources). Needs bubblewrap + PyPI.
  python run.py --config=experiments/composer25.py --config.stages=synth --workdir=runs/synth \\
      --config.synth.sources=toolz,boltons,cachetools,tabulate,humanize,inflection \\
      --config.synth.max_tasks_per_source=3                                         # all six: ~6 min
  sft       SFT warm-up of a small one-device model (`rl.model` overrides) on toy tool-use demonstrations
            (incl. invalid calls, errors and hints), checkpoints in <workdir>/sft, then solve rate and
            invalid-call rate on fresh problems (sampled and greedy) in <workdir>/sft.json.
  rl        multi-turn RL from the SFT checkpoint: P problems x G rollouts per step through the KV-cache
            sampler, Dr.GRPO, targeted text feedback (lambda_feedback > 0), Muon; <workdir>/rl, rl_metrics.
            With `rl.compare_without_feedback` (on by default) the same run with lambda_feedback 0 follows
            on the same problems and seeds (<workdir>/rl_nofb), for the summary's side-by-side.
  plan      per-device memory and collective traffic of the config (composer_jax/plan.py, `plan`).
  python run.py --config=experiments/composer25.py --config.stages=sft,rl --workdir=runs/rl_toy
  python run.py --config=experiments/composer25.py --config.stages=rl --config.rl.feedback_mode=advantage \\
      --config.rl.lambda_feedback=1.0
  python run.py --config=experiments/composer25.py --config.stages=rl --config.rl.env=coding \\
      --config.rl.steps=1 --config.rl.problems_per_step=1 --config.rl.group_size=2   # after stage synth

Variants:
  tiny           CPU default (all stages: 9 min 11 s on 2 idle cores). Dense mesh (replica=4,
                 fsdp=1, context=2) and expert mesh (expert=8, expert_fsdp=1) on 8
                 devices (run.py and the tests force 8 CPU devices when no accelerator is present).
  moonlight_16b  Moonlight-16B-A3B (15.96B total, 2.24B active non-embedding): q_proj without
                 q-LoRA, plain RoPE; the smallest real checkpoint of the architecture.
  kimi_k25_1t    Kimi K2.5 text branch (1.03T total, ~33B active): q-LoRA, YaRN factor 64.
Real-model shapes follow the published config.json files (counts from a meta-device init).

Every mesh below must multiply to the device count: `sharding.build_meshes` checks it.
"""

import ml_collections
from ml_collections import config_dict

VARIANTS = ("tiny", "moonlight_16b", "kimi_k25_1t")


def get_config(variant: str = "tiny") -> ml_collections.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"Unknown variant {variant!r}; known variants: {', '.join(VARIANTS)}.")
  c = ml_collections.ConfigDict()
  c.variant = variant
  c.seed = 0
  # Comma-separated, run in order: demo, pretrain, synth, sft, rl, plan; a rerun skips finished stages.
  c.stages = "pretrain,synth,sft,rl" if variant == "tiny" else "demo,pretrain"
  c.force = ""  # stages to start over although finished ("sft,rl" or "all"); old outputs are moved aside
  c.workdir = config_dict.placeholder(str)  # None: run.py's --workdir, else runs/<variant>.

  c.mesh = ml_collections.ConfigDict()
  c.model = _model(variant)
  c.demo = ml_collections.ConfigDict()
  c.train = _train(variant)
  c.optim = _optim(variant)
  c.data = ml_collections.ConfigDict(
    dict(
      tokenizer="byte" if variant == "tiny" else "bpe",  # byte: 267 ids, fits the tiny vocab of 1024
      src_dir=config_dict.placeholder(str),  # None: this Python's stdlib
      max_files=config_dict.placeholder(int),  # None: all files
    )
  )
  c.synth = _synth(variant)
  c.sft = _sft()
  c.rl = _rl()
  c.plan = _plan()
  c.rl.compare_without_feedback = True  # stage rl: then the same run with lambda_feedback 0 (same seeds)
  if variant == "tiny":
    c.mesh.dense = (4, 1, 2)  # (replica, fsdp, context); 8 devices.
    c.mesh.expert = (8, 1)  # (expert, expert_fsdp); 8 devices, one expert each.
    c.demo.batch = 4  # divisible by replica·fsdp.
    c.demo.prompt_len = 32  # divisible by context.
    c.demo.decode_tokens = 8
  elif variant == "moonlight_16b":
    c.mesh.dense = (8, 8, 1)  # 64 devices: fsdp inside an 8-chip node, 8 replicas.
    c.mesh.expert = (64, 1)  # 64 devices, one expert each.
    c.demo.batch = 64
    c.demo.prompt_len = 256
    c.demo.decode_tokens = 16
  else:
    c.mesh.dense = (16, 16, 4)  # 1024 devices: fsdp 16, context 4 for long sequences.
    c.mesh.expert = (128, 8)  # 1024 devices: 3 of 384 experts per expert row, sharded 8 ways.
    c.demo.batch = 256
    c.demo.prompt_len = 256
    c.demo.decode_tokens = 16
  return c


def _plan() -> ml_collections.ConfigDict:
  """The `plan` stage (composer_jax/plan.py): per-device memory, collective bytes, Newton–Schulz time.

  devices None plans the variant's own meshes; another count keeps fsdp, context and expert_fsdp and
  scales replica and expert (an error when that does not divide).
  """
  p = dict(
    devices=config_dict.placeholder(int),  # None: the product of the variant's mesh shape
    peak_flops=config_dict.placeholder(float),  # FLOP/s per device for the NS time; None: train.peak_flops
    hbm_gib=141.0,  # memory per device the plan is checked against (H200; H100: 80)
  )
  return ml_collections.ConfigDict(p)


def _sft() -> ml_collections.ConfigDict:
  """The `sft` stage: fields of `composer_jax.rl.sft.SFTConfig` (+ eval_problems)."""
  s = dict(
    # ~1 s/step on 2 CPU cores. Sampled pass rate / invalid-call rate on fresh problems: 60 steps 0.06 / 0.23
    # (many invalid calls for feedback, too few successes for RL to learn from), 150 steps 0.45 / 0.02 (greedy
    # 0.70; the RL recipe below), 180 steps 0.80 / 0.01, 300 steps 0.98 / 0.00. benchmarks/RESULTS.md.
    steps=60,
    batch_size=32,
    demos=2000,
    lr=3e-3,
    warmup_steps=10,
    log_every=20,
    checkpoint_every=100,
    keep_checkpoints=1,
    mistake_fraction=0.3,
    hint_fraction=0.7,
    router_bias_rate=1e-3,
  )
  c = ml_collections.ConfigDict(s)
  c.eval_problems = 64  # fresh toy problems rolled out after SFT (not an SFTConfig field)
  return c


def _rl() -> ml_collections.ConfigDict:
  """The `rl` stage: fields of `composer_jax.rl.train.RLConfig`, `model` overrides of `c.model` (also
  used by `sft`: one device, meshes None) and `coding` env options."""
  r = dict(
    env="toy",  # "toy" | "coding" (tasks from stage synth under <workdir>/synth_tasks)
    # The one-command default shows the mechanics in minutes (8 x 8 rollouts per step: the normalised Muon
    # step carries mostly noise, and reward on new problems stays flat or falls). The measured recipe in which
    # it rises (benchmarks/RESULTS.md; ~9 min per arm on 2 cores): --config.sft.steps=150
    # --config.rl.problems_per_step=32 --config.rl.steps=20.
    steps=20,
    problems_per_step=8,
    group_size=8,  # rollouts per problem (a group: the same problem seed)
    objective="drgrpo",  # grpo | drgrpo | dapo | cispo | gspo
    advantage="drgrpo",  # grpo | drgrpo | rloo
    lambda_feedback=0.5,  # 0: RL alone
    # "loss": + λ·D(student‖teacher) / its own token count (the form); "advantage": λ·sg(log q −
    # log p) joins the flagged tokens' advantages. Neither has helped yet: benchmarks/RESULTS.md.
    feedback_mode="loss",
    divergence="reverse_kl",  # reverse_kl | forward_kl | jsd
    divergence_top_k=0,  # 0: full vocabulary
    feedback_kinds="",  # e.g. "unknown_tool": act only on these detections; "": FeedbackRules default
    lr=3e-4,  # Muon: 1e-3 lowered the reward, 3e-4 with 32 x 8 rollouts raised it
    warmup_steps=3,  # a fresh optimizer state's first steps are its largest
    eval_every=20,  # the fixed problem set (also before step 1): progress without the per-step problem draw
    eval_problems=64,  # 256 for the recipe above (± 0.03 on a reward near 0.5)
    temperature=1.0,
    top_k=0,
    max_turns=6,
    max_turn_tokens=24,
    cache_len=768,
    tis_cap=2.0,
    seed=0,
    log_every=1,
    checkpoint_every=10,
    keep_checkpoints=1,
    router_bias_rate=1e-3,
  )
  c = ml_collections.ConfigDict(r)
  c.model = ml_collections.ConfigDict(
    dict(
      vocab_size=272,  # the byte tokenizer's 267 ids, rounded up
      d_model=128,
      n_layers=2,
      first_k_dense=1,
      n_heads=4,
      dense_mlp_dim=256,
      moe_mlp_dim=128,
      n_experts=4,
      top_k=2,
      n_group=1,
      topk_group=1,
      q_lora_rank=64,
      kv_lora_rank=64,
      qk_nope_head_dim=32,
      qk_rope_head_dim=16,
      v_head_dim=32,
    )
  )
  c.coding = ml_collections.ConfigDict(dict(output_chars=2000))
  return c


def _synth(variant: str) -> ml_collections.ConfigDict:
  """The `synth` stage (composer_jax/synth/build.py)."""
  from composer_jax.synth.sources import DEFAULT_SOURCES  # stdlib only: cheap to import here

  all_sources = ",".join(src.name for src in DEFAULT_SOURCES)
  s = dict(
    # comma-separated DEFAULT_SOURCES names; "" none. tiny: the fastest source (~5 tasks/min on 2 cores).
    sources="inflection" if variant == "tiny" else all_sources,
    local_dir=config_dict.placeholder(str),  # a local repository (with tests) to cut tasks from as well
    mode="stub",  # "stub": body -> NotImplementedError, signature + docstring kept; "remove": definition gone
    max_tasks_per_source=2 if variant == "tiny" else config_dict.placeholder(int),  # None: all candidates
    runs=3,  # baseline suite runs (flaky tests dropped)
    timeout_s=300.0,  # per sandboxed suite run
  )
  return ml_collections.ConfigDict(s)


def _train(variant: str) -> ml_collections.ConfigDict:
  """Fields of `composer_jax.train.pretrain.TrainConfig`."""
  t = dict(
    steps=60,  # ~4-9 s/step on 2 CPU cores (sharded Muon ~half of it): ~5 min with compile
    batch_size=8,  # divisible by replica·fsdp
    seq_len=128,  # divisible by context
    log_every=5,
    eval_every=20,
    eval_batches=2,
    checkpoint_every=20,
    keep_checkpoints=2,
    router_bias_rate=1e-3,
    peak_flops=180e9,  # ~2 XLA:CPU cores (notes/environment.md §7); H100 bf16 dense ~989e12
    grad_accum=1,  # micro-batches per step; batch_size/grad_accum divisible by replica·fsdp
  )
  if variant != "tiny":
    t.update(steps=10_000, batch_size=256, seq_len=4096, log_every=10, eval_every=500, checkpoint_every=500)
    t.update(peak_flops=989e12)
  return ml_collections.ConfigDict(t)


def _optim(variant: str) -> ml_collections.ConfigDict:
  """Fields of `composer_jax.optim.OptimizerConfig`; `total_steps` None means `train.steps`."""
  o = dict(
    learning_rate=3e-3 if variant == "tiny" else 3e-4,
    warmup_steps=10 if variant == "tiny" else 500,
    total_steps=config_dict.placeholder(int),
    min_lr_ratio=0.1,
    weight_decay=0.1,
    muon_beta=0.95,
    ns_steps=5,
    ns_coeffs="quintic",
    rms_scale="moonlight",
    adam_b1=0.9,
    adam_b2=0.95,
    adam_eps=1e-8,
    grad_clip=1.0,
    matrix_optimizer="muon",  # "adamw": AdamW on the matrices too (ablation)
    qk_clip_tau=100.0,  # QK-clip (Kimi K2 MuonClip) caps each head's max attention logit; 0 disables
  )
  return ml_collections.ConfigDict(o)


def _model(variant: str) -> ml_collections.ConfigDict:
  """Fields of `composer_jax.model.config.ModelConfig`, `rope` those of `RopeConfig`."""
  common = dict(
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    first_k_dense=1,
    rope_interleave=True,
    tie_word_embeddings=False,
    init_std=0.02,
    param_dtype="float32",
    capacity_factor=2.0,
    router_aux_loss_coef=0.0,  # aux-loss-free balancing by the router bias (DeepSeek-V3 §2.1.2).
    remat="none" if variant == "tiny" else "full",  # per-block activation recompute in training
  )
  if variant == "tiny":
    m = dict(
      common,
      vocab_size=1024,
      d_model=256,
      n_layers=4,
      n_heads=8,
      dense_mlp_dim=512,
      moe_mlp_dim=256,
      n_experts=8,
      top_k=2,
      n_shared_experts=1,
      n_group=2,  # group-limited routing on: 2 groups of 4 experts, keep 1 group.
      topk_group=1,
      routed_scaling_factor=2.5,
      q_lora_rank=64,
      kv_lora_rank=64,
      qk_nope_head_dim=32,
      qk_rope_head_dim=16,
      v_head_dim=32,
      rms_norm_eps=1e-6,
      max_position_embeddings=1024,
      rope=_rope(
        theta=50000.0, kind="yarn", factor=4.0, original_max_position=256, mscale=1.0, mscale_all_dim=1.0
      ),
      dtype="float32",  # bf16 dots are slower than fp32 on XLA:CPU.
      expert_impl="blocked",  # dropless; the fastest expert path measured on XLA:CPU (RESULTS.md).
      dispatch="all_to_all",  # XLA:CPU has no ragged-all-to-all.
      capacity_factor=4.0,  # EP send buffers: room for 4x the balanced share per destination device.
    )
  elif variant == "moonlight_16b":
    m = dict(
      common,
      vocab_size=163840,
      d_model=2048,
      n_layers=27,
      n_heads=16,
      dense_mlp_dim=11264,
      moe_mlp_dim=1408,
      n_experts=64,
      top_k=6,
      n_shared_experts=2,
      routed_scaling_factor=2.446,
      q_lora_rank=0,  # plain q_proj (HF q_lora_rank=None).
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      rms_norm_eps=1e-5,
      max_position_embeddings=8192,
      rope=_rope(theta=50000.0),
      dtype="bfloat16",
      expert_impl="ragged",
      dispatch="ragged_all_to_all",
    )
  else:
    m = dict(
      common,
      vocab_size=163840,
      d_model=7168,
      n_layers=61,
      n_heads=64,
      dense_mlp_dim=18432,
      moe_mlp_dim=2048,
      n_experts=384,
      top_k=8,
      n_shared_experts=1,
      routed_scaling_factor=2.827,
      q_lora_rank=1536,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      rms_norm_eps=1e-5,
      max_position_embeddings=262144,
      rope=_rope(
        theta=50000.0, kind="yarn", factor=64.0, original_max_position=4096, mscale=1.0, mscale_all_dim=1.0
      ),
      dtype="bfloat16",
      expert_impl="ragged",
      dispatch="ragged_all_to_all",
    )
  return ml_collections.ConfigDict(m)


def _rope(
  theta: float,
  kind: str = "default",
  factor: float = 1.0,
  original_max_position: int = 4096,
  mscale: float | None = None,
  mscale_all_dim: float | None = None,
) -> ml_collections.ConfigDict:
  """`RopeConfig` fields; unset optional floats stay typed placeholders so `--config.` can set them."""

  def opt(x):
    return config_dict.placeholder(float) if x is None else x

  return ml_collections.ConfigDict(
    dict(
      theta=theta,
      kind=kind,
      factor=factor,
      original_max_position=original_max_position,
      beta_fast=32.0,
      beta_slow=1.0,
      mscale=opt(mscale),
      mscale_all_dim=opt(mscale_all_dim),
      attention_factor=config_dict.placeholder(float),
      truncate=True,
    )
  )
