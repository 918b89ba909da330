"""docs/cluster.md's and docs/scale.md's memory and fit claims, recomputed.

The doc quotes XLA:TPU's compiled per-chip memory (the `compile` stage, run by hand: minutes to an hour
per variant, numbers in benchmarks/RESULTS.md) and the planner's GPU estimates. This parses its tables
and checks each claim against the planner and against itself: a fit is claimed only where the quoted
peak is within the chip, the planner agrees with the quoted XLA:TPU numbers within the 15 % the issue
asks of it, and every plan-only number is what the planner computes today. A planner or config change
that moves a number, or a doc edit that claims a fit the numbers do not show, fails here.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import re

import pytest

from composer_jax import configs
from composer_jax.plan import compile as compile_stage
from composer_jax.plan import core

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_DOC = "\n".join((_ROOT / "docs" / name).read_text() for name in ("cluster.md", "scale.md"))
_V5P_GIB = compile_stage.HBM_BYTES["TPU v5"] / 2**30
_GIB = 2**30
_ROUNDING = 0.051  # the doc rounds GiB to 0.1
_XLA_COLUMN = "per chip: argument / temp / peak (XLA:TPU)"
_PROSE = " ".join(_DOC.split())  # the text with its line breaks as spaces


def _config(variant: str, overrides: dict[str, str] | None = None) -> configs.Config:
  spec = importlib.util.spec_from_file_location("composer25", _ROOT / "experiments" / "composer25.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cd = module.get_config(variant)
  for key, value in (overrides or {}).items():
    *path, last = key.split(".")
    node = cd
    for p in path:
      node = node[p]
    node[last] = type(node[last])(eval(value.strip("'\"")))  # tuples and ints, as the flags parse them
  return configs.from_config(cd)


def _table(first_header: str) -> list[dict[str, str]]:
  """The markdown table whose header row starts with `first_header`, as {column: cell} rows."""
  lines = _DOC.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
  cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
  header, rows = cells(lines[start]), []
  for line in lines[start + 2 :]:
    if not line.startswith("|"):
      break
    rows.append(dict(zip(header, cells(line), strict=True)))
  return rows


def _numbers(cell: str) -> list[float]:
  return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell)]


def _variant(cell: str) -> str:
  return cell.strip("`")


_COMPILED = _table("variant | topology")
_MESHES = _table("variant | devices")


def test_the_doc_has_the_tables():
  assert {_variant(r["variant"]) for r in _COMPILED} == {"moonlight_16b", "kimi_k25_1t"}
  assert {_variant(r["variant"]) for r in _MESHES} == {"moonlight_16b", "kimi_k25_1t"}


@pytest.mark.parametrize("row", _COMPILED, ids=lambda r: _variant(r["variant"]))
def test_compiled_fit_claims(row):
  """Per chip on v5p: the claimed fit follows from the quoted XLA:TPU peak, the peak from its parts,
  and the planner's argument and temp are within 15 % of XLA's (its ratio quoted as computed)."""
  config = _config(_variant(row["variant"]))
  chips = math.prod(int(x) for x in re.match(r"v5p:(\d+)x(\d+)x(\d+)", row["topology"]).groups())
  assert chips == math.prod(config.mesh.dense) == math.prod(config.mesh.expert)
  argument, temp, peak = _numbers(row[_XLA_COLUMN])
  assert abs(argument + temp - peak) <= 2 * _ROUNDING  # peak = argument + temp + output − alias, donated
  fits = {"yes": True, "no": False}[row["fits 95 GiB"]]
  assert fits == (peak <= _V5P_GIB), row
  plan = core.make_plan(config, tpu=True).xla
  assert abs(plan["argument"] / _GIB / argument - 1) <= 0.15, (plan, row)
  ratio = plan["temp"] / _GIB / temp
  (quoted,) = _numbers(row["plan temp / XLA temp"])
  assert abs(ratio - quoted) <= 0.01 + _ROUNDING / temp, (ratio, row)
  if fits:  # the planner, used where nothing compiled, must not contradict a fit
    assert plan["peak"] / _GIB <= _V5P_GIB, plan


@pytest.mark.parametrize("row", _COMPILED, ids=lambda r: _variant(r["variant"]))
def test_planner_temp_within_15_percent_of_the_quoted_compile(row):
  (quoted,) = _numbers(row["plan temp / XLA temp"])
  assert abs(quoted - 1) <= 0.15, row


@pytest.mark.parametrize("row", _MESHES, ids=lambda r: _variant(r["variant"]))
def test_mesh_table_matches_the_configs_the_compiles_and_the_plan(row):
  """The mesh table's meshes are the configs', its v5p peak is the compile table's, and its GPU peak
  (plan only) is today's plan and within jax's preallocated share of an H200, as the doc says."""
  variant = _variant(row["variant"])
  config = _config(variant)
  assert _numbers(row["dense `(replica, fsdp, context)`"]) == list(config.mesh.dense)
  assert _numbers(row["expert `(expert, expert_fsdp)`"]) == list(config.mesh.expert)
  assert int(row["devices"]) == math.prod(config.mesh.dense)
  gpu = core.make_plan(config)
  params = (gpu.memory["dense"]["params"] + gpu.memory["expert"]["params"]) / _GIB
  assert abs(params - _numbers(row["fp32 params / device"])[0]) <= _ROUNDING, (params, row)
  compiled = next(r for r in _COMPILED if _variant(r["variant"]) == variant)
  assert _numbers(row["peak / chip, v5p (XLA:TPU)"])[0] == _numbers(compiled[_XLA_COLUMN])[2]
  v6e_gib = 32e9 / _GIB  # a v6e chip's HBM: 32 GB
  assert "or v6e" not in row["TPU"] or _numbers(compiled[_XLA_COLUMN])[2] <= v6e_gib, row
  (quoted,) = _numbers(row["peak / GPU (plan only)"])
  assert abs(gpu.peak_bytes / _GIB - quoted) <= _ROUNDING, (gpu.peak_bytes / _GIB, row)
  usable = config.plan.hbm_gib * config.plan.mem_fraction
  assert f"{usable:.1f} GiB of a {config.plan.hbm_gib:.0f} GB H200, on which both fit by the plan" in _PROSE
  assert gpu.fits and gpu.peak_bytes / _GIB <= usable


def test_the_node_local_kimi_mesh_plan():
  """The doc's alternative Kimi mesh for 8-GPU nodes: its overrides pass the config checks and give
  the plan's peak the doc quotes."""
  block = _PROSE.split("To keep that group inside one node:", 1)[1].split("```")[1]
  overrides = dict(re.findall(r"--config\.([\w.]+)=(\S+)", block))
  assert overrides["mesh.dense"] == "'(64,8,2)'"
  plan = core.make_plan(_config("kimi_k25_1t", overrides))
  (quoted,) = _numbers(re.search(r"the plan's peak is ([\d.]+) GiB per GPU", _PROSE).group(1))
  assert abs(plan.peak_bytes / _GIB - quoted) <= _ROUNDING, plan.peak_bytes / _GIB
  params = (plan.memory["dense"]["params"] + plan.memory["expert"]["params"]) / _GIB
  (quoted,) = _numbers(re.search(r"raises the fp32 params to ([\d.]+) GiB", _PROSE).group(1))
  assert abs(params - quoted) <= _ROUNDING, params
