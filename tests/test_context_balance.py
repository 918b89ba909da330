"""Causal load balancing over the context axis (`context_balance.balance_sequence`,
model.context_load_balance).

The reorder and its inverse; one training step's loss and gradients with the reorder ≡ without on the
dense mesh (replica=4, fsdp=1, context=2), for every attention path that takes it; the causal work
per context shard, counted from the masks the code builds (the "xla" rule on the carried positions,
splash's block-sparsity info) against counts made here from the definition. Shape suffixes: B batch,
T time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY

from composer_jax import configs, context_balance, model
from composer_jax.model import attention_kernels, tokamax_private
from composer_jax.stages import pretrain as pretrain_stage
from composer_jax.train import step as step_lib
from composer_jax.train.batch import TokenBatch, place

# --- the reorder ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
def test_balance_sequence_round_trip_and_chunk_assignment(shards):
  """Shard i of a contiguous split of the balanced row holds natural chunks i and 2·shards−1−i (of
  2·shards); restore_sequence undoes it, for NumPy and jax arrays, along any axis."""
  chunk = 3
  T = 2 * shards * chunk
  x_BT = np.arange(2 * T).reshape(2, T)
  balanced_BT = context_balance.balance_sequence(x_BT, shards)
  np.testing.assert_array_equal(context_balance.restore_sequence(balanced_BT, shards), x_BT)
  np.testing.assert_array_equal(
    np.asarray(context_balance.balance_sequence(jnp.asarray(x_BT), shards)), balanced_BT
  )
  np.testing.assert_array_equal(context_balance.balance_sequence(x_BT.T, shards, axis=0), balanced_BT.T)
  per_shard = T // shards
  for i in range(shards):
    j = 2 * shards - 1 - i
    want = np.concatenate(
      [x_BT[:, i * chunk : (i + 1) * chunk], x_BT[:, j * chunk : (j + 1) * chunk]], axis=1
    )
    np.testing.assert_array_equal(balanced_BT[:, i * per_shard : (i + 1) * per_shard], want)
  if shards > 1:
    with pytest.raises(ValueError, match="equal chunks"):
      context_balance.balance_sequence(np.arange(T + 1)[None], shards)


# --- one training step: balanced ≡ natural ------------------------------------------------------


def _packed_batch(T: int) -> dict:
  """Four rows of three documents each (positions restart per document; the last ends in padding)."""
  rng = np.random.default_rng(7)
  sizes = (T // 4, T // 2, T // 4 - 3)
  seg_BT = np.concatenate([np.repeat([1, 2, 3], sizes), np.zeros(3, int)])[None].repeat(4, 0)
  pos_BT = np.concatenate([np.arange(n) for n in (*sizes, 3)])[None].repeat(4, 0)
  tokens_BT = rng.integers(0, TINY.vocab_size, (4, T))
  return {
    k: v.astype(np.int32) for k, v in dict(tokens=tokens_BT, positions=pos_BT, segment_ids=seg_BT).items()
  }


@pytest.mark.parametrize("impl, T", [("xla", 16), ("absorbed", 16), ("splash", 256)])
def test_train_step_loss_and_gradients_equal_with_and_without_balance(impl, T, meshes, monkeypatch):
  if impl == "splash":
    pytest.importorskip("tokamax", reason="splash attention comes from tokamax, which is not installed")
    interpret = functools.partial(attention_kernels.splash, interpret=jax.devices()[0].platform != "tpu")
    monkeypatch.setitem(attention_kernels.KERNELS, "splash", interpret)
  seen = []
  apply = model.apply
  monkeypatch.setattr(model, "apply", lambda *a, **kw: seen.append(kw.get("balanced")) or apply(*a, **kw))
  base = dataclasses.replace(TINY, attention_impl=impl)
  params = model.init(base, jax.random.key(0), meshes)
  batch = place(TokenBatch.of(_packed_batch(T)), meshes)
  results = []
  for on in (False, True):
    cfg = dataclasses.replace(base, context_load_balance=on)
    assert step_lib.balance_shards(cfg, meshes) == (2 if on else 1)

    def nll_and_aux(p, b, cfg=cfg):  # the gradient of the mean loss, as the step takes it
      nll, count, aux = step_lib.forward_nll(p, cfg, b, meshes)
      return nll / count, (nll, count, aux)

    grads, (nll, count, aux) = jax.jit(jax.grad(nll_and_aux, has_aux=True))(params, batch)
    results.append((jax.device_get(grads), float(nll), float(count), np.asarray(aux["max_logit"])))
  assert seen == [False, True]  # the balanced run really went through the model reordered
  (g0, nll0, n0, max0), (g1, nll1, n1, max1) = results
  assert n0 == n1 > 0 and nll0 > 0
  np.testing.assert_allclose(nll1, nll0, rtol=1e-6)
  np.testing.assert_allclose(max1, max0, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8), g1, g0)


def test_bad_combinations_are_one_line_config_errors():
  """cuDNN masks by index; the length must cut into 2·context chunks. Off, or context 1: no check."""
  config = configs.Config(model=dataclasses.replace(TINY, attention_impl="cudnn"))
  with pytest.raises(configs.ConfigError, match="context_load_balance.*cudnn"):
    pretrain_stage._check(config)
  config = dataclasses.replace(config, model=TINY, train=dataclasses.replace(config.train, seq_len=126))
  with pytest.raises(configs.ConfigError, match="2·context = 4 chunks: train.seq_len 126"):
    pretrain_stage._check(config)
  off = dataclasses.replace(config.model, attention_impl="cudnn", context_load_balance=False)
  config = dataclasses.replace(config, model=off, train=configs.TrainConfig())
  with pytest.raises(configs.ConfigError, match="data.tokenizer 'nope'"):  # past the balance check
    pretrain_stage._check(
      dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer="nope"))
    )


# --- the causal work per context shard -----------------------------------------------------------


def _rows_per_shard(T: int, shards: int, balanced: bool) -> list[np.ndarray]:
  """The natural positions of each shard's query rows, from the definition (not from the code)."""
  if not balanced:
    return [np.arange(i * T // shards, (i + 1) * T // shards) for i in range(shards)]
  c = T // (2 * shards)
  return [np.r_[i * c : (i + 1) * c, (2 * shards - 1 - i) * c : (2 * shards - i) * c] for i in range(shards)]


def _reference_blocks(rows: np.ndarray, T: int, bq: int, bk: int) -> int:
  """Unmasked (query block, key block) pairs of one shard: a block pair is visible iff some key in it
  is at or before some query row in it (keys in natural order)."""
  return sum(
    int(kb * bk <= rows[qb : qb + bq].max()) for qb in range(0, len(rows), bq) for kb in range(T // bk)
  )


def _splash_blocks(T: int, shards: int, balanced: bool, bq: int, bk: int) -> np.ndarray:
  """Active blocks per query shard in splash's block-sparsity info for the mask the kernel is built with."""
  masks, info = (tokamax_private.module(m) for m in ("splash_mask", "splash_mask_info"))
  mask = attention_kernels._causal_mask(masks, T, T, shards, balanced)
  return np.asarray(info.process_mask(mask, (bq, bk), q_seq_shards=shards)[0].num_active_blocks)


def _xla_pairs(T: int, shards: int, balanced: bool) -> np.ndarray:
  """Visible (query, key) pairs per shard of the "xla" rule on the positions a balanced forward carries:
  queries in `balance_sequence` order, keys restored to natural order (attention.MLA._expanded)."""
  pos_BT = np.arange(T)[None]
  q_pos_BT = context_balance.balance_sequence(pos_BT, shards) if balanced else pos_BT
  k_pos_BS = context_balance.restore_sequence(q_pos_BT, shards) if balanced else pos_BT
  ones = np.ones_like(pos_BT)
  visible_TS = np.asarray(attention_kernels.visible(q_pos_BT, k_pos_BS, ones, ones))[0]
  return visible_TS.reshape(shards, T // shards, T).sum(axis=(1, 2))


@pytest.mark.parametrize("shards", [2, 4])
def test_causal_work_per_context_shard(shards):
  """Before: the last shard does the most (max/mean = 2·CP/(CP+1) with one query block per shard,
  more with finer blocks); after: every shard the same (max/mean = 1), in elements and in blocks."""
  T = 64 * shards
  ratio = lambda n: float(np.max(n) / np.mean(n))  # noqa: E731
  for balanced in (False, True):
    rows = _rows_per_shard(T, shards, balanced)
    pairs = _xla_pairs(T, shards, balanced)
    np.testing.assert_array_equal(pairs, [_reference_blocks(r, T, 1, 1) for r in rows])
    for bq, bk in ((8, 8), (16, 32)):
      got = _splash_blocks(T, shards, balanced, bq, bk)
      np.testing.assert_array_equal(got, [_reference_blocks(r, T, bq, bk) for r in rows])
    if balanced:
      assert ratio(pairs) == ratio(got) == 1.0
    else:
      coarse = _splash_blocks(T, shards, False, T // shards, T // shards)
      assert ratio(coarse) == pytest.approx(2 * shards / (shards + 1), abs=1e-12)
      assert ratio(pairs) > ratio(got) > ratio(coarse) > 1.0
