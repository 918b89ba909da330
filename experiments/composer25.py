"""Composer 2.5 reproduction on a Kimi-K2.5-shaped (DeepSeek-V3 family) MoE transformer.

  python run.py --config=experiments/composer25.py                     # tiny: all stages, ~7 min
  python run.py --config=experiments/composer25.py:moonlight_16b       # Moonlight-16B-A3B shapes, 64 devices
  python run.py --config=experiments/composer25.py:kimi_k25_1t         # Kimi K2.5 (1T) shapes, 1024 devices
  python run.py --config=experiments/composer25.py --config.model.n_layers=2 --config.demo.decode_tokens=4
  python run.py --config=experiments/composer25.py --config.mesh.dense='(2,2,2)' --workdir=runs/tiny_2x2x2
  python run.py --config=experiments/composer25.py --config.stages=demo               # tiny: ~a minute
  python run.py --config=experiments/composer25.py --config.stages=pretrain --config.train.schedule.steps=400

Every default lives in the dataclasses of `composer_jax/configs.py` (the tiny CPU run); this file only
says what each variant changes. An unknown key (`--config.rl.stepz=3`) fails at once, naming the key.

`stages` is a comma-separated list run in order; tiny's default is pretrain,synth,sft,gate,rl (the others:
demo,pretrain). The run ends with a summary (losses, tasks built, SFT and RL rates, the feedback effect,
where checkpoints and metrics are), also in <workdir>/summary.json. Rerunning a command skips the stages
it finished with the same config (<workdir>/stages/<stage>.json), reruns those whose config changed and
resumes an interrupted stage from its last checkpoint; `--config.force=sft,rl` (or `all`) starts stages
over, their old outputs moved to <workdir>/stages/previous/.
  demo      build the sharded model on both meshes, print the parameter/sharding table, one forward
            pass, greedy-decode a few tokens.
  pretrain  next-token training on the stdlib corpus (built under <workdir>/tfds), sharded Muon +
            AdamW, validation every `train.schedule.eval_every` steps, checkpoints in <workdir>/checkpoints
            (rerun the same command to resume; Ctrl-C saves first), metrics in <workdir>/metrics.
  synth     feature-deletion coding tasks from `synth.sources` (pinned PyPI sdists, cached under
            <workdir>/synth_sources; tiny: 2 tasks of inflection) and `synth.local_dir`: one progress line
            per candidate, a summary table per source, tasks in the TFDS dataset <workdir>/synth_tasks,
            summary <workdir>/synth.json (Ctrl-C writes the tasks built so far; a rerun reuses finished
            sources). Needs bubblewrap + PyPI.
  python run.py --config=experiments/composer25.py --config.stages=synth --workdir=runs/synth \\
      --config.synth.sources=toolz,boltons,cachetools,tabulate,humanize,inflection \\
      --config.synth.max_tasks_per_source=3                                         # all six: ~6 min
  sft       SFT of the pretrained model (from <workdir>/checkpoints, on both meshes) on tool-use
            demonstrations (incl. invalid calls, errors and hints), checkpoints in <workdir>/sft, then solve
            rate and invalid-call rate on fresh problems (sampled and greedy) in <workdir>/sft.json.
  gate      does the hinted teacher beat the student on flagged turns (G1-G5)? A failed gate stops rl.
  rl        multi-turn RL from the SFT checkpoint: P problems x G rollouts per step through the KV-cache
            sampler, Dr.GRPO, targeted text feedback (lambda_feedback > 0), Muon; <workdir>/rl, rl_metrics.
            With `rl.compare_without_feedback` (on by default) the same run with lambda_feedback 0 follows
            on the same problems and seeds (<workdir>/rl_nofb), for the summary's side-by-side.
  plan      per-device memory and collective traffic of the config (composer_jax/plan, `plan`).
  python run.py --config=experiments/composer25.py --config.stages=sft,rl --workdir=runs/rl_toy
  python run.py --config=experiments/composer25.py --config.stages=rl --config.rl.feedback_mode=advantage \\
      --config.rl.lambda_feedback=1.0
  python run.py --config=experiments/composer25.py --config.stages=rl --config.rl.env=coding \\
      --config.rl.schedule.steps=1 --config.rl.problems_per_step=1 --config.rl.group_size=2  # after synth
  python run.py --config=experiments/composer25.py --config.stages=pretrain,sft,rl --config.rl.env=ledger \\
      --config.rl.ledger.k=3 --config.rl.max_turns=7 --config.rl.cache_len=624  # ledger-K (issue 32), K = 3

Variants:
  tiny           CPU default (all stages: 6 min 49 s on 2 idle cores). Dense mesh (replica=4,
                 fsdp=1, context=2) and expert mesh (expert=8, expert_fsdp=1) on 8
                 devices (run.py and the tests force 8 CPU devices when no accelerator is present).
  moonlight_16b  Moonlight-16B-A3B (15.96B total, 2.24B active non-embedding): q_proj without
                 q-LoRA, plain RoPE; the smallest real checkpoint of the architecture.
  kimi_k25_1t    Kimi K2.5 text branch (1.03T total, ~33B active): q-LoRA, YaRN factor 64.
Real-model shapes follow the published config.json files (counts from a meta-device init).

Every mesh below must multiply to the device count: `sharding.build_meshes` checks it.
"""

import dataclasses

import ml_collections

from composer_jax import configs
from composer_jax.configs import RopeConfig

VARIANTS = ("tiny", "moonlight_16b", "kimi_k25_1t")


def get_config(variant: str = "tiny") -> ml_collections.ConfigDict:
  if variant not in VARIANTS:
    raise configs.ConfigError(f"unknown variant {variant!r}; known variants: {', '.join(VARIANTS)}")
  return configs.to_config_dict(_VARIANTS[variant]())


def tiny() -> configs.Config:
  """The CPU default: every field is the dataclasses' default but the model's shapes."""
  return configs.Config(variant="tiny", model=_tiny_model())


def _tiny_model() -> configs.ModelConfig:
  """Small enough for every stage on 2 CPU cores (pretrain, sft, gate, rl on both meshes in minutes), with
  every feature of the architecture: q-LoRA, YaRN, a dense first layer, shared + routed experts with
  group-limited routing, 8 experts for EP=8. The byte tokenizer's 267 ids fill a 272-row vocabulary."""
  return configs.ModelConfig(
    vocab_size=272,
    d_model=128,
    n_layers=2,
    n_heads=4,
    dense_mlp_dim=256,
    moe_mlp_dim=128,
    n_experts=8,
    top_k=2,
    n_shared_experts=1,
    n_group=2,  # group-limited routing on: 2 groups of 4 experts, keep 1 group.
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense=1,
    q_lora_rank=64,
    kv_lora_rank=64,
    max_position_embeddings=1024,
    rope=RopeConfig(
      theta=50000.0, kind="yarn", factor=4.0, original_max_position=256, mscale=1.0, mscale_all_dim=1.0
    ),
    expert_impl="blocked",  # dropless; the fastest expert path measured on XLA:CPU (RESULTS.md).
    dispatch="all_to_all",  # XLA:CPU has no ragged-all-to-all.
    capacity_factor=4.0,  # EP send buffers: room for 4x the balanced share per destination device.
    # Unrolled stacks: on XLA:CPU the tiny step is 5-10 % cheaper than scanned (RESULTS.md, issue 15);
    # the full-scale variants scan (compile time on TPU flat in depth).
    scan_layers=False,
  )


def _cluster(config: configs.Config) -> configs.Config:
  """What every full-scale variant changes besides the model and meshes: long runs, the BPE tokenizer,
  all synth sources, activation recompute, and RL batches of one rollout (and at most one teacher row)
  per replica·fsdp device, each up to 4096 tokens with turns of up to 512."""
  replica, fsdp, _ = config.mesh.dense
  rows = replica * fsdp
  schedule = dataclasses.replace(
    config.train.schedule, steps=10_000, warmup_steps=500, log_every=10, eval_every=500, checkpoint_every=500
  )
  rl = configs.RLConfig(
    problems_per_step=rows // 8, group_size=8, feedback_rows=rows, cache_len=4096, max_turn_tokens=512
  )
  return dataclasses.replace(
    config,
    rl=rl,
    stages="demo,pretrain",
    # attention_chunk 0: their training attention is a fused kernel (splash, cuDNN), which never holds the
    # [T, S] scores; the planner's and compile stage's figures stay those of the unchunked XLA forms.
    model=dataclasses.replace(config.model, remat="full", attention_chunk=0),
    train=configs.TrainConfig(
      schedule=schedule,
      batch_size=256,
      seq_len=4096,
      peak_flops=989e12,
    ),  # fmt: skip
    optim=configs.OptimizerConfig(learning_rate=3e-4, muon_dtype="bfloat16"),
    data=configs.DataConfig(tokenizer="bpe"),
    synth=configs.SynthConfig(
      sources="toolz,boltons,cachetools,tabulate,humanize,inflection", max_tasks_per_source=None
    ),
  )


def moonlight_16b() -> configs.Config:
  """Moonlight-16B-A3B: 64 devices, fsdp inside an 8-chip node, 8 replicas; one expert per device."""
  model = configs.ModelConfig(
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
    rope=RopeConfig(theta=50000.0),
    dtype="bfloat16",
    expert_impl="ragged",
    dispatch="ragged_all_to_all",
    # Its 4 rows × 4096 × 163840 fp32 log-softmax (10 GiB per chip) was the step's largest live set;
    # Kimi's (1 row per chip) is not, and chunking it there costs more than it saves.
    loss_chunk=256,
    # The EP receive buffer (capacity factor 2) in 16 row chunks: compute for the rows received, the
    # expert hidden one chunk at a time (RESULTS.md: "The MoE layer computes the rows it received").
    expert_chunks=16,
  )
  return _cluster(
    configs.Config(
      variant="moonlight_16b",
      model=model,
      mesh=configs.MeshConfig(dense=(8, 8, 1), expert=(64, 1)),
      demo=configs.DemoConfig(batch=64, prompt_len=256, decode_tokens=16),
    )
  )


def kimi_k25_1t() -> configs.Config:
  """Kimi K2.5's text branch: 1024 devices, fsdp 16, context 4; 3 of 384 experts per expert row, 8-way."""
  model = configs.ModelConfig(
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
    rope=RopeConfig(
      theta=50000.0, kind="yarn", factor=64.0, original_max_position=4096, mscale=1.0, mscale_all_dim=1.0
    ),
    dtype="bfloat16",
    expert_impl="ragged",
    dispatch="ragged_all_to_all",
  )
  return _cluster(
    configs.Config(
      variant="kimi_k25_1t",
      model=model,
      mesh=configs.MeshConfig(dense=(16, 16, 4), expert=(128, 8)),
      demo=configs.DemoConfig(batch=256, prompt_len=256, decode_tokens=16),
    )
  )


_VARIANTS = {"tiny": tiny, "moonlight_16b": moonlight_16b, "kimi_k25_1t": kimi_k25_1t}
