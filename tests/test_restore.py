"""A checkpoint restores into an abstract template: no weights are initialised or read to resume."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from tiny import TINY

from composer_jax import configs, optim, train
from composer_jax.rl import step as rl_step
from composer_jax.train import checkpoint


def test_restore_into_the_abstract_state_gives_the_saved_state_on_its_shardings(meshes, tmp_path):
  """The RL state (Muon + AdamW, a frozen teacher in the optimizer state) on both meshes, one step
  trained away from its init, saved, then restored into `train.state.abstract_state`: every leaf comes
  back equal and on the sharding the freshly created state would have."""
  ocfg = configs.optimizer_for(configs.OptimizerConfig(learning_rate=1e-2), configs.ScheduleConfig(steps=4))
  tx = rl_step.teacher_optimizer(
    optim.build_optimizer(TINY, ocfg, meshes), configs.RLConfig(teacher="frozen")
  )
  state = train.create_state(TINY, tx, jax.random.key(0), meshes)
  grads = jax.tree.map(lambda p: 1e-2 * jax.numpy.ones_like(p), state.params)
  updates, opt_state = jax.jit(tx.update)(grads, state.opt_state, state.params)  # one compile, not one per op
  state = dataclasses.replace(state, step=state.step + 1, params=optax.apply_updates(state.params, updates))
  state = dataclasses.replace(state, opt_state=opt_state)
  ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", {"what": "test"}, keep=1)
  ckpt.save(state, {"epoch": 0}, force=True)
  ckpt.wait()
  template = train.state.abstract_state(TINY, tx, meshes)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(template))
  restored, data_state = ckpt.restore(template)
  ckpt.close()
  assert data_state == {"epoch": 0} and int(restored.step) == 1
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
