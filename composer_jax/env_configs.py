"""The `rl` section's environment sub-sections (`rl.stale`, `rl.coding`, `rl.ledger`), re-exported by
`configs`. Plain frozen dataclasses with no imports: each environment reads its own sub-section.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StaleEnvConfig:
  """`rl.env="stale"`: arithmetic through tools whose docs may name a retired tool (`rl.envs.stale`)."""

  rate: float = 0.3  # per tool: P(the prompt documents its retired name); ~36 % of episodes need one
  invalid_penalty: float = 0.25  # reward lost per invalid call
  max_errors: int = 1  # the episode ends at the first invalid call (retries let RL alone find the rule)
  max_ops: int = 2


@dataclasses.dataclass(frozen=True)
class CodingEnvConfig:
  """`rl.env="coding"`: the sandboxed coding environment over the synth stage's tasks."""

  output_chars: int = 2000  # tool output shown to the model, at most


@dataclasses.dataclass(frozen=True)
class LedgerEnvConfig:
  """`rl.env="ledger"`: K pairs to enter through `add` / `fadd` (`rl.envs.ledger`). rl.max_turns and
  rl.cache_len must hold a whole episode: `ledger.budget(k, informative)` gives both (the rl stage checks)."""

  k: int = 3  # pairs per episode: 3 short (~5 turns), 12 long (14 turns, ~450 tokens)
  risky_share: float = 0.5  # P(a pair sums to >= 100, where the RL server's fadd wraps)
  # Arm "informative": a wrapping fadd records nothing, the hint comes back as the tool's reply and the
  # entry can be redone; each such call costs `redo_cost` (without a cost a redo would rescue every
  # rollout, every advantage would be 0 and the arm could not learn the first attempt).
  informative: bool = False
  redo_cost: float = 0.25
  demo_max_k: int = 12  # SFT demos draw K from 1..demo_max_k: one SFT checkpoint serves every K up to it
  rule_in_prompt: bool = False  # evaluation of the reference policy (the SFT model told the rule); never RL
