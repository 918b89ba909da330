"""Does the RL update fit this host? The planner's peak of the RL step where every device is a slice of one
host's memory (CPU runs), and the micro-batch budget (`rl.update_tokens`) that makes it fit.

  update_tokens, line = plan.host.resolve_update_tokens(config)   # before the rl stage builds its step

The RL batch's padded length follows the policy: a policy that babbles uses every turn, so the update is
planned at the longest rollout the sampler can write (`rl.cache_len`), the bound it can never exceed.
"""

from __future__ import annotations

import math
import os
import pathlib

from composer_jax import configs
from composer_jax.plan import rollout
from composer_jax.plan.layout import derive_layout

GIB = 2**30


class UpdateDoesNotFit(configs.ConfigError):
  """The RL update cannot fit this host's memory budget as configured (one line naming the knob)."""


def host_memory_bytes() -> int:
  """This host's memory: physical RAM, or the cgroup's limit when lower (a container)."""
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      text = pathlib.Path(limit).read_text().strip()
    except OSError:
      continue
    if text.isdigit():
      total = min(total, int(text))
  return total


def _split(config: configs.Config) -> int:
  """The devices the rollouts are split over (the dense mesh's batch axes)."""
  return derive_layout(config.mesh.dense, config.mesh.expert, None, config.model.n_experts).degrees.batch


def update_bytes(config: configs.Config, micro_rows: int, cols: int | None = None) -> int:
  """Planned bytes of one RL update on this host: every device's predicted peak (`rollout.rl_step`) on
  micro-batches of `micro_rows` rollouts padded to `cols` tokens (default: the longest). A micro-batch
  smaller than the devices it is split over is planned as one row per device (what each device holds)."""
  devices, split = math.prod(config.mesh.dense), _split(config)
  micro = -(-micro_rows // split) * split
  rows = -(-max(rollout.rl_shape(config.rl)[0], micro) // micro) * micro
  return devices * rollout.rl_step(config, micro_rows=micro, cols=cols, rows=rows)["xla"]["peak"]


def _candidates(config: configs.Config) -> list[int]:
  """Micro-batch sizes the update can take, largest first: divisors of the batch, split evenly over the
  devices that hold rows where any is (`rl.batch.micro_rows`'s rule)."""
  rows, _ = rollout.rl_shape(config.rl)
  divisors = [r for r in range(1, rows + 1) if rows % r == 0]
  aligned = [r for r in divisors if r % _split(config) == 0]
  return sorted(aligned or divisors, reverse=True)


def resolve_update_tokens(config: configs.Config, host_bytes: int | None = None) -> tuple[int, str]:
  """(rl.update_tokens to run with, one line for the log or ""): the configured budget, checked against
  `rl.update_memory` × this host's memory at the longest rollout; 0 (auto) becomes the largest
  micro-batch whose planned update fits, said in one line when it is not the whole batch. Raises
  `UpdateDoesNotFit` (one line, naming the knob) when the configured budget, or a single rollout, does not
  fit."""
  r = config.rl
  host = host_memory_bytes() if host_bytes is None else host_bytes
  budget = int(r.update_memory * host)
  rows, cols = rollout.rl_shape(r)
  shape = f"{rows} rollouts x {cols} tokens"
  have = f"rl.update_memory {r.update_memory:g} of this host's {host / GIB:.1f} GiB = {budget / GIB:.1f} GiB"
  if r.update_tokens != 0:
    micro = rows if r.update_tokens < 0 else max(1, min(rows, r.update_tokens // cols))
    need = update_bytes(config, micro, cols)
    if need > budget:
      raise UpdateDoesNotFit(
        f"[rl] the update in micro-batches of {micro} rollouts at the longest rollouts ({shape}, "
        f"rl.update_tokens={r.update_tokens}) is planned at {need / GIB:.1f} GiB, over {have}: "
        "set rl.update_tokens=0 (chosen to fit) or lower it"
      )
    return r.update_tokens, ""
  whole = update_bytes(config, rows, cols)
  if whole <= budget:
    return -1, ""
  need = whole
  for micro in (m for m in _candidates(config) if m < rows):
    need = update_bytes(config, micro, cols)
    if need <= budget:
      return micro * cols, (
        f"[rl] the update of {shape} is planned at {whole / GIB:.1f} GiB, over {have}: micro-batches of "
        f"{micro} rollouts ({need / GIB:.1f} GiB; rl.update_tokens={micro * cols}), gradients summed exactly"
      )
  raise UpdateDoesNotFit(
    f"[rl] even the smallest micro-batch of the update ({shape}) is planned at {need / GIB:.1f} GiB, over "
    f"{have}: lower rl.cache_len (the longest rollout) or raise rl.update_memory"
  )
