"""The blockwise recipe's expert MLP from one device's tokens to their combined outputs, on temoe's
Hopper kernels, with the dispatch gather and the combine's backward fused into the quantizers.

`mosaic.mlp` starts from the expert-sorted buffer: the dispatch gather writes x's rows in bf16 and
the GEMM's quantizer reads them back (fp8_block: 1.33 ms each way for DeepSeek-V3's layer on the
H200), and the combine's backward writes each slot's dy (its token's gradient times its routing
weight) in bf16 for the down GEMM's backward to quantize (1.33 ms more). Here the local exchange
hands over the tokens instead, and two custom VJPs cross those boundaries:

* `_gate_up(x, wi)`: `fp8_block.quantize_gathered` reads each buffer row from x as it quantizes (no
  bf16 buffer); the backward's dx goes back to the tokens as dispatch's backward does (each token
  sums its top_k slots).
* `_down_combine(h, wo, weights)`: the down GEMM and combine; the backward quantizes dy from the
  tokens' gradient and the weights as it reads them (dy is rounded once, to E4M3, not first to
  bf16), and gives the weights their gradient from the saved expert outputs.

MaxText's remat names stay where `parts.gated_mlp` puts them: moe_mlpwi_0/1 on the gate/up output,
moe_mlpwo on the down output (inside `_down_combine`'s forward; a policy sees names there). The
activation, its gradient's quantization (0.86 ms), h's (0.46 ms) and the weights' (2.5 ms) remain
passes of their own. On by default (`FUSED`): on the H200 DeepSeek-V3's layer fwd+bwd takes 26.9 ms
this way against 27.9 ms through `mosaic.mlp`, with the same errors against float32
(bench/results/moe_layer.json, paths temoe_fp8_blockwise and temoe_fp8_blockwise_unfused, one call).
Row biases take `mosaic.mlp`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from temoe import recipes
from temoe.moe import dispatch
from temoe.moe.dispatch import DispatchPlan
from temoe.moe.experts import fp8_block, mosaic_gemm, parts

FUSED = True  # False: the local exchange dispatches into a buffer and calls mosaic.mlp


def applies(ctx, biases) -> bool:
  """Whether the local exchange hands this layer's tokens to `mlp` (else: buffer -> mosaic.mlp)."""
  return (FUSED and ctx.kernel == "mosaic" and recipes.REGISTRY[ctx.recipe].scaling == "blockwise"
          and all(b is None for b in biases))


def mlp(ctx, x: jax.Array, p: DispatchPlan, weights: jax.Array, wi: jax.Array, wo: jax.Array,
        quant: str | None = None, sms: int | None = None) -> jax.Array:
  """(tokens, emb): dispatch -> gate/up -> activation -> down -> combine of x (tokens, emb) routed by
  `p` with `weights` (tokens, top_k); what `dispatch.combine` of `mosaic.mlp` of `dispatch.dispatch` gives.
  quant / sms: as mosaic_gemm.grouped_matmul's."""
  dtype = jnp.dtype(ctx.dtype)
  top_k = weights.shape[1]
  mosaic_gemm.check_shapes(wi.shape[1], wi.shape[2], "blockwise")
  mosaic_gemm.check_shapes(wo.shape[1], wo.shape[2], "blockwise")
  sizes = p.padded_group_sizes
  gemm = (dtype, mosaic_gemm.GemmConfigs(), sms, quant)
  h = _gate_up(x.astype(dtype), wi.astype(dtype), sizes, p.choice_of_slot, p.slot_of_choice, top_k, *gemm)
  w0, w1 = parts.tag_up(*parts.split_gate_up(h))
  return _down_combine(ctx.activation(w0, w1).astype(dtype), wo.astype(dtype), weights, sizes, p.choice_of_slot,
                       p.slot_of_choice, ctx.float32_weight_sum, *gemm)


def _slot_tokens(choice_of_slot, top_k: int, tokens: int, rows: int):
  """The token of each of `rows` (whole tiles) buffer rows; `tokens` (a zero row) for padding slots,
  which hold the sentinel choice tokens * top_k, and for the tile's rows past the buffer."""
  index = choice_of_slot // top_k
  return jnp.pad(index, (0, rows - index.shape[0]), constant_values=tokens)


def _slot_weights(choice_of_slot, weights, rows: int):
  """The routing weight of each of `rows` buffer rows in fp32 (0 for padding)."""
  flat = dispatch.take_with_zero_row(weights.reshape(-1, 1).astype(jnp.float32), choice_of_slot)[:, 0]
  return jnp.pad(flat, (0, rows - choice_of_slot.shape[0]))


# ------------------------------------------------------------------------ gate/up from the tokens


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _gate_up(x, wi, sizes, choice_of_slot, slot_of_choice, top_k, out_dtype, configs, sms, quant):
  return _gate_up_fwd(x, wi, sizes, choice_of_slot, slot_of_choice, top_k, out_dtype, configs, sms, quant)[0]


def _gate_up_fwd(x, wi, sizes, choice_of_slot, slot_of_choice, top_k, out_dtype, configs, sms, quant):
  k, n = x.shape[1], wi.shape[2]
  rows = choice_of_slot.shape[0]
  index = _slot_tokens(choice_of_slot, top_k, x.shape[0], mosaic_gemm.tile_rows(rows))
  xq4 = fp8_block.quantize_gathered(mosaic_gemm.pad_to(x, (x.shape[0], mosaic_gemm.copy_dim(k, "blockwise"))), index,
                                    impl=quant)
  y, fp8_res = mosaic_gemm.blockwise_forward(xq4, wi, sizes, out_dtype, configs, sms, quant)
  return y[:rows, :n], (fp8_res, sizes, slot_of_choice, jnp.zeros((0, k), x.dtype), jnp.zeros((0, k, n), wi.dtype))


def _gate_up_bwd(top_k, out_dtype, configs, sms, quant, res, dy):
  del out_dtype
  fp8_res, sizes, slot_of_choice, x_proto, w_proto = res
  _, k, n = w_proto.shape
  mp, np_ = fp8_res[0].shape[1], fp8_res[2].shape[2]  # x^T (Kp, Mp), w (G, Kp, Np)
  dyq4 = fp8_block.quantize_both(mosaic_gemm.pad_to(dy, (mp, np_)), impl=quant)
  dxb, dw = mosaic_gemm.blockwise_backward(fp8_res, dyq4, sizes, x_proto.dtype, w_proto.dtype, configs, sms, k, n)
  dx = dispatch.sum_choices(dxb[:, :k], slot_of_choice, slot_of_choice.shape[0] // top_k).astype(x_proto.dtype)
  return dx, dw[:, :k, :n], None, None, None


_gate_up.defvjp(_gate_up_fwd, _gate_up_bwd)


# --------------------------------------------------------------------------- down, then combine


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _down_combine(h, wo, weights, sizes, choice_of_slot, slot_of_choice, float32_sum, out_dtype, configs, sms, quant):
  return _down_combine_fwd(h, wo, weights, sizes, choice_of_slot, slot_of_choice, float32_sum, out_dtype, configs,
                           sms, quant)[0]


def _down_combine_fwd(h, wo, weights, sizes, choice_of_slot, slot_of_choice, float32_sum, out_dtype, configs, sms,
                      quant):
  rows, f = h.shape
  n = wo.shape[2]
  hq4 = fp8_block.quantize_both(mosaic_gemm.pad_to(h, (mosaic_gemm.tile_rows(rows), mosaic_gemm.copy_dim(f, "blockwise"))),
                                impl=quant)
  y, fp8_res = mosaic_gemm.blockwise_forward(hq4, wo, sizes, out_dtype, configs, sms, quant)
  y = parts.tag_down(y[:rows, :n])
  tokens, top_k = weights.shape
  out = dispatch.weighted_sum(y[slot_of_choice].reshape(tokens, top_k, n), weights, float32_sum)
  protos = (jnp.zeros((0, f), h.dtype), jnp.zeros((0, f, n), wo.dtype))
  return out, (fp8_res, sizes, y, weights, choice_of_slot, slot_of_choice, *protos)


def _down_combine_bwd(float32_sum, out_dtype, configs, sms, quant, res, g):
  del out_dtype
  fp8_res, sizes, y, weights, choice_of_slot, slot_of_choice, h_proto, w_proto = res
  _, f, n = w_proto.shape
  tokens, top_k = weights.shape
  mp = fp8_res[0].shape[1]
  index, weight_of_slot = _slot_tokens(choice_of_slot, top_k, tokens, mp), _slot_weights(choice_of_slot, weights, mp)
  del float32_sum  # dy = g * w in fp32, rounded once, to E4M3 (the unfused combine rounds it to bf16 first)
  dyq4 = fp8_block.quantize_gathered(mosaic_gemm.pad_to(g, (tokens, fp8_res[2].shape[2])), index, weight_of_slot,
                                     impl=quant)
  dh, dwo = mosaic_gemm.blockwise_backward(fp8_res, dyq4, sizes, h_proto.dtype, w_proto.dtype, configs, sms, f, n)
  per_choice = y[slot_of_choice].reshape(tokens, top_k, n).astype(jnp.float32)  # a multiply-reduce: exact fp32
  dweights = jnp.sum(per_choice * g.astype(jnp.float32)[:, None, :], axis=-1).astype(weights.dtype)
  return dh[:y.shape[0], :f], dwo[:, :f, :n], dweights, None, None, None


_down_combine.defvjp(_down_combine_fwd, _down_combine_bwd)
