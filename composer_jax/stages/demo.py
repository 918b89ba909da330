"""Stage `demo`: both meshes, the sharded model's parameter table, one forward pass, greedy decoding.

Shape suffixes: B batch, T time, V vocab, N decoded tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from composer_jax import model, sharding
from composer_jax.configs import Config
from composer_jax.stages.record import Stage
from composer_jax.train.losses import next_token_logp


def run(config: Config, workdir: str) -> dict[str, Any]:
  """Sharded init, parameter table, one forward pass, greedy decoding."""
  cfg = config.model
  meshes = sharding.make_meshes(config)
  logging.info("[demo] meshes: %s", sharding.describe(meshes))

  t0 = time.perf_counter()
  if config.init_from:
    params = jax.block_until_ready(model.load_hf_checkpoint(config.init_from, cfg, meshes))
  else:
    params = jax.block_until_ready(model.init(cfg, jax.random.key(config.seed), meshes))
  logging.info("[demo] init: %.1fs", time.perf_counter() - t0)
  logging.info("[demo] parameters:\n%s", param_table(params, model.logical_axes(cfg)))

  rng = jax.random.fold_in(jax.random.key(config.seed), 1)
  tokens_BT = jax.random.randint(rng, (config.demo.batch, config.demo.prompt_len), 0, cfg.vocab_size)
  tokens_BT = jax.device_put(tokens_BT, sharding.activation_sharding(("batch", "seq"), meshes))
  t0 = time.perf_counter()
  forward = jax.jit(functools.partial(model.apply, cfg=cfg, meshes=meshes))
  logits_BTV, aux = jax.block_until_ready(forward(params, tokens=tokens_BT))
  loss = float(-next_token_logp(logits_BTV, tokens_BT).mean())
  uniform = math.log(cfg.vocab_size)
  logging.info(
    "[demo] %s",
    f"forward: logits {tuple(logits_BTV.shape)} {logits_BTV.dtype}, next-token loss {loss:.4f} "
    f"vs uniform ln(V) = {uniform:.4f} ({time.perf_counter() - t0:.1f}s incl. compile)",
  )
  load = sharding.host(aux["expert_load"])
  logging.info(
    "[demo] %s",
    f"experts (EP={meshes.expert_parallelism}, {cfg.expert_impl}): max/mean load per MoE layer "
    f"{[f'{r:.2f}' for r in load.max(1) / load.mean(1)]}, dropped assignments {int(aux['overflow'])}",
  )

  t0 = time.perf_counter()
  decoded_BN = sharding.host(greedy(params, cfg, tokens_BT, config.demo.decode_tokens, meshes))
  seconds = time.perf_counter() - t0
  logging.info(
    "[demo] %s",
    f"greedy decode: {decoded_BN.shape} in {seconds:.1f}s incl. compile; rows 0-1: {decoded_BN[:2].tolist()}",
  )

  summary = dict(loss=loss, uniform_loss=uniform, decoded=decoded_BN.tolist(), decode_seconds=seconds)
  if jax.process_index() == 0:  # the others see it on the shared workdir
    pathlib.Path(workdir, "demo.json").write_text(json.dumps(summary, indent=1))
  return summary


def greedy(params: Any, cfg: Any, prompt_BT: jax.Array, n: int, meshes: sharding.Meshes) -> jax.Array:
  """Argmax continuation [B, n] of full-length prompts: the sampler at temperature 0 (the one decoder)."""
  from composer_jax.rl import sampler

  B, T = prompt_BT.shape
  lengths = jnp.full((B,), T, jnp.int32)
  key = jax.random.key(0)  # unused at temperature 0
  return sampler.sample(
    params, cfg, prompt_BT, lengths, key, max_new_tokens=n, temperature=0.0, meshes=meshes
  ).tokens


@dataclasses.dataclass(frozen=True)
class _Leaf:
  path: str
  shape: tuple[int, ...]
  dtype: str
  axes: tuple[str | None, ...]
  where: str  # "<mesh role> mesh (<axis sizes>) P(<spec>)"
  size: int
  expert: bool


def param_table(params: Any, logical_axes: Any) -> str:
  """Per top-level group: leaves and parameter count; the largest leaf of each group with its
  logical axes and sharding (always including one expert leaf); totals, expert vs non-expert."""
  tree = jax.tree_util.tree_map_with_path(_leaf, logical_axes, params, is_leaf=lambda x: isinstance(x, tuple))
  leaves = jax.tree.leaves(tree)
  groups: dict[str, list[_Leaf]] = {}
  for leaf in leaves:
    groups.setdefault(leaf.path.split("/")[0], []).append(leaf)
  total = sum(leaf.size for leaf in leaves)
  expert = sum(leaf.size for leaf in leaves if leaf.expert)

  lines = [f"{'group':<24}{'leaves':>8}{'params':>14}{'share':>8}"]
  for name, group in groups.items():
    n = sum(leaf.size for leaf in group)
    lines.append(f"{name:<24}{len(group):>8}{_count(n):>14}{n / max(total, 1):>8.1%}")
  shown = [max(group, key=lambda leaf: leaf.size) for group in groups.values()]
  experts = [leaf for leaf in leaves if leaf.expert]
  if experts and not any(leaf.expert for leaf in shown):
    shown.append(max(experts, key=lambda leaf: leaf.size))
  rows = [("leaf", "shape", "dtype", "logical axes", "sharding")]
  rows += [(leaf.path, str(leaf.shape), leaf.dtype, str(leaf.axes), leaf.where) for leaf in shown]
  widths = [max(len(row[i]) for row in rows) + 2 for i in range(4)]
  lines += [""] + [
    "".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + row[-1] for row in rows
  ]
  share = expert / max(total, 1)
  lines += [
    "",
    f"params: total {_count(total)}, expert {_count(expert)} ({share:.1%}), other {_count(total - expert)}",
  ]
  return "\n".join(lines)


def _leaf(path: Any, axes: tuple[str | None, ...], p: Any) -> _Leaf:
  expert, s = sharding.is_expert_param(axes), getattr(p, "sharding", None)
  where = str(s)
  if isinstance(s, jax.sharding.NamedSharding):
    sizes = ",".join(f"{k}={v}" for k, v in s.mesh.shape.items())
    where = f"{'expert' if expert else 'dense'} mesh ({sizes}) P({', '.join(map(repr, s.spec))})"
  path = jax.tree_util.keystr(path, simple=True, separator="/")
  return _Leaf(path, tuple(p.shape), str(p.dtype), tuple(axes), where, math.prod(p.shape), expert)


def _count(n: int) -> str:
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= scale:
      return f"{n / scale:.2f}{unit}"
  return str(n)


def _summarize(s: dict, w: pathlib.Path) -> dict:
  return dict(loss=s.get("loss"), uniform_loss=s.get("uniform_loss"), file=str(w / "demo.json"))


def _lines(r: dict) -> list[str]:
  return [f"  forward loss {r['loss']:.3f} vs uniform {r['uniform_loss']:.3f}"]


def _check(config: Config) -> None:
  from composer_jax import configs

  configs.check_meshes(config)
  configs.check_batch("demo.batch / demo.prompt_len", config.demo.batch, config.demo.prompt_len, config)


STAGE = Stage(
  name="demo",
  run=run,
  check=_check,
  doc="build the sharded model on both meshes, print the parameter table, one forward pass, greedy decoding",
  depends=("seed", "model", "mesh", "demo", "init_from"),
  outputs=("demo.json",),
  summarize=_summarize,
  lines=_lines,
)
