"""RL on multi-turn tool rollouts: turn format, sampler, environments, objectives, text feedback.

The data flow, one module each: `engine` (the `Rollout` protocol; the KV-cache sampler) → `rollout`
(lockstep episodes over turns) → `batch` (the typed `RLBatch` + the teacher's inputs for flagged turns) →
`loss` (objective + targeted feedback) → `step` (the loss for `train.step.make_step`, the teacher in the
optimizer state) → `loop` (RL's hooks for `train.loop.fit`). `sft` warms the pretrained model up first.

  from composer_jax import rl
  traj = rl.envs.rollout(rl.envs.toy.ToyEnv(), seed, act)           # chat.Trajectory, never raises
  batch = rl.to_arrays(trajs, pad_to=256)                            # padded numpy batch
  for k, kind in rl.feedback.detect(traj, env.info()):               # turns that went wrong
    hint = rl.feedback.hint_ids(rl.feedback.hint_at(traj, k, kind, env.info()))  # "Note: the tool ..."
    t = rl.feedback.teacher_inputs(traj, k, hint)                    # teacher = prefix + hint + turn k
  rl.feedback_loss(student_logits, teacher_logits, mask, kind="forward_kl", clip=2.0)   # -> (sum, count)
  rl.policy_loss(logp, old_logp, adv, mask, objective="drgrpo")               # -> (sum, count)
  rl.sft.hooks(...), rl.loop.hooks(...)     # SFT's and RL's hooks for train.loop.fit (stages sft, rl)
  rl.gate.run(params, cfg, rcfg, gcfg, tok, meshes)   # does the hinted teacher beat the student? (gate)

`rl.envs` (stale-docs, toy and coding environments) is a subpackage, imported on use: the coding env
pulls in synth. `rl.gate` and `rl.stats` (the gate's and the seed comparison's statistics) likewise.
"""

from composer_jax.configs import RLConfig, SFTConfig
from composer_jax.rl import chat, feedback, sampler, sft
from composer_jax.rl.chat import ParseError, ToolCall, Trajectory, parse_tool_call, to_arrays
from composer_jax.rl.divergence import feedback_loss
from composer_jax.rl.feedback import FeedbackRules, detect, hint_for, teacher_inputs
from composer_jax.rl.objectives import advantages, policy_loss

__all__ = [
  "FeedbackRules",
  "ParseError",
  "RLConfig",
  "SFTConfig",
  "ToolCall",
  "Trajectory",
  "advantages",
  "chat",
  "detect",
  "feedback",
  "feedback_loss",
  "hint_for",
  "parse_tool_call",
  "policy_loss",
  "sampler",
  "sft",
  "teacher_inputs",
  "to_arrays",
]
