"""DeepSeek-V3's fine-grained FP8 recipe (`te_fp8_blockwise`) for temoe's Hopper grouped GEMMs:
the scale layouts, the quantizers, and the recipe's math as plain JAX (the reference the kernels are
tested against).

Every operand is E4M3 (gradients included) with one fp32 scale per block, and the GEMM promotes its
partial sums to fp32 every 128 of the contraction, applying both operands' scales there:

* activations, as the left operand of the forward and dgrad GEMMs: one scale per 1 x 128 block (per
  row, per 128 elements of the contraction dim). Layout `(ceil(C / 128), R)`: the k-block is the
  major axis, so the 128 scales of one row tile and one k-block are contiguous (one TMA copy per
  pipeline stage).
* weights: one scale per 128 x 128 block, `(G, ceil(K / 128), ceil(N / 128))`. A square block is the
  same block in w and w^T, so the forward (reading w^T) and dgrad (reading w) share one set of scales.
* the wgrad GEMM contracts over tokens, so its operands x^T and dy^T are quantized in 128 x 1 blocks
  (128 tokens of one feature): its contraction blocks stay local, as the recipe needs. Layout
  `(ceil(R / 128), C)`: per token block, one scale per feature (row of x^T / dy^T).

A block's scale is amax / 448 (fp32, or rounded up to a power of two with `pow2=True`); an all-zero
block gets scale 1 (its values are 0 either way). Scales are local to a block, so nothing waits for a
global amax: each operand is quantized in the one pass that reads it (`quantize_both`: one read of a
bf16 (R, C) tile, four writes: q, its scales, q^T, its scales; `quantize_weights`: one read of each
128 x 128 weight block, both FP8 layouts and its scale). On a GPU these are Pallas Triton kernels
(`impl="triton"`, 128 x 128 tiles, rows and columns multiples of 128), elsewhere (and for shapes that
are not) the same math as XLA expressions (`impl="xla"`).

The passes that remain, per MoE layer (mosaic_gemm.grouped_matmul calls these; times measured alone
on the H200 for DeepSeek-V3's layer, 69,632 buffer rows, shipped form: bench/results/fp8_block.json,
`triton_recip+bf16amax_w4`/`_w8`): one pass over each bf16 operand a producer wrote, x (the dispatch
gather's output's shape, quantize_both alone) 1.05 ms, h (the activation's output) 0.47 ms, the
activation's gradient 0.66 ms, at 1.2-1.9 TB/s, and the incoming gradient dy (the combine's backward,
x's shape; not timed alone); each weight once per step into both layouts, wi 1.37 ms and wo 0.86 ms
(2.2-2.7 TB/s). Weights whose dims are not whole 128s are read as they are, the kernel's blocks past their
ends masked (`quantize_weights(padded=...)`), where a zero-padded bf16 copy of them was a pass of its own
(1.3 ms of the 2880-dim layer's wo in an H200 profile, bench/results/layer_profile/gpt_oss_like.blockwise_xla_wi.json).
FP8 copies of 2^31 elements or more (that layer's padded wi) are written as 32-bit words
(quantizers.pack_words): 3.35 ms for that wi against 3.7 + 1.8 + 1.1 in XLA's form, and the layer 15.62 ms
against 18.66 (bench/results/moe_layer.gpt_oss_like.blockwise_packed.json, _unpacked.json). The per-element division they had before cost 1.50 / 0.56 / 0.88 / 1.54 / 0.88 ms
(x, h, the activation's gradient, wi, wo) in the same call. `quantize_gathered` fuses two of them
into their producers' reads: x's rows gathered from the tokens, and dy's from the tokens' gradient
times the routing weights (`mosaic_tokens`, the default on one device: 26.9 against 27.9 ms for the
layer on the H200, bench/results/moe_layer.json). The activation is XLA's; a warpgroup's tile
of the gate/up GEMM is 64 x 128 (its fp32 total beside the accumulator), so to apply the activation
in its epilogue it would hold 64 matching columns of gate and of up, which make 64 columns of h: half
of the 128 that one 1 x 128 scale of h spans.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from temoe.moe.experts import quantizers

E4M3 = jnp.float8_e4m3fn
FMAX = 448.0
BLOCK = 128
IMPLS = quantizers.IMPLS
DEFAULT_IMPL = "auto"  # triton on a GPU where the shape is whole 128 x 128 tiles, xla elsewhere
# Triton warps per 128 x 128 tile, measured on the H200 over the dsv3 layer's operands in the shipped
# form (bench/results/fp8_block.json, 4 / 8 warps): 4 for activations (x 1.05 ms, 1.15 with 8),
# 8 for weights (wi 1.37 ms, 1.44 with 4; wo 0.86 / 0.84).
ROWS_WARPS, WEIGHTS_WARPS = 4, 8
INTERPRET = False  # tests on CPU set this: Pallas' generic interpreter runs the Triton kernels
# Two forms of the kernels' arithmetic, measured against each other on the H200 in one call
# (bench/results/fp8_block.json, bench/fp8_block.py --variants): RECIPROCAL casts x * (1 / s), one
# division per block instead of per element (the XLA form follows, so the implementations stay
# bit-equal: 0 differing values on every operand there); AMAX_IN_INPUT_DTYPE takes the blocks' amax on
# the bf16 input before the fp32 upcast (exact: abs and max round nothing). Both on: x 1.05 against
# 1.50 ms, the activation's gradient 0.66 against 0.88, wi 1.37 against 1.54 (8 warps).
RECIPROCAL = True
AMAX_IN_INPUT_DTYPE = True


def blocks(n: int) -> int:
  return -(-n // BLOCK)


def scale_of(amax: jax.Array, pow2: bool = False) -> jax.Array:
  """The dequantisation scale of blocks with absolute maximum `amax`: amax / 448 (1 for an all-zero
  block); pow2 rounds it up to a power of two (so q = x / s is exact in the exponent)."""
  amax = amax.astype(jnp.float32)
  s = jnp.where(amax > 0, amax * jnp.float32(1.0 / FMAX), jnp.float32(1.0))
  if pow2:  # from the bits, exact on every backend: the exponent, one up if any mantissa bit is set
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    exp = (bits >> 23) + jnp.minimum(bits & 0x7FFFFF, 1)
    s = jax.lax.bitcast_convert_type(exp << 23, jnp.float32)
  return s


def _cast(v):
  return jnp.clip(v, -FMAX, FMAX).astype(E4M3)


def _cast_scaled(v, s):
  """E4M3 of v / s (s broadcast to v): a division, or a multiply by 1 / s with RECIPROCAL."""
  return _cast(v * (1.0 / s) if RECIPROCAL else v / s)


def _pad_to_blocks(x, axes):
  pads = [(0, 0)] * x.ndim
  for a in axes:
    pads[a] = (0, blocks(x.shape[a]) * BLOCK - x.shape[a])
  return jnp.pad(x, pads) if any(p[1] for p in pads) else x


# ------------------------------------------------------------------------------------ plain JAX


def quantize_rows_xla(x: jax.Array, pow2: bool = False):
  """1 x 128 blocks of (R, C): (q (R, C) E4M3, scales (ceil(C/128), R) fp32)."""
  r, c = x.shape
  xb = _pad_to_blocks(x.astype(jnp.float32), [1]).reshape(r, blocks(c), BLOCK)
  s = scale_of(jnp.max(jnp.abs(xb), axis=2), pow2)  # (R, Cb)
  q = _cast_scaled(xb, s[:, :, None]).reshape(r, -1)[:, :c]
  return q, s.T


def quantize_cols_xla(x: jax.Array, pow2: bool = False):
  """128 x 1 blocks of (R, C), transposed: (q^T (C, R) E4M3, scales (ceil(R/128), C) fp32)."""
  qt, s = quantize_rows_xla(x.T, pow2)
  return qt, s


def quantize_both_xla(x: jax.Array, pow2: bool = False):
  q, s = quantize_rows_xla(x, pow2)
  qt, st = quantize_cols_xla(x, pow2)
  return q, s, qt, st


def gather_rows(src: jax.Array, index: jax.Array, weight: jax.Array | None = None) -> jax.Array:
  """Rows src[index[r]] * weight[r] in fp32 (R, C); index == len(src) reads a zero row (a padding slot)."""
  v = jnp.concatenate([src, jnp.zeros((1, src.shape[1]), src.dtype)])[index].astype(jnp.float32)
  return v if weight is None else v * weight.astype(jnp.float32)[:, None]


def quantize_gathered_xla(src: jax.Array, index: jax.Array, weight: jax.Array | None = None, pow2: bool = False):
  return quantize_both_xla(gather_rows(src, index, weight), pow2)


def quantize_weights_xla(w: jax.Array, pow2: bool = False):
  """128 x 128 blocks of (G, K, N): (q (G, K, N), q^T (G, N, K), scales (G, ceil(K/128), ceil(N/128)))."""
  g, k, n = w.shape
  wb = _pad_to_blocks(w.astype(jnp.float32), [1, 2]).reshape(g, blocks(k), BLOCK, blocks(n), BLOCK)
  s = scale_of(jnp.max(jnp.abs(wb), axis=(2, 4)), pow2)  # (G, Kb, Nb)
  q = _cast_scaled(wb, s[:, :, None, :, None]).reshape(g, blocks(k) * BLOCK, blocks(n) * BLOCK)[:, :k, :n]
  return q, jnp.swapaxes(q, 1, 2), s


def dequantize_rows(q: jax.Array, s: jax.Array) -> jax.Array:
  """fp32 values of (q (R, C), scales (Cb, R)) from quantize_rows."""
  r, c = q.shape
  return q.astype(jnp.float32) * jnp.repeat(s.T, BLOCK, axis=1)[:, :c]


def dequantize_weights(q: jax.Array, s: jax.Array) -> jax.Array:
  g, k, n = q.shape
  full = jnp.repeat(jnp.repeat(s, BLOCK, axis=1), BLOCK, axis=2)[:, :k, :n]
  return q.astype(jnp.float32) * full


# ------------------------------------------------------------------------------- Triton kernels


def _quantize_tile(v, q_ref, s_ref, qt_ref, st_ref, pow2):
  """Writes the (128, 128) tile v (rows i-block, cols j-block) both ways: 1 x 128 and 128 x 1 blocks
  (amax on v as given, the cast from fp32)."""
  a = jnp.abs(v)
  s_row = scale_of(jnp.max(a, axis=1), pow2)  # one per row (1 x 128)
  s_col = scale_of(jnp.max(a, axis=0), pow2)  # one per column (128 x 1)
  v = v.astype(jnp.float32)
  q_ref[...] = _cast_scaled(v, s_row[:, None])
  s_ref[...] = s_row
  qt_ref[...] = _cast_scaled(v, s_col[None, :]).T
  st_ref[...] = s_col


def _both_kernel(x_ref, *outs, pow2):
  x = x_ref[...]
  _quantize_tile(x if AMAX_IN_INPUT_DTYPE else x.astype(jnp.float32), *outs, pow2)


def _gathered_kernel(index_ref, *refs, tokens, weighted, pow2):
  """_both_kernel on the 128 x 128 tile of rows src[index] (x weight): the gather reads as it quantizes."""
  weight_ref, refs = (refs[0], refs[1:]) if weighted else (None, refs)
  src_ref, *outs = refs
  index = index_ref[...]
  real = index < tokens  # index == tokens: a padding slot, zero
  v = src_ref[jnp.where(real, index, 0), pl.ds(pl.program_id(1) * BLOCK, BLOCK)]  # padding slots read row 0
  if weighted:  # dy times the routing weight, in fp32 (rounded once, to E4M3)
    v = jnp.where(real[:, None], v.astype(jnp.float32), 0.0) * weight_ref[...].astype(jnp.float32)[:, None]
  else:
    v = jnp.where(real[:, None], v if AMAX_IN_INPUT_DTYPE else v.astype(jnp.float32), jnp.zeros((), v.dtype))
  _quantize_tile(v, *outs, pow2)


def _weights_kernel(w_ref, q_ref, qt_ref, s_ref, *, pow2, packed, dims):
  if dims is None:
    v = w_ref[...]  # one 128 x 128 block
  else:  # w is (K, N) = dims, read as whole blocks: past its ends zeros (the padded copy, without the copy)
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

    row = pl.program_id(1) * BLOCK + jnp.arange(BLOCK)
    col = pl.program_id(2) * BLOCK + jnp.arange(BLOCK)
    v = pltriton.load(w_ref, mask=(row < dims[0])[:, None] & (col < dims[1])[None, :], other=0)
  s = scale_of(jnp.max(jnp.abs(v if AMAX_IN_INPUT_DTYPE else v.astype(jnp.float32))), pow2)
  q = _cast_scaled(v.astype(jnp.float32), s)
  pack = quantizers.pack_words if packed else (lambda t: t)
  q_ref[...] = pack(q)
  qt_ref[...] = pack(q.T)
  s_ref[...] = jnp.broadcast_to(s, s_ref.shape)


def _compiler_params(warps: int):
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

  return pltriton.CompilerParams(num_warps=warps, num_stages=1)


def _both_outputs(r: int, c: int):
  """(out_specs, out_shape) of a (R, C) operand quantized both ways on a (R/128, C/128) grid."""
  blk = (BLOCK, BLOCK)
  specs = [
      pl.BlockSpec(blk, lambda i, j: (i, j)),
      pl.BlockSpec((None, BLOCK), lambda i, j: (j, i)),
      pl.BlockSpec(blk, lambda i, j: (j, i)),
      pl.BlockSpec((None, BLOCK), lambda i, j: (i, j)),
  ]
  shapes = [
      jax.ShapeDtypeStruct((r, c), E4M3), jax.ShapeDtypeStruct((c // BLOCK, r), jnp.float32),
      jax.ShapeDtypeStruct((c, r), E4M3), jax.ShapeDtypeStruct((r // BLOCK, c), jnp.float32),
  ]
  return specs, shapes


def _quantize_both_triton(x, pow2):
  r, c = x.shape
  out_specs, out_shape = _both_outputs(r, c)
  return pl.pallas_call(
      functools.partial(_both_kernel, pow2=pow2),
      grid=(r // BLOCK, c // BLOCK),
      in_specs=[pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j))],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params(ROWS_WARPS),
      interpret=INTERPRET,
      name="temoe_fp8_block_quantize",
  )(x)


def _quantize_gathered_triton(src, index, weight, pow2):
  tokens, c = src.shape
  r = index.shape[0]
  out_specs, out_shape = _both_outputs(r, c)
  row_block = pl.BlockSpec((BLOCK,), lambda i, j: (i,))
  weighted = weight is not None
  return pl.pallas_call(
      functools.partial(_gathered_kernel, tokens=tokens, weighted=weighted, pow2=pow2),
      grid=(r // BLOCK, c // BLOCK),
      in_specs=[row_block] + [row_block] * weighted + [pl.BlockSpec(memory_space=pl.ANY)],  # src: read by index
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params(ROWS_WARPS),
      interpret=INTERPRET,
      name="temoe_fp8_block_quantize_gathered",
  )(index.astype(jnp.int32), *([weight.astype(jnp.float32)] if weighted else []), src)


def _quantize_weights_triton(w, pow2, padded=None):
  g, k, n = w.shape
  dims = None if padded in (None, (k, n)) else (k, n)
  k, n = padded or (k, n)
  kb, nb = k // BLOCK, n // BLOCK
  blk = (None, BLOCK, BLOCK)
  packed = quantizers.packs(g * k * n)  # FP8 copies of 2^31 elements or more: 32-bit words of four
  word = quantizers.WORD if packed else 1
  q_blk, q_dtype = (None, BLOCK, BLOCK // word), jnp.uint32 if packed else E4M3
  # The scale is written as a 16-wide row per block (Triton blocks are powers of two of at least
  # a few elements); column 0 is the scale.
  q, qt, s = pl.pallas_call(
      functools.partial(_weights_kernel, pow2=pow2, packed=packed, dims=dims),
      grid=(g, kb, nb),
      in_specs=[pl.BlockSpec(blk, lambda e, i, j: (e, i, j))],
      out_specs=[
          pl.BlockSpec(q_blk, lambda e, i, j: (e, i, j)),
          pl.BlockSpec(q_blk, lambda e, i, j: (e, j, i)),
          pl.BlockSpec((None, None, None, 16), lambda e, i, j: (e, i, j, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((g, k, n // word), q_dtype), jax.ShapeDtypeStruct((g, n, k // word), q_dtype),
          jax.ShapeDtypeStruct((g, kb, nb, 16), jnp.float32),
      ],
      compiler_params=_compiler_params(WEIGHTS_WARPS),
      interpret=INTERPRET,
      name="temoe_fp8_block_quantize_weights",
  )(w)
  if packed:
    q, qt = quantizers.unpack_words(q, E4M3), quantizers.unpack_words(qt, E4M3)
  return q, qt, s[..., 0]


# ------------------------------------------------------------------------------------ public API


def resolve(impl: str | None, *dims: int, elements: int = 0, packable: bool = False) -> str:
  """The implementation `impl` names for an operand with these dims and `elements` in all ("auto":
  triton on a GPU when every dim is a multiple of 128, xla otherwise): `quantizers.resolve`."""
  return quantizers.resolve(impl or DEFAULT_IMPL, "fp8_block", dims, (BLOCK,) * len(dims), elements or math.prod(dims),
                            packable)


def quantize_both(x: jax.Array, pow2: bool = False, impl: str | None = None):
  """(R, C) -> (q (R, C), s (Cb, R), q^T (C, R), s^T (Rb, C)): 1 x 128 blocks for the row-major
  operand, 128 x 1 blocks for its transpose (the wgrad operand), from one read of x."""
  if resolve(impl, *x.shape) == "triton":
    return _quantize_both_triton(x, pow2)
  return quantize_both_xla(x, pow2)


def quantize_gathered(src: jax.Array, index: jax.Array, weight: jax.Array | None = None, pow2: bool = False,
                      impl: str | None = None):
  """quantize_both of the rows src[index[r]] * weight[r] (R = len(index); index == len(src) is a zero
  row): the dispatch gather (x's rows into the expert buffer) and the combine's backward (each slot's
  dy is its token's incoming gradient times its routing weight) quantize as they read; the Triton
  kernel writes no copy of the rows (the XLA form gathers them first). Rows are weighted in fp32, so
  dy is rounded once, to E4M3."""
  if resolve(impl, index.shape[0], src.shape[1], elements=max(index.shape[0], src.shape[0]) * src.shape[1]) == "triton":
    return _quantize_gathered_triton(src, index, weight, pow2)
  return quantize_gathered_xla(src, index, weight, pow2)


def quantize_weights(w: jax.Array, pow2: bool = False, impl: str | None = None, padded: tuple[int, int] | None = None):
  """(G, K, N) -> (q (G, K, N), q^T (G, N, K), s (G, Kb, Nb)) with 128 x 128 blocks.

  padded (Kp, Np) >= (K, N): the copies of w zero-padded to these dims, read from w as it is (the Triton
  kernel masks its reads past w's ends: no padded bf16 copy of the weights; XLA's form pads first)."""
  g, k, n = w.shape
  kp, np_ = padded or (k, n)
  if kp < k or np_ < n:
    raise ValueError(f"quantize_weights: padded {padded} is smaller than w's ({k}, {n})")
  if resolve(impl, kp, np_, elements=g * kp * np_, packable=True) == "triton":
    return _quantize_weights_triton(w, pow2, (kp, np_))
  return quantize_weights_xla(jnp.pad(w, ((0, 0), (0, kp - k), (0, np_ - n))) if (kp, np_) != (k, n) else w, pow2)


def reference_grouped_matmul(x, w, group_sizes, pow2: bool = False):
  """The recipe's forward in plain JAX, fp32: x (M, K) rows of group g times w[g] (G, K, N), each
  operand quantized and dequantized as the kernels see it; rows past the groups are 0."""
  xq, sx = quantize_rows_xla(x, pow2)
  wq, _, sw = quantize_weights_xla(w, pow2)
  xd, wd = dequantize_rows(xq, sx), dequantize_weights(wq, sw)
  ends = jnp.cumsum(group_sizes)
  row = jnp.arange(x.shape[0])
  y = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
  for g in range(w.shape[0]):
    mine = (row >= ends[g] - group_sizes[g]) & (row < ends[g])
    y = y + jnp.where(mine[:, None], jnp.dot(xd, wd[g], precision=jax.lax.Precision.HIGHEST), 0.0)
  return y
