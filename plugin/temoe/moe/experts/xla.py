"""The expert MLP on the expert-sorted buffer: gate/up (MaxText's fused `wi`), activation, down.

`xla` runs `jax.lax.ragged_dot`: it runs anywhere and is the oracle for the TE backend.
Intermediates carry MaxText's remat names (moe_mlpwi_0/1, moe_mlpwo), so MaxText's
`remat_policy` and offload settings apply to temoe's block as they do to MaxText's.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name


def split_gate_up(h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """MaxText stores wi as [gate | up] on its last axis; returns the two halves of `h = x @ wi`."""
  half = h.shape[-1] // 2
  return h[..., :half], h[..., half:]


def add_row_bias(h: jax.Array, bias: jax.Array | None, experts_of_rows: jax.Array | None) -> jax.Array:
  return h if bias is None else h + bias[experts_of_rows].astype(h.dtype)


def tag_up(w0: jax.Array, w1: jax.Array) -> tuple[jax.Array, jax.Array]:
  return checkpoint_name(checkpoint_name(w0, "mlpwi_0"), "moe_mlpwi_0"), checkpoint_name(w1, "moe_mlpwi_1")


def tag_down(y: jax.Array) -> jax.Array:
  return checkpoint_name(checkpoint_name(y, "mlpwo"), "moe_mlpwo")


def mlp_xla(
    layer,
    x: jax.Array,
    group_sizes: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    biases: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    experts_of_rows: jax.Array | None,
) -> jax.Array:
  """Expert MLP with `jax.lax.ragged_dot`; `layer` (a MaxText RoutedMoE) supplies the activation."""
  w0_bias, w1_bias, wo_bias = biases
  h = jax.lax.ragged_dot(x, wi, group_sizes, preferred_element_type=layer.dtype)
  w0, w1 = split_gate_up(h)
  w0, w1 = tag_up(add_row_bias(w0, w0_bias, experts_of_rows), add_row_bias(w1, w1_bias, experts_of_rows))
  act = layer.apply_ffn_activation(w0, w1)
  y = jax.lax.ragged_dot(act, wo, group_sizes, preferred_element_type=layer.dtype)
  return tag_down(add_row_bias(y, wo_bias, experts_of_rows))
