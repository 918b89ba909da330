"""Scale planner: what each device holds and sends in one train step of a config on N devices, and
the `compile` stage that checks it against the real compiler (XLA:TPU ahead of time, on a CPU host).

  composer_jax.plan.run(config, workdir)           # stage `plan`:    <workdir>/plan.json
  composer_jax.plan.compile.run(config, workdir)   # stage `compile`: <workdir>/compile.json

Modules: layout (meshes, parameters and their shards), memory (state, activations), comms
(collectives, Newton–Schulz work via `optim.group_views`), core (the `Plan`), report (tables),
compile (AOT compile on an abstract topology, `memory_analysis()` vs the plan), hlo (the optimized HLO
text as instructions), estimate (XLA's cost model with loop bodies weighted by trip count: step time, MFU).
"""

from composer_jax.plan.comms import collective_bytes, muon_groups, muon_work
from composer_jax.plan.core import Plan, make_plan, run
from composer_jax.plan.layout import Layout, Leaf, derive_layout, leaves
from composer_jax.plan.memory import activation_memory, state_memory, tokens
from composer_jax.plan.report import format_plan

__all__ = [
  "Layout",
  "Leaf",
  "Plan",
  "activation_memory",
  "collective_bytes",
  "derive_layout",
  "format_plan",
  "leaves",
  "make_plan",
  "muon_groups",
  "muon_work",
  "run",
  "state_memory",
  "tokens",
]
