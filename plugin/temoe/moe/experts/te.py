"""The expert MLP on Transformer Engine's grouped GEMM: `transformer_engine.jax.dense.grouped_dense`.

Mirrors `experts.mlp_xla` (same activation hook, row biases and remat names): one grouped GEMM over
MaxText's fused [gate | up] `wi`, one over `wo`. `te_gmm_quantization` picks the GEMM precision: bf16
(te_no_quant), FP8 with per-expert current scaling (te_fp8_current) or MXFP8 (te_mxfp8). grouped_dense
brings its own custom VJP, so gradients need nothing here. TE is imported by this module only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from transformer_engine.jax.dense import grouped_dense
from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode, noop_quantizer_set

from temoe import recipes
from temoe.moe.experts import xla as experts
from temoe.moe.dispatch import DispatchPlan

ROW_ALIGNMENT = recipes.ROW_ALIGNMENT


def recipe_of(cfg) -> str:
  """The te_gmm_quantization value as a plain string (as block.backend_for reads it)."""
  return str(cfg.te_gmm_quantization)


def row_alignment(cfg) -> int:
  """Rows every expert group is padded to for this recipe (see ROW_ALIGNMENT for why)."""
  return ROW_ALIGNMENT[recipe_of(cfg)]


def covering_group_sizes(padded_group_sizes: jax.Array, rows: int) -> jax.Array:
  """Group sizes summing to `rows`: the buffer's spare rows past the last group join the last expert.

  TE's grouped quantize and its multi-stream grouped GEMM (the path FP8 current scaling takes) check
  sum(group_sizes) == rows and fail otherwise; the cuBLAS grouped kernel (bf16, MXFP8) accepts a
  shorter sum but leaves the rows past it uninitialised, which would then flow into the activation
  and the backward quantizers. The spare rows are zeros and combine never reads them; the cost is
  that the last expert multiplies them too. The spare count is a multiple of the alignment.
  """
  spare = rows - jnp.sum(padded_group_sizes)
  return padded_group_sizes.astype(jnp.int32).at[-1].add(spare.astype(jnp.int32))


def quantizer_set(recipe: str, num_experts: int):
  """A fresh quantizer set for one grouped_dense call (per-expert scales for x, kernel and grad).

  Both FP8 recipes are stateless (no amax history), so sets are built at trace time, one per GEMM as
  TE's own MoE does. FP8 current scaling: E4M3 forward, E5M2 gradients (TE's HYBRID format);
  MXFP8: E4M3 both ways, as TE's MXFP8BlockScaling and MaxText's te_mxfp8.
  """
  if recipe == "te_no_quant":
    return noop_quantizer_set
  if recipe == "te_fp8_current":
    return QuantizerFactory.create_set(
        scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING,
        fwd_dtype=jnp.float8_e4m3fn,
        bwd_dtype=jnp.float8_e5m2,
        n_groups=num_experts,
    )
  if recipe == "te_mxfp8":
    return QuantizerFactory.create_set(
        scaling_mode=ScalingMode.MXFP8_1D_SCALING,
        fwd_dtype=jnp.float8_e4m3fn,
        bwd_dtype=jnp.float8_e4m3fn,
        is_2x2x=True,
        n_groups=num_experts,
    )
  raise ValueError(f"te_gmm_quantization={recipe!r}; valid choices: {', '.join(ROW_ALIGNMENT)}.")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: str, dtype) -> jax.Array:
  """Rows of `x` (rows, k) of group e times `w[e]` (k, n). TE wants both operands in one dtype."""
  return grouped_dense(
      x.astype(dtype),
      w.astype(dtype),
      group_sizes,
      contracting_dims=((1,), (1,)),
      preferred_element_type=dtype,
      quantizer_set=quantizer_set(recipe, w.shape[0]),
  )


def mlp(
    layer,
    x: jax.Array,
    p: DispatchPlan,
    wi: jax.Array,
    wo: jax.Array,
    biases: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    rows_expert: jax.Array | None,
) -> jax.Array:
  """Expert MLP on the expert-sorted buffer `x` (p.buffer_rows, emb); same contract as `mlp_xla`.

  Row biases are added outside the GEMMs (as in mlp_xla): a GEMM bias would push bf16 off TE's
  cuBLAS grouped kernel onto its slower multi-stream path.
  """
  recipe = recipe_of(layer.config)
  group_sizes = covering_group_sizes(p.padded_group_sizes, x.shape[0])
  w0_bias, w1_bias, wo_bias = biases
  h = grouped_matmul(x, wi, group_sizes, recipe, layer.dtype)
  w0, w1 = experts.split_gate_up(h)
  w0, w1 = experts.tag_up(
      experts.add_row_bias(w0, w0_bias, rows_expert), experts.add_row_bias(w1, w1_bias, rows_expert)
  )
  act = layer.apply_ffn_activation(w0, w1)
  y = grouped_matmul(act, wo, group_sizes, recipe, layer.dtype)
  return experts.tag_down(experts.add_row_bias(y, wo_bias, rows_expert))
