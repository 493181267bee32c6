"""The FP8 recipes' expert MLP from one device's tokens to their combined outputs, on temoe's Hopper
kernels, with the dispatch gather and the combine's backward fused into the quantizers. Under expert
parallelism the deduplicating exchange (`temoe.moe.exchange.dedup`, `auto` where a rank holds several
experts) hands it the rows it received instead, each with its slots for this rank's experts, some
empty (`empty_choices`); the row-per-pair exchanges hand the experts a buffer.

`mosaic.mlp` starts from the expert-sorted buffer: the dispatch gather writes x's rows in bf16 and
the GEMM's quantizer reads them back (fp8_block: 1.33 ms each way for DeepSeek-V3's layer on the
H200), and the combine's backward writes each slot's dy (its token's gradient times its routing
weight) in bf16 for the down GEMM's backward to quantize (1.33 ms more). Here the local exchange
hands over the tokens instead, and two custom VJPs cross those boundaries:

* `_gate_up(x, wi)`: the quantizer reads each buffer row from x as it quantizes (no bf16 buffer):
  `fp8_block.quantize_gathered` (blockwise) or `fp8_quant.quantize_gathered` (current scaling, whose
  per-expert amax comes from the tokens' row amaxes: one read of x, not of its top_k copies); the
  backward's dx goes back to the tokens as dispatch's backward does (each token sums its top_k slots).
* `_down_combine(h, wo, weights)`: the down GEMM and combine; the backward quantizes dy from the
  tokens' gradient and the weights as it reads them (dy is rounded once, to E4M3 or E5M2, not first
  to bf16), and gives the weights their gradient from the saved expert outputs.

MaxText's remat names stay where `parts.gated_mlp` puts them: moe_mlpwi_0/1 on the gate/up output,
moe_mlpwo on the down output (inside `_down_combine`'s forward; a policy sees names there). Current
scaling's down output goes behind `parts.separate` as in `parts.gated_mlp`; blockwise's stays as it was
measured (whether the barrier helps it too is not measured). The activation, its gradient's quantization (0.86 ms), h's (0.46 ms) and the
weights' (2.5 ms) remain passes of their own. Which recipes take this path: `SCALINGS`, both FP8
scalings by default. On the H200, DeepSeek-V3's layer fwd+bwd takes 26.9 ms this way against 27.9 ms
through `mosaic.mlp` with block scales, and 18.6 against 20.0 ms with current scaling, with the same
errors against float32 (bench/results/moe_layer.json: temoe_fp8_blockwise against
temoe_fp8_blockwise_unfused; moe_layer.tokens.json: temoe_fp8_tokens against temoe_fp8). In the
proxy the marginal MoE decoder layer takes 33.4 against 34.1 ms (proxy_1gpu.tokens.json).
`TEMOE_TOKENS_MLP` names the scalings that take it (`none`: every layer through the buffer, as
bench's `*_unfused` paths). Row biases take `mosaic.mlp`.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from temoe import recipes
from temoe.moe import dispatch
from temoe.moe.dispatch import DispatchPlan
from temoe.moe.experts import fp8_block, fp8_quant, mosaic_gemm, parts

ENV = "TEMOE_TOKENS_MLP"
CHOICES = ("blockwise", "current")  # the FP8 scalings this path implements
DEFAULT_SCALINGS = ("blockwise", "current")  # both measured faster on the H200 (see above)


def scalings_of(value: str | None) -> frozenset[str]:
  """The scalings a TEMOE_TOKENS_MLP value names (comma list of CHOICES, or "none"; unset: the default)."""
  if value is None:
    return frozenset(DEFAULT_SCALINGS)
  names = {v.strip() for v in value.split(",") if v.strip()} - {"none"}
  unknown = sorted(names - set(CHOICES))
  if unknown:
    raise ValueError(f"{ENV}={value!r}: {', '.join(unknown)} unknown; choose from {', '.join(CHOICES)} (comma list) "
                     "or none")
  return frozenset(names)


SCALINGS = scalings_of(os.environ.get(ENV))  # the scalings whose layers take this path (read once, at import)


def applies_to(kernel: str, recipe: str, biased: bool) -> bool:
  """Whether a layer on expert kernel `kernel` with `recipe` (and expert biases or not) takes `mlp` where
  its exchange offers it: the block's test (`applies`) and the memory plan's (tools.hbm_activations)."""
  return kernel == "mosaic" and recipes.REGISTRY[recipe].scaling in SCALINGS and not biased


def applies(ctx, biases) -> bool:
  """Whether the local or deduplicating exchange hands this layer's rows to `mlp` (else: buffer -> mosaic.mlp)."""
  return applies_to(ctx.kernel, ctx.recipe, any(b is not None for b in biases))


def mlp(ctx, x: jax.Array, p: DispatchPlan, weights: jax.Array, wi: jax.Array, wo: jax.Array,
        quant: str | None = None, sms: int | None = None, empty_choices: bool = False) -> jax.Array:
  """(tokens, emb): dispatch -> gate/up -> activation -> down -> combine of x (tokens, emb) routed by
  `p` with `weights` (tokens, top_k); what `dispatch.combine` of `mosaic.mlp` of `dispatch.dispatch` gives,
  up to dy's single rounding. quant / sms: as mosaic_gemm.grouped_matmul's. empty_choices: some
  choices have no buffer row (p.slot_of_choice == p.buffer_rows; the deduplicating exchange's empty
  metadata slots, whose weights are 0): they read a zero row and give none a gradient."""
  dtype = jnp.dtype(ctx.dtype)
  top_k = weights.shape[1]
  scaling = recipes.REGISTRY[ctx.recipe].scaling
  if scaling not in CHOICES:
    raise ValueError(f"mosaic_tokens: recipe {ctx.recipe!r} ({scaling} scaling) has no MLP from tokens; "
                     f"it takes scalings {', '.join(CHOICES)}")
  mosaic_gemm.check_shapes(wi.shape[1], wi.shape[2], scaling)
  mosaic_gemm.check_shapes(wo.shape[1], wo.shape[2], scaling)
  sizes = p.padded_group_sizes
  gemm = (_Gemm(scaling, ctx.fp8_weights != "remat", empty_choices), dtype, mosaic_gemm.GemmConfigs(), sms, quant)
  h = _gate_up(x.astype(dtype), wi.astype(dtype), sizes, p.choice_of_slot, p.slot_of_choice, top_k, *gemm)
  w0, w1 = parts.tag_up(*parts.split_gate_up(h))
  return _down_combine(ctx.activation(w0, w1).astype(dtype), wo.astype(dtype), weights, sizes, p.choice_of_slot,
                       p.slot_of_choice, ctx.float32_weight_sum, *gemm)


class _Gemm(NamedTuple):
  """Which recipe the GEMMs run, and how choices map to buffer rows (a custom_vjp static argument)."""

  scaling: str
  keep_fp8_weights: bool  # current scaling: the backward reads the forward's FP8 weights (te_moe_fp8_weights)
  empty_choices: bool = False  # some choices have no buffer row (slot_of_choice == buffer rows)


def _rows_of_choices(spec: _Gemm, y, slot_of_choice):
  """y's row of each choice: a zero row for a choice with none (index len(y), spec.empty_choices)."""
  return jnp.take(y, slot_of_choice, axis=0, mode="fill", fill_value=0) if spec.empty_choices else y[slot_of_choice]


def _quantize_rows(spec: _Gemm, rows, sizes, grad: bool, quant):
  """The quantized operand a buffer of rows (Mp, whole copy dims) gives the spec's GEMMs: blockwise's
  (q, s, q^T, s^T), current scaling's (q, q^T, per-expert scales), E5M2 for a gradient."""
  if spec.scaling == "blockwise":
    return fp8_block.quantize_both(rows, impl=quant)
  tiles = mosaic_gemm.tile_groups(sizes, rows.shape[0] // mosaic_gemm.ROW_ALIGNMENT, mosaic_gemm.ROW_ALIGNMENT)
  return fp8_quant.quantize_rows(rows, tiles, sizes.shape[0], fp8_quant.E5M2 if grad else fp8_quant.E4M3, quant)


def _quantize_gathered(spec: _Gemm, src, index, sizes, weight, quant):
  """_quantize_rows of gather_rows(src, index, weight), the quantizer reading src by index: x's rows
  (weight None, E4M3) or dy's (the tokens' gradient times the routing weights: E5M2 for current scaling)."""
  if spec.scaling == "blockwise":
    return fp8_block.quantize_gathered(src, index, weight, impl=quant)
  tiles = mosaic_gemm.tile_groups(sizes, index.shape[0] // mosaic_gemm.ROW_ALIGNMENT, mosaic_gemm.ROW_ALIGNMENT)
  dtype = fp8_quant.E4M3 if weight is None else fp8_quant.E5M2
  return fp8_quant.quantize_gathered(src, index, tiles, sizes.shape[0], dtype, weight, impl=quant)


def _forward(spec: _Gemm, xq, w, sizes, out_dtype, configs, sms, quant):
  if spec.scaling == "blockwise":
    return mosaic_gemm.blockwise_forward(xq, w, sizes, out_dtype, configs, sms, quant)
  return mosaic_gemm.current_forward(xq, w, sizes, out_dtype, configs, sms, quant, spec.keep_fp8_weights)


def _backward(spec: _Gemm, res, dyq, sizes, x_dtype, w_dtype, configs, sms, k, n):
  if spec.scaling == "blockwise":
    return mosaic_gemm.blockwise_backward(res, dyq, sizes, x_dtype, w_dtype, configs, sms, k, n)
  return mosaic_gemm.current_backward(res, dyq, sizes, x_dtype, w_dtype, configs, sms, k, n, spec.keep_fp8_weights)


def _rows_of(res) -> int:
  """Mp, the buffer rows of the FP8 residuals (x^T is (Kc, Mp) in both recipes' residuals)."""
  return res[0].shape[1]


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _gate_up(x, wi, sizes, choice_of_slot, slot_of_choice, top_k, spec, out_dtype, configs, sms, quant):
  return _gate_up_fwd(x, wi, sizes, choice_of_slot, slot_of_choice, top_k, spec, out_dtype, configs, sms, quant)[0]


def _gate_up_fwd(x, wi, sizes, choice_of_slot, slot_of_choice, top_k, spec, out_dtype, configs, sms, quant):
  k, n = x.shape[1], wi.shape[2]
  rows = choice_of_slot.shape[0]
  index = _slot_tokens(choice_of_slot, top_k, x.shape[0], mosaic_gemm.tile_rows(rows))
  xq = _quantize_gathered(spec, mosaic_gemm.pad_to(x, (x.shape[0], mosaic_gemm.copy_dim(k, spec.scaling))), index,
                          sizes, None, quant)
  y, fp8_res = _forward(spec, xq, wi, sizes, out_dtype, configs, sms, quant)
  return y[:rows, :n], (fp8_res, sizes, slot_of_choice, jnp.zeros((0, k), x.dtype), jnp.zeros((0, k, n), wi.dtype))


def _gate_up_bwd(top_k, spec, out_dtype, configs, sms, quant, res, dy):
  del out_dtype
  fp8_res, sizes, slot_of_choice, x_proto, w_proto = res
  _, k, n = w_proto.shape
  dyq = _quantize_rows(spec, mosaic_gemm.pad_to(dy, (_rows_of(fp8_res), mosaic_gemm.copy_dim(n, spec.scaling))), sizes,
                       True, quant)
  dxb, dw = _backward(spec, fp8_res, dyq, sizes, x_proto.dtype, w_proto.dtype, configs, sms, k, n)
  tokens = slot_of_choice.shape[0] // top_k
  if spec.empty_choices:  # dispatch's transpose, reading a zero row for a choice with no buffer row
    per_choice = _rows_of_choices(spec, dxb[:dy.shape[0], :k], slot_of_choice).reshape(tokens, top_k, k)
    dx = per_choice.sum(axis=1, dtype=jnp.float32).astype(x_proto.dtype)
  else:
    dx = dispatch.sum_choices(dxb[:, :k], slot_of_choice, tokens).astype(x_proto.dtype)
  return dx, dw[:, :k, :n], None, None, None


_gate_up.defvjp(_gate_up_fwd, _gate_up_bwd)


# --------------------------------------------------------------------------- down, then combine


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _down_combine(h, wo, weights, sizes, choice_of_slot, slot_of_choice, float32_sum, spec, out_dtype, configs, sms,
                  quant):
  return _down_combine_fwd(h, wo, weights, sizes, choice_of_slot, slot_of_choice, float32_sum, spec, out_dtype,
                           configs, sms, quant)[0]


def _down_combine_fwd(h, wo, weights, sizes, choice_of_slot, slot_of_choice, float32_sum, spec, out_dtype, configs,
                      sms, quant):
  rows, f = h.shape
  n = wo.shape[2]
  hq = _quantize_rows(spec, mosaic_gemm.pad_to(h, (mosaic_gemm.tile_rows(rows), mosaic_gemm.copy_dim(f, spec.scaling))),
                      sizes, False, quant)
  y, fp8_res = _forward(spec, hq, wo, sizes, out_dtype, configs, sms, quant)
  y = y[:rows, :n]
  if spec.scaling == "current":  # as parts.gated_mlp has it for the shipped current-scaling path (measured there)
    y = parts.separate(y)
  y = parts.tag_down(y)
  tokens, top_k = weights.shape
  out = dispatch.weighted_sum(_rows_of_choices(spec, y, slot_of_choice).reshape(tokens, top_k, n), weights, float32_sum)
  protos = (jnp.zeros((0, f), h.dtype), jnp.zeros((0, f, n), wo.dtype))
  return out, (fp8_res, sizes, y, weights, choice_of_slot, slot_of_choice, *protos)


def _down_combine_bwd(float32_sum, spec, out_dtype, configs, sms, quant, res, g):
  del out_dtype
  fp8_res, sizes, y, weights, choice_of_slot, slot_of_choice, h_proto, w_proto = res
  _, f, n = w_proto.shape
  tokens, top_k = weights.shape
  mp = _rows_of(fp8_res)
  index, weight_of_slot = _slot_tokens(choice_of_slot, top_k, tokens, mp), _slot_weights(choice_of_slot, weights, mp)
  del float32_sum  # dy = g * w in fp32, rounded once, to FP8 (the unfused combine rounds it to bf16 first)
  dyq = _quantize_gathered(spec, mosaic_gemm.pad_to(g, (tokens, mosaic_gemm.copy_dim(n, spec.scaling))), index, sizes,
                           weight_of_slot, quant)
  dh, dwo = _backward(spec, fp8_res, dyq, sizes, h_proto.dtype, w_proto.dtype, configs, sms, f, n)
  per_choice = _rows_of_choices(spec, y, slot_of_choice).reshape(tokens, top_k, n).astype(jnp.float32)  # exact fp32
  dweights = jnp.sum(per_choice * g.astype(jnp.float32)[:, None, :], axis=-1).astype(weights.dtype)
  return dh[:y.shape[0], :f], dwo[:, :f, :n], dweights, None, None, None


_down_combine.defvjp(_down_combine_fwd, _down_combine_bwd)
