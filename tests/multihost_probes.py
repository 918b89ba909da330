"""Functions that tests/test_multihost.py runs in every process of a multi-process run (through
`multihost.run_function`); each returns what that process saw, JSON-able."""

from __future__ import annotations

import pathlib


def checkpoint_verdicts(directory: str, corrupt_process: int) -> dict:
  """Two saves of a small sharded state; then process `corrupt_process` flips a byte of one of its own
  files of the newer step, and every process restores through a fresh Checkpointer. Returns the step
  restored, the value restored, the files this process hashed and what was set aside."""
  import flax.struct
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec

  from composer_jax.train import checkpoint

  @flax.struct.dataclass
  class State:
    step: jax.Array
    w: jax.Array

  mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))

  def state(step: int, value: float) -> State:
    make = jax.jit(
      lambda: State(jnp.int32(step), jnp.full((1024,), value)), out_shardings=State(replicated, split)
    )
    return make()

  ckpt = checkpoint.Checkpointer(directory, {"probe": 1}, keep=3)
  for step in (1, 2):
    ckpt.save(state(step, float(step)), {})
  ckpt.close()
  multihost_utils.sync_global_devices("saved")
  step_dir = pathlib.Path(directory, "2")
  if jax.process_index() == corrupt_process:
    victim = max(step_dir.glob(f"state/ocdbt.process_{corrupt_process}/d/*"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
  multihost_utils.sync_global_devices("corrupted")

  hashed, digest = [], checkpoint._digest

  def recording(path: pathlib.Path) -> str:
    hashed.append(str(path.relative_to(step_dir.parent)))
    return digest(path)

  checkpoint._digest = recording
  restored, _ = checkpoint.Checkpointer(directory, {"probe": 1}, keep=3).restore(state(0, 0.0))
  total = jax.jit(jnp.sum, out_shardings=replicated)(restored.w)
  return dict(
    step=int(restored.step),
    total=float(total),
    hashed=hashed,
    set_aside=sorted(p.name.split("-")[0] for p in pathlib.Path(directory, "corrupt").iterdir()),
  )


def workdir_lock(workdir: str) -> str:
  """Every process enters the pipeline's lock (process 0 takes it): what each one got."""
  import jax

  from composer_jax import lock

  pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
  try:
    with lock.hold(workdir, primary=jax.process_index() == 0):
      return "held"
  except lock.WorkdirBusy as e:
    return str(e)
