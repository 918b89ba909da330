"""benchmarks/muon_compile.py's reading of a compiled schedule: Muon's ops are found by their named scopes
in a real compile, and `schedule` places Newton–Schulz matmuls and async all-to-alls relative to the end of
the backward pass (on a constructed entry computation, where the right answer is known)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN
from tiny import load_script

from composer_jax import optim, sharding


@pytest.fixture(scope="module")
def bench():
  return load_script("benchmarks/muon_compile.py")


def _line(name: str, op: str, scope: str, args: str = "%p") -> str:
  return f'  %{name} = f32[8,8]{{1,0}} {op}({args}), metadata={{op_name="jit(train_step)/{scope}"}}'


_HLO = "\n".join(
  [
    "%fused_ns (a: f32[8,8]) -> f32[8,8] {",
    "  %a = f32[8,8]{1,0} parameter(0)",
    "  ROOT %d = f32[8,8]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "}",
    "",
    "ENTRY %main (p: f32[8,8]) -> f32[8,8] {",
    "  %p = f32[8,8]{1,0} parameter(0)",
    _line("bw.0", "dot", "transpose(jvp())/dot_general", "%p, %p"),
    _line("a2a-start.1", "all-to-all-start", "muon_group1/shard_map/all_to_all"),
    _line("ns.0", "fusion", "muon_group0/shard_map/newton_schulz/dot_general", "%p), calls=%fused_ns, (%p"),
    _line("bw.1", "dot", "transpose(jvp())/dot_general", "%p, %p"),
    _line("a2a-done.1", "all-to-all-done", "muon_group1/shard_map/all_to_all", "%a2a-start.1"),
    _line("ns.1", "fusion", "muon_group1/shard_map/newton_schulz/dot_general", "%p), calls=%fused_ns, (%p"),
    _line("a2a-start.2", "all-to-all-start", "muon_group0/shard_map/all_to_all"),
    _line("ns.2", "fusion", "muon_group0/shard_map/newton_schulz/dot_general", "%p), calls=%fused_ns, (%p"),
    _line("a2a-done.2", "all-to-all-done", "muon_group0/shard_map/all_to_all", "%a2a-start.2"),
    "  ROOT %out = f32[8,8]{1,0} add(%p, %p)",
    "}",
  ]
)


def test_schedule_on_a_known_entry(bench):
  s = bench.schedule(_HLO)
  assert s["backward_instructions"] == 2 and s["backward_ends_at"] == 4
  assert s["muon_groups"] == 2 and s["ns_matmuls"] == 3 and s["first_ns_matmul_at"] == 3
  assert s["ns_matmuls_before_backward_ends"] == 1  # ns.0 runs between the two backward dots
  assert s["backward_matmuls"] == 2 and s["backward_matmuls_after_first_ns"] == 1
  assert s["muon_collectives_before_backward_ends"] == 1  # group 1's all-to-all starts before bw.1
  # group 1's all-to-all holds group 0's ns.0; group 0's holds only its own ns.2, which does not count
  assert s["muon_async_all_to_alls"] == 2 and s["with_other_groups_ns_inside"] == 1
  assert s["max_other_groups_ns_inside"] == 1


def test_named_scopes_reach_the_compiled_update(bench):
  """The compiled update's NS matmuls carry `muon_group<i>` and `newton_schulz` (what `schedule` reads)."""
  params = {"a": jnp.ones((64, 32)), "b": jnp.ones((4, 32, 48))}
  dn = {"a": MDN(0, 1), "b": MDN(1, 2)}
  fsdp_meshes = sharding.build_meshes((2, 4, 1), (8, 1))
  shard = {"a": NamedSharding(fsdp_meshes.dense, P("fsdp")), "b": NamedSharding(fsdp_meshes.dense, P())}
  tx = optim.sharded_muon(0.1, dimension_numbers=dn, meshes=fsdp_meshes, shardings=shard)
  params = jax.tree.map(jax.device_put, params, shard)
  hlo = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
  s = bench.schedule(hlo)
  assert s["muon_groups"] == 2, s  # two shapes, two groups
  assert s["ns_matmuls"] >= 2 * 5, s  # at least one matmul per NS step and group
  assert s["backward_instructions"] == 0, s
