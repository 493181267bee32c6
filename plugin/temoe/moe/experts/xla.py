"""The reference expert MLP: gate/up (MaxText's fused `wi`), activation, down, with
`jax.lax.ragged_dot`. It runs anywhere and is the oracle for the GPU kernels."""

from __future__ import annotations

import jax

from temoe.moe.experts.parts import add_row_bias, split_gate_up, tag_down, tag_up


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
  w0_bias, w1_bias, wo_bias = biases
  h = jax.lax.ragged_dot(x, wi, p.padded_group_sizes, preferred_element_type=ctx.dtype)
  w0, w1 = split_gate_up(h)
  w0, w1 = tag_up(add_row_bias(w0, w0_bias, experts_of_rows), add_row_bias(w1, w1_bias, experts_of_rows))
  act = ctx.activation(w0, w1)
  y = jax.lax.ragged_dot(act, wo, p.padded_group_sizes, preferred_element_type=ctx.dtype)
  return tag_down(add_row_bias(y, wo_bias, experts_of_rows))
