"""`plan.estimate` on hand-written HLO text: trip counts, loop weighting, slice-aware bytes.

No compiler needed: the module below is what XLA prints for a counted loop (JAX's scan/fori_loop
pattern), and every expected figure is computed by hand. The compiled check (a scanned stack of matmuls
against the unrolled one, XLA:TPU) is `tests/test_compile.py::test_scanned_loop_estimate_matches_...`.
"""

from __future__ import annotations

import pytest

from composer_jax.plan import estimate

_LOOP = """HloModule m

%body (p: (s32[], f32[64,32], f32[5,32,32])) -> (s32[], f32[64,32], f32[5,32,32]) {
  %p = (s32[], f32[64,32]{1,0}, f32[5,32,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,32]{1,0} get-tuple-element(%p), index=1
  %ws = f32[5,32,32]{2,1,0} get-tuple-element(%p), index=2
  %zero = s32[] constant(0)
  %w3 = f32[1,32,32]{2,1,0} dynamic-slice(%ws, %i, %zero, %zero), dynamic_slice_sizes={1,32,32}
  %w = f32[32,32]{1,0} bitcast(%w3)
  %y = f32[64,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="f/transpose(jvp())/dot"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[64,32]{1,0}, f32[5,32,32]{2,1,0}) tuple(%next, %y, %ws)
}

%cond (q: (s32[], f32[64,32], f32[5,32,32])) -> pred[] {
  %q = (s32[], f32[64,32]{1,0}, f32[5,32,32]{2,1,0}) parameter(0)
  %c = s32[] get-tuple-element(%q), index=0
  %limit = s32[] constant(LIMIT)
  ROOT %lt = pred[] compare(%c, %limit), direction=LT
}

ENTRY %main (a: f32[64,32], b: f32[5,32,32]) -> f32[64,32] {
  %a = f32[64,32]{1,0} parameter(0)
  %b = f32[5,32,32]{2,1,0} parameter(1)
  %start = s32[] constant(START)
  %s = s32[] copy(%start)
  %init = (s32[], f32[64,32]{1,0}, f32[5,32,32]{2,1,0}) tuple(%s, %a, %b)
  %loop = (s32[], f32[64,32]{1,0}, f32[5,32,32]{2,1,0}) while(%init), condition=%cond, body=%body CONFIG
  %out = f32[64,32]{1,0} get-tuple-element(%loop), index=1
  ROOT %ag = f32[64,32]{1,0} all-reduce(%out), replica_groups={}, to_apply=%cond
}
"""  # noqa: E501


def _module(start: int = 0, limit: int = 5, config: str = "") -> str:
  return _LOOP.replace("START", str(start)).replace("LIMIT", str(limit)).replace("CONFIG", config)


@pytest.mark.parametrize(
  ("start", "limit", "config", "trips"),
  [
    (0, 5, "", 5),  # JAX's counted loop: constant start through a copy, compare LT constant
    (2, 5, "", 3),
    (0, 5, ', backend_config={"known_trip_count":{"n":"7"}}', 7),  # XLA's annotation wins
  ],
)
def test_trip_count_and_weighted_flops(start, limit, config, trips):
  w = estimate.walk(_module(start, limit, config), "TPU v5")
  assert [loop["trip_count"] for loop in w.loops] == [trips]
  dot = 2 * 64 * 32 * 32
  # FLOPs: the dot and the counter add in the body, the compare in the condition, the all-reduce none.
  assert w.once.flops == dot + 1 + 1
  assert w.weighted.flops == trips * (dot + 1 + 1)
  # Bytes of the body: the slice read and written (one 32x32 layer, not the 5-layer stack), the dot's
  # operands and result, the add's; the condition's compare; outside, the counter's copy and the
  # all-reduce (64x32 read and written) once.
  body = 2 * 32 * 32 * 4 + (64 * 32 + 32 * 32 + 64 * 32) * 4 + 3 * 4
  assert w.weighted.bytes == trips * (body + 2 * 4 + 1) + 2 * 4 + 2 * 64 * 32 * 4
  assert w.weighted.collectives == {"all-reduce": 64 * 32 * 4}


def test_unknown_trip_count_counts_once_and_is_reported():
  text = _module().replace("direction=LT", "direction=NE")  # not the counted-loop pattern
  est = estimate.estimate(text, {"flops": 1.0, "bytes accessed": 1.0, "optimal_seconds": 1.0}, "TPU v5")
  assert est["unknown_trip_counts"] == 1
  assert est["correction"] == {"flops": 1.0, "bytes": 1.0, "seconds": 1.0}


def test_a_data_dependent_loop_counts_its_expected_trips():
  """A loop whose bound is not a constant (the MoE row-chunk loop) counts the trips its scope name
  states; without the scope it counts once and is reported unknown."""
  text = _module().replace("%limit = s32[] constant(5)", "%limit = s32[] get-tuple-element(%q), index=0")
  assert "constant(5)" not in text
  assert [loop["trip_count"] for loop in estimate.walk(text, "TPU v5").loops] == [None]
  scoped = text.replace(
    "condition=%cond, body=%body",
    'condition=%cond, body=%body, metadata={op_name="f/transpose(jvp(expert_row_chunks_expect9))/while"}',
  )
  w = estimate.walk(scoped, "TPU v5")
  assert [(loop["trip_count"], loop["expected"]) for loop in w.loops] == [(9, True)]
  assert w.weighted.flops == 9 * (2 * 64 * 32 * 32 + 2)


def test_estimate_scales_xla_figures_and_falls_back_on_negative_seconds():
  cost = {"flops": 1e9, "bytes accessed": 1e6, "optimal_seconds": 1e-3}
  est = estimate.estimate(_module(), cost, "TPU v5")
  w = estimate.walk(_module(), "TPU v5")
  assert est["flops"] == pytest.approx(1e9 * w.weighted.flops / w.once.flops)
  assert est["step_seconds"] == pytest.approx(1e-3 * w.weighted.seconds / w.once.seconds)
  assert est["seconds_source"] == "xla_optimal_seconds" and 1 < est["correction"]["seconds"] < 5
  bad = estimate.estimate(_module(), cost | {"optimal_seconds": -9.99}, "TPU v5")
  assert bad["seconds_source"] == "roofline" and bad["step_seconds"] == pytest.approx(w.weighted.seconds)


def test_breakdown_sums_to_the_weighted_roofline_by_phase():
  text = _module()
  out = estimate.breakdown(text, "TPU v5", top=3)
  w = estimate.walk(text, "TPU v5")
  assert (
    sum(out["phases"].values()) == pytest.approx(w.weighted.seconds) == pytest.approx(out["roofline_seconds"])
  )
  assert set(out["phases"]) == {
    "backward compute",
    "rest compute (optimizer, loss, copies)",
    "rest collective (optimizer, loss, copies)",
  }
  dot = out["top"][0] if out["top"][0]["op"].startswith("dot") else out["top"][1]
  assert dot["op"] == "dot transpose(jvp())/dot" and dot["flops"] == 5 * 2 * 64 * 32 * 32
