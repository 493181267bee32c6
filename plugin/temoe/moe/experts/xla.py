"""The reference expert MLP: gate/up (MaxText's fused `wi`), activation, down, with
`jax.lax.ragged_dot`. It runs anywhere and is the oracle for the GPU kernels."""

from __future__ import annotations

import jax

from temoe.moe.experts import parts


def mlp(
    ctx,
    x: jax.Array,
    p,
    wi: jax.Array,
    wo: jax.Array,
    biases: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    experts_of_rows: jax.Array | None,
) -> jax.Array:
  """Expert MLP on the expert-sorted buffer `x` planned by `p` (a DispatchPlan), with
  `jax.lax.ragged_dot`; `ctx` (a MoEContext) supplies the dtype and the activation."""
  def gemm(a, w):
    return jax.lax.ragged_dot(a, w, p.padded_group_sizes, preferred_element_type=ctx.dtype)

  return parts.gated_mlp(ctx, x, wi, wo, biases, experts_of_rows, gemm)
