"""The expert MLP on Transformer Engine's grouped GEMM: `transformer_engine.jax.dense.grouped_dense`.

Mirrors `xla.mlp` (same activation hook, row biases and remat names): one grouped GEMM over
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
from temoe.moe.experts import parts
from temoe.moe import dispatch
from temoe.moe.dispatch import DispatchPlan


def quantizer_set(recipe: str, num_experts: int):
  """A fresh quantizer set for one grouped_dense call (per-expert scales for x, kernel and grad).

  Both FP8 recipes are stateless (no amax history), so sets are built at trace time, one per GEMM as
  TE's own MoE does; dtypes and scaling come from the recipe registry.
  """
  r = recipes.REGISTRY[recipe]
  if not r.fp8:
    return noop_quantizer_set
  mode = {"current": ScalingMode.CURRENT_TENSOR_SCALING, "mxfp8": ScalingMode.MXFP8_1D_SCALING}[r.scaling]
  both_layouts = {"is_2x2x": True} if r.scaling == "mxfp8" else {}  # MXFP8: rowwise and colwise copies
  return QuantizerFactory.create_set(
      scaling_mode=mode,
      fwd_dtype=getattr(jnp, r.fwd_dtype),  # TE checks for the jnp scalar types themselves
      bwd_dtype=getattr(jnp, r.bwd_dtype),
      n_groups=num_experts,
      **both_layouts,
  )


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
    ctx,
    x: jax.Array,
    p: DispatchPlan,
    wi: jax.Array,
    wo: jax.Array,
    biases: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    rows_expert: jax.Array | None,
) -> jax.Array:
  """Expert MLP on the expert-sorted buffer `x` (p.buffer_rows, emb); same contract as `xla.mlp`.

  Row biases are added outside the GEMMs (as in xla.mlp): a GEMM bias would push bf16 off TE's
  cuBLAS grouped kernel onto its slower multi-stream path.
  """
  group_sizes = dispatch.covering_group_sizes(p.padded_group_sizes, x.shape[0])

  def gemm(a, w):
    return grouped_matmul(a, w, group_sizes, ctx.recipe, ctx.dtype)

  return parts.gated_mlp(ctx, x, wi, wo, biases, rows_expert, gemm)
