"""What every expert kernel shares around its GEMMs: MaxText's fused [gate | up] layout, row biases,
and MaxText's remat names (moe_mlpwi_0/1, moe_mlpwo, and `quantization` on FP8 residuals), so MaxText's
`remat_policy` and offload settings apply to temoe's block as they do to MaxText's own."""

from __future__ import annotations

from typing import Callable

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


QUANTIZED = "quantization"
"""MaxText's remat name for quantized GEMM operands (its Transformer Engine layers name theirs so): its
`*_with_quantization` policies keep them for the backward instead of quantizing again."""


FP8_WEIGHTS = "te_moe_fp8_weights"
"""temoe's remat name for the expert weights' FP8 copies and scales (also `quantization`). MaxText's
custom policy saves the names its config lists; temoe's flag of the same name adds this one
(temoe.maxtext.config), so the backward reads the copies the forward made instead of making them again
(current scaling: one cast pass per weight from the kept scales, FP8_SCALES; blockwise: one quantizing pass)."""


FP8_SCALES = "te_moe_fp8_scales"
"""temoe's remat name for the expert weights' per-expert FP8 scales (current scaling), which temoe adds
to the names MaxText's custom policy keeps (temoe.maxtext.config): G floats per weight, and with them
the backward casts the weights again in one pass, with no second amax pass over them."""


def tag_weight_scales(scales: jax.Array) -> jax.Array:
  """FP8_SCALES, and `quantization` (MaxText's *_with_quantization policies keep them too)."""
  return checkpoint_name(tag_quantized(scales)[0], FP8_SCALES)


def tag_quantized_weights(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """The expert weights' FP8 copies and scales: `quantization`, and FP8_WEIGHTS for a policy that keeps
  them alone (weights are re-read every step; activations' copies are another size and trade-off)."""
  return tuple(checkpoint_name(a, FP8_WEIGHTS) for a in tag_quantized(*arrays))


def tag_quantized(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """A GEMM's FP8 copies and their scales, named as MaxText names its own: those its backward reads and
  those its forward reads, so a policy that keeps them also spares a recomputed forward its quantization
  (minimal_with_context recomputes the gate/up GEMM for its up half)."""
  return tuple(checkpoint_name(a, QUANTIZED) for a in arrays)


def gated_mlp(
    ctx,
    x: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    biases: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    experts_of_rows: jax.Array | None,
    gemm: Callable[[jax.Array, jax.Array], jax.Array],
) -> jax.Array:
  """The expert MLP every kernel computes, around its grouped GEMM `gemm(rows, w)`: gate/up over
  MaxText's fused `wi`, row biases (outside the GEMMs), remat names, `ctx.activation`, down over `wo`."""
  w0_bias, w1_bias, wo_bias = biases
  w0, w1 = split_gate_up(gemm(x, wi))
  w0, w1 = tag_up(add_row_bias(w0, w0_bias, experts_of_rows), add_row_bias(w1, w1_bias, experts_of_rows))
  y = separate(gemm(ctx.activation(w0, w1), wo))
  return tag_down(add_row_bias(y, wo_bias, experts_of_rows))


def separate(y: jax.Array) -> jax.Array:
  """y unchanged, behind an optimization barrier. A remat policy that keeps the down GEMM's output
  (moe_mlpwo) has it written into the scan's stacked residual and also read by the combine; XLA's
  dynamic-slice fusion then clones the GEMM's custom call to write the stack in place, running the
  down GEMM twice in the forward (0.73 ms a DeepSeek-V3 proxy layer on the H200). Behind the barrier
  the stack gets a copy of y instead."""
  return jax.lax.optimization_barrier(y)
