"""The expert MLP on temoe's Pallas Mosaic GPU grouped GEMMs for Hopper (`mosaic_gemm`): group sizes
stay on the device, one kernel launch per GEMM, no host sync, so the step is CUDA-graph friendly.

Same contract as `xla.mlp` (activation hook, row biases, MaxText's remat names): one grouped GEMM
over MaxText's fused [gate | up] `wi`, the activation, one over `wo`; each GEMM carries its own
custom VJP (dgrad and wgrad kernels). `te_fp8_current` runs them in FP8 with per-expert current
scaling (E4M3 forward, E5M2 gradients), `te_fp8_blockwise` in FP8 with DeepSeek-V3's block scales
(`fp8_block`), `te_no_quant` in bf16. Groups are padded to the kernels'
128-row tiles by dispatch (the recipe registry's alignment). `tokens_mlp` offers the local exchange
an FP8 recipe's MLP from tokens, with dispatch and combine fused into its quantizers (`mosaic_tokens`,
for the scalings its SCALINGS names).
"""

from __future__ import annotations

import jax

from temoe import recipes
from temoe.moe.dispatch import DispatchPlan
from temoe.moe.experts import mosaic_gemm, parts


def mlp(
    ctx,
    x: jax.Array,
    p: DispatchPlan,
    wi: jax.Array,
    wo: jax.Array,
    biases: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    rows_expert: jax.Array | None,
) -> jax.Array:
  """Expert MLP on the expert-sorted buffer `x` (p.buffer_rows, emb); same contract as `xla.mlp`."""
  scaling = recipes.REGISTRY[ctx.recipe].scaling
  sizes = p.padded_group_sizes

  def gemm(a, w):
    return mosaic_gemm.grouped_matmul(a.astype(ctx.dtype), w.astype(ctx.dtype), sizes, scaling=scaling,
                                      out_dtype=ctx.dtype, keep_fp8_weights=ctx.fp8_weights != "remat")

  return parts.gated_mlp(ctx, x, wi, wo, biases, rows_expert, gemm)


def tokens_mlp(ctx, wi: jax.Array, wo: jax.Array, biases):
  """For the local and deduplicating exchanges: the FP8 recipe's MLP from tokens (`mosaic_tokens`, where it
  applies), else None."""
  from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel

  if not mosaic_tokens.applies(ctx, biases):
    return None
  return lambda x, p, weights, **layout: mosaic_tokens.mlp(ctx, x, p, weights, wi, wo, **layout)
