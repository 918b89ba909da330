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


# The pretraining batch of tests/test_multihost.py's per-host packing test: 8 rows over replica 4, time
# over context 2, on 2 processes × 4 devices.
PACK_SHAPE = dict(batch_size=8, seq_len=64)
PACK_MESHES = ((4, 1, 2), (8, 1))


class _Counting:
  """A byte tokenizer that records every text it encodes."""

  def __init__(self):
    from composer_jax.data import tokenizer

    self._tok = tokenizer.ByteTokenizer()
    self.eos_id, self.pad_id, self.texts = self._tok.eos_id, self._tok.pad_id, []

  def encode(self, text: str) -> list[int]:
    self.texts.append(text)
    return self._tok.encode(text)


def packed_rows(data_dir: str, src_dir: str, n: int, n_eval: int) -> dict:
  """This process packs its rows of `n` training batches (prefetch 2) and `n_eval` validation batches,
  places them, and reads the global batches back; then it gathers every process's data state and
  continues from it on a fresh iterator for one more batch. Returns the rows it packed, the local
  batch's row count, the first line of each text it tokenized, the global batches, the state and the
  batch after it."""
  import jax
  import numpy as np

  from composer_jax import sharding
  from composer_jax.data import corpus, packing
  from composer_jax.train import batch as batch_lib
  from composer_jax.train import pretrain as pt

  meshes = sharding.build_meshes(*PACK_MESHES)
  splits = corpus.build_corpus(data_dir, src_dir=src_dir, verbose=False)
  tok = _Counting()
  rows = batch_lib.local_rows((PACK_SHAPE["batch_size"], PACK_SHAPE["seq_len"]), meshes)
  it = corpus.batches(splits["train"], tok, **PACK_SHAPE, seed=0, rows=rows.ids, prefetch=2)

  def fetched(b: batch_lib.TokenBatch) -> dict:
    return {k: np.asarray(v).tolist() for k, v in vars(sharding.host(b)).items() if v is not None}

  local, batches = [], []
  for _ in range(n):
    part = next(it)
    local.append(len(part["tokens"]))
    batches.append(fetched(batch_lib.place(batch_lib.TokenBatch.of(part), meshes, rows)))
  state = packing.global_state(it.get_state())
  it.close()
  again = corpus.batches(splits["train"], _Counting(), **PACK_SHAPE, seed=0, rows=rows.ids)
  again.set_state(state)
  after = fetched(batch_lib.place(batch_lib.TokenBatch.of(next(again)), meshes, rows))
  valid = corpus.batches(
    splits["validation"], _Counting(), **PACK_SHAPE, seed=0, shuffle=False, num_epochs=1, rows=rows.ids
  )
  evals = [fetched(b) for b in pt.fixed_batches(valid, n_eval, meshes, rows)]
  return dict(
    process=jax.process_index(), rows=list(rows.ids), local=local, batches=batches, state=state,
    after=after, evals=evals, tokenized=[t.split("\n")[0] for t in tok.texts],
  )  # fmt: skip
