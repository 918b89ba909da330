"""The stages a run is made of, one module each; `REGISTRY` maps a name to its `Stage` record.

Adding a stage: write `composer_jax/stages/<name>.py` with a `run(config, workdir) -> summary` function
and a `STAGE = Stage(...)` record (what it depends on, what it writes, how the report shows it), then add
it to `REGISTRY` below. `pipeline`, `resume` and `report` read nothing else.
"""

from composer_jax.stages import compile, demo, gate, plan, pretrain, rl, sft, synth
from composer_jax.stages.record import Interrupted, Stage

REGISTRY: dict[str, Stage] = {
  s.STAGE.name: s.STAGE for s in (demo, pretrain, synth, sft, gate, rl, plan, compile)
}

__all__ = ["REGISTRY", "Interrupted", "Stage"]
