"""Types of per-device values inside `shard_map`: which mesh axes a value varies over.

jax types every value inside `shard_map` as varying or invariant over each mesh axis, and the backward
pass sums (psum) the gradient of an invariant value used with varying ones. A buffer made there with
`jnp.zeros` is invariant; when it holds per-device data it must be typed varying (`vary_like`).
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(x: Any) -> set[str]:
  """The `shard_map` mesh axes a value's type says it varies over (empty outside one)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; other releases call it `vma`
  return set(manual.varying if manual is not None else getattr(aval, "vma", ()))


def vary_like(x: Any, *like: Any) -> Any:
  """`x` (a tree) typed as varying over every axis any of `like` varies over. A buffer made inside
  `shard_map` (e.g. `jnp.zeros`) is typed invariant; when it holds per-device data (the output buffer of
  `ragged_all_to_all`, a loop carry) that type is wrong, and the backward pass would sum its cotangent
  over those axes (`psum` as the transpose of the implicit `pvary`)."""
  axes = set().union(*(varying_axes(a) for a in like))

  def cast(a):
    missing = tuple(sorted(axes - varying_axes(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a

  return jax.tree.map(cast, x)
