"""FP8 current scaling for temoe's Hopper grouped GEMMs: per-expert scales, and one cast pass that
writes both FP8 layouts the kernels read.

Why a module of its own: FP8 wgmma reads both operands with the contraction dim contiguous, so every
FP8 operand of the expert MLP is needed twice, once as stored and once transposed (x: forward and
wgrad; w: forward and dgrad; dy: dgrad and wgrad). Casting, then transposing the FP8 copy, reads the
tensor twice and leaves XLA an 8-bit transpose; here one pass reads the bf16 tensor once and writes
both FP8 copies (`cast_transpose`): on a GPU a Pallas Triton kernel that transposes in shared memory
(`impl="triton"`; Pallas marks its Triton backend deprecated, still present in JAX 0.11), elsewhere
the same math as one XLA expression (`impl="xla"`, bit-identical: tests/gpu checks it). Measured on
an H200: alone, the kernel (64 x 128 block) moves 1.3-2.1 TB/s per DeepSeek-V3 operand, XLA's fusion
1.0-1.5 (bench/results/fp8_quant*.json); in the layer XLA's version fuses with its producers into a
far slower whole (DeepSeek-V3 layer fwd+bwd 19.9 ms with the kernel, 51.8 ms without:
bench/results/moe_layer.quant.json).

The weights' copies are made once in the forward; the backward's dgrad reads w_q as stored, which
`cast_experts` makes again from the forward's scales (kept by the remat policy: parts.FP8_SCALES) in one
pass, no amax and no transposed copy, bit-identical to the forward's. So the forward writes w_q^T alone
(`cast_transposed`; both layouts where the backward keeps the forward's copies): on the H200 proxy its
kernel takes 1.53 against 2.17 ms a 3-layer step (bench/results/layer_profile/proxy_kernels.*.json).

`quantize_gathered` is `quantize_rows` of a buffer of gathered rows without writing it (mosaic_tokens): x's
rows as dispatch would write them, or dy's, the tokens' gradient times each slot's routing weight in fp32
(rounded once, to FP8, where the unfused combine's backward rounds it to bf16 first); the amax from the
tokens' rows, then one kernel that gathers as it casts (Triton on a GPU, XLA's gather and cast elsewhere).

Scales are per expert (current scaling: amax on device every call). Groups are padded to 128-row
tiles, so each tile of the expert-sorted buffer belongs to one expert (the table the forward kernel
reads anyway) and an expert's amax is the max over its tiles' amaxes: one dense reduction per tile
and an (experts x tiles) masked max, no scatter and no per-row expert lookup.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from temoe.moe.experts import fp8_block, quantizers

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FMAX = {jnp.dtype(E4M3): 448.0, jnp.dtype(E5M2): 57344.0}
TILE_ROWS = 128  # the kernels' row alignment: no tile straddles two experts
IMPLS = quantizers.IMPLS
DEFAULT_IMPL = "auto"  # triton on a GPU (measured 1.1-1.4x XLA's fusion alone, 2.1-2.6x in the layer), xla elsewhere
# Pallas Triton cast-transpose block (rows, cols, warps): 64 x 128 bf16 in, two 8 KiB FP8 tiles out. An
# operand whose columns are not whole 128s takes the same block, its last column block masked (loads past
# the end read 0, stores past it are dropped); the weights' copies, padded to whole 128s (mosaic_gemm.copy_dim),
# are read with rows and columns past w's ends masked (`cast_transpose(padded=...)`: no padded bf16 copy). Measured on the H200 on the 2880-dim layer's operands, one call, each
# bit-equal to XLA (bench/results/fp8_quant.gpt_oss_like.masked.json): wo's cast with its amax 2.16 ms
# against 2.39 with the 64 x 64 blocks it took before, h 0.44 / 0.48, dy 0.47 / 0.50, x 0.54 / 0.53
# (128 x 64, 8 warps), x gathered from the tokens 0.35 / 0.33: 3.96 ms against 4.23 in all. Whether the
# layer gains is measured there (bench/moe_layer.py).
TRITON_BLOCK = (64, 128, 4)
# The weights' per-expert amax (`weight_amax`) and the backward's cast of them without transpose
# (`cast_experts`) are XLA's fusions: inside the scanned step they read a layer's slice of the stacked
# weights in place. Pallas Triton kernels for both were measured in the H200 proxy (profiles of the 3- and
# 5-layer proxies, one call: README, "The marginal MoE decoder layer"): the amax kernel ran in 0.71 ms a
# MoE layer against XLA's 1.33, but with two kernels reading a weight's slice XLA copied each weight out
# of the stack in the forward and the backward, 2.66 ms a layer, so they were not kept.
# The backward's weight cast: XLA's fusion reads the slice in place. The Triton kernel writing q alone
# (bit-equal; `impl="triton"`) was slower on the H200 in one call: 1.69-2.10 ms a layer in six blocks
# against XLA's 1.33 for the proxy's wi slice inside a scan (bench/results/weight_quant.json), and the
# proxy's marginal MoE layer 31.95 against 31.26 ms with it as `auto`'s choice (proxy_1gpu.recast_triton.json,
# proxy_1gpu.recast_xla.json). Storing XLA's FP8 as 32-bit words, and other formulations of the amax,
# measured within the run-to-run spread (weight_quant.chunks_words.json), so the plain forms stay.
CAST_EXPERTS_IMPL = "xla"
INTERPRET = False  # tests on CPU set this: Pallas' generic interpreter runs the Triton kernel


def group_scales(amax: jax.Array, dtype) -> jax.Array:
  """Quantisation scales fmax / amax (1 where amax is 0 or not finite: empty or poisoned group)."""
  amax = amax.astype(jnp.float32)
  ok = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(ok, FMAX[jnp.dtype(dtype)] / jnp.where(ok, amax, 1.0), 1.0)


def expert_amax(x: jax.Array, tile_expert: jax.Array, num_groups: int) -> jax.Array:
  """(G,) f32 amax per expert of an expert-sorted (rows, d) buffer, rows a multiple of 128.

  tile_expert (rows // 128,) is each tile's expert, -1 for spare tiles (mosaic_gemm.tile_groups):
  spare tiles count for no expert; an empty expert's amax is 0. NaN in an expert's rows gives it a
  NaN amax (group_scales then falls back to 1 and the NaN reaches the output, as it should).
  """
  rows, d = x.shape
  tile_max = jnp.max(jnp.abs(x.reshape(rows // TILE_ROWS, TILE_ROWS, d)), axis=(1, 2))
  return _experts_of_tiles_amax(tile_max, tile_expert, num_groups)


def _experts_of_tiles_amax(tile_max: jax.Array, tile_expert: jax.Array, num_groups: int) -> jax.Array:
  """expert_amax from each 128-row tile's amax (tiles,): the max over each expert's tiles."""
  tile_max = tile_max.astype(jnp.float32)
  mine = tile_expert[None, :] == jnp.arange(num_groups, dtype=jnp.int32)[:, None]
  return jnp.max(jnp.where(mine, tile_max[None, :], 0.0), axis=1)


def _saturate(v, dtype):
  fmax = FMAX[jnp.dtype(dtype)]
  return jnp.clip(v, -fmax, fmax).astype(dtype)


def _cast_transpose_xla(x, row_scale, dtype):
  v = x.astype(jnp.float32) * row_scale[..., None]
  return _saturate(v, dtype), _saturate(jnp.swapaxes(v, -1, -2), dtype)


def _column_mask(cols: int | None, block_cols: int, axis: int):
  """(block_cols,) bool: which of this program's columns exist (None where every block is whole)."""
  if cols is None:
    return None
  return pl.program_id(axis) * block_cols + jnp.arange(block_cols) < cols


def _load(ref, mask):
  """ref's block; where `mask` (the columns that exist) is given, masked (a tail block past the array's end)."""
  if mask is None:
    return ref[...]
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

  return pltriton.load(ref, mask=mask[None, :], other=0)


def _store_both(q_ref, qt_ref, v, dtype, mask, packed=False, word_mask=None):
  """v and v^T, saturated to `dtype`, into both layouts' blocks (a tail block's missing columns not written;
  q_ref None: v^T alone; qt_ref None: v alone). packed: the outputs are 32-bit words of four values along their minor dim
  (quantizers.pack_words), and word_mask, with a tail block, which of q's words exist (columns are whole words)."""
  fmax = FMAX[jnp.dtype(dtype)]
  v = jnp.minimum(jnp.maximum(v, -fmax), fmax)
  pack = quantizers.pack_words if packed else (lambda t: t)
  q = None if q_ref is None else pack(v.astype(dtype))
  qt = None if qt_ref is None else pack(v.T.astype(dtype))
  q_mask = word_mask if packed else mask
  if mask is None:
    if q_ref is not None:
      q_ref[...] = q
    if qt_ref is not None:
      qt_ref[...] = qt
    return
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

  if q_ref is not None:
    pltriton.store(q_ref, q, mask=q_mask[None, :])
  if qt_ref is not None:
    pltriton.store(qt_ref, qt, mask=mask[:, None])


def _cast_transpose_kernel(x_ref, s_ref, *out_refs, dtype, cols, block_cols, packed, layouts, dims=None):
  q_ref, qt_ref = {"both": out_refs, "qt": (None, *out_refs), "q": (*out_refs, None)}[layouts]
  mask = _column_mask(cols, block_cols, 2)  # the output's columns (a tail block's missing ones not written)
  if dims is None:
    v = _load(x_ref, mask)
  else:  # x is (R, C) = dims, read as blocks of its zero-padded copy: past its ends zeros, without the copy
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

    br, bc = x_ref.shape
    row = pl.program_id(1) * br + jnp.arange(br)
    col = pl.program_id(2) * bc + jnp.arange(bc)
    v = pltriton.load(x_ref, mask=(row < dims[0])[:, None] & (col < dims[1])[None, :], other=0)
  v = v.astype(jnp.float32) * s_ref[...][:, None]
  word_mask = None
  if packed and cols is not None:  # cols in words: whole words, checked by the caller
    word_mask = _column_mask(cols // quantizers.WORD, block_cols // quantizers.WORD, 2)
  _store_both(q_ref, qt_ref, v, dtype, mask, packed, word_mask)


LAYOUTS = {"both": "temoe_fp8_cast_transpose", "qt": "temoe_fp8_cast_transposed", "q": "temoe_fp8_cast"}
"""What a cast-transpose kernel writes (q and q^T, q^T alone, q alone) -> its name in profiles."""


def _cast_transpose_triton(x, row_scale, dtype, block, padded=None, layouts="both"):
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

  b = x.shape[0]
  r, c = padded or x.shape[1:]
  dims = None if (r, c) == x.shape[1:] else x.shape[1:]
  br, bc, warps = (*block, 4)[:3]
  if r % br:
    raise ValueError(f"cast_transpose: {r} rows are not a multiple of the block {block}")
  packed = quantizers.packs(b * r * c)  # FP8 copies of 2^31 elements or more: 32-bit words of four
  word, out = (quantizers.WORD, jnp.uint32) if packed else (1, dtype)
  if packed and c % word:
    raise ValueError(f"cast_transpose: {c} columns are not whole {word}-value words")
  q_spec, q_shape = pl.BlockSpec((None, br, bc // word), lambda i, j, k: (i, j, k)), (b, r, c // word)
  outs = pl.pallas_call(
      functools.partial(_cast_transpose_kernel, dtype=jnp.dtype(dtype), cols=c if c % bc else None, block_cols=bc,
                        packed=packed, layouts=layouts, dims=dims),
      grid=(b, r // br, pl.cdiv(c, bc)),
      in_specs=[
          pl.BlockSpec((None, br, bc), lambda i, j, k: (i, j, k)),
          pl.BlockSpec((None, br), lambda i, j, k: (i, j)),
      ],
      out_specs=[q_spec] * (layouts != "qt")
      + [pl.BlockSpec((None, bc, br // word), lambda i, j, k: (i, k, j))] * (layouts != "q"),
      out_shape=[jax.ShapeDtypeStruct(q_shape, out)] * (layouts != "qt")
      + [jax.ShapeDtypeStruct((b, c, r // word), out)] * (layouts != "q"),
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
      interpret=INTERPRET,
      name=LAYOUTS[layouts],
  )(x, row_scale.astype(jnp.float32))
  return tuple(quantizers.unpack_words(o, dtype) for o in outs) if packed else tuple(outs)


def weight_amax(w: jax.Array) -> jax.Array:
  """(G,) f32 amax of each expert's (K, N) weights (exact: a max of |w|; NaN propagates)."""
  return jnp.max(jnp.abs(w), axis=(1, 2)).astype(jnp.float32)


def cast_experts(w: jax.Array, scales: jax.Array, dtype, padded: tuple[int, int] | None = None,
                 impl: str | None = None, block=None) -> jax.Array:
  """w_q (G, K, N) of `quantize_experts` from its scales, without the transposed copy or the amax: the same
  values bit for bit, whichever implementation made the forward's (the backward's dgrad reads w_q; the
  scales were kept from the forward). padded (Kp, Np): w_q zero-padded to these dims (the FP8 copy is
  padded, in the same fusion: no padded bf16 copy of w). impl (default CAST_EXPERTS_IMPL): "xla", one
  fusion; "triton", the cast-transpose kernel writing q alone (masked reads past w's ends; block as
  cast_transpose's)."""
  g = w.shape[0]
  rp, cp = padded or w.shape[1:]
  if resolve(impl or CAST_EXPERTS_IMPL, (g, rp, cp), block, packable=True) == "triton":
    row_scale = jnp.broadcast_to(scales.astype(jnp.float32)[:, None], (g, rp))
    return _cast(w, row_scale, dtype, "triton", block, padded, layouts="q")[0]
  q = _saturate(w.astype(jnp.float32) * scales.astype(jnp.float32)[:, None, None], dtype)
  if padded is None or tuple(padded) == w.shape[1:]:
    return q
  return jnp.pad(q, ((0, 0), (0, padded[0] - w.shape[1]), (0, padded[1] - w.shape[2])))


def resolve(impl: str | None, shape: tuple[int, ...] | None = None, block=None, elements: int | None = None,
            packable: bool = False) -> str:
  """The cast-transpose implementation `impl` names ("auto": triton on a GPU, xla elsewhere and for a
  (B, R, C) `shape` whose R is not a multiple of the Triton block's rows): `quantizers.resolve`.
  elements: the largest array the kernel addresses (default: the shape's); packable: the kernel writes
  outputs of 2^31 elements or more as packed words (cast_transpose's; C must be whole words)."""
  rows = (block or TRITON_BLOCK)[0]
  if elements is None:
    elements = math.prod(shape) if shape else 0
  # whole row blocks; the columns' last block may be partial (masked); 2^31 elements or more: packed words
  packable = packable and bool(shape) and shape[-1] % quantizers.WORD == 0
  return quantizers.resolve(impl or DEFAULT_IMPL, "cast_transpose", (shape[-2],) if shape else (), (rows,), elements,
                            packable)


def cast_transpose(x: jax.Array, row_scale: jax.Array, dtype, impl: str | None = None, block=None,
                   padded: tuple[int, int] | None = None):
  """(q, q^T): x (B, R, C) times row_scale (B, R), saturated to `dtype`; q^T is (B, C, R).

  block: the Triton kernel's (rows, cols[, warps]) (default: TRITON_BLOCK). padded (Rp, Cp) >= (R, C):
  the copies of x zero-padded to these dims (row_scale (B, Rp)), read from x as it is (the Triton kernel
  masks its reads past x's ends: no padded bf16 copy of the weights; XLA's form pads first)."""
  return _cast(x, row_scale, dtype, impl, block, padded, layouts="both")


def cast_transposed(x: jax.Array, row_scale: jax.Array, dtype, impl: str | None = None, block=None,
                    padded: tuple[int, int] | None = None) -> jax.Array:
  """q^T (B, Cp, Rp) of `cast_transpose` alone, bit for bit, without writing q: the forward's copy of the
  weights where the backward casts w_q again from the kept scales (`cast_experts`), so a q written in the
  forward would be read by nobody (a custom call's unused output is not removed; XLA's form drops it)."""
  return _cast(x, row_scale, dtype, impl, block, padded, layouts="qt")[0]


def _cast(x, row_scale, dtype, impl, block, padded, layouts: str):
  """cast_transpose's (q, q^T), or what `layouts` names of them (LAYOUTS: "qt" (q^T,), "q" (q,))."""
  block = block or TRITON_BLOCK
  b, r, c = x.shape
  rp, cp = padded or (r, c)
  if rp < r or cp < c:
    raise ValueError(f"cast_transpose: padded {padded} is smaller than x's ({r}, {c})")
  impl = resolve(impl, (b, rp, cp), block, packable=True)
  if impl == "xla":
    xp = jnp.pad(x, ((0, 0), (0, rp - r), (0, cp - c))) if (rp, cp) != (r, c) else x
    q, qt = _cast_transpose_xla(xp, row_scale, dtype)
    return {"both": (q, qt), "qt": (qt,), "q": (q,)}[layouts]
  if impl == "triton":
    return _cast_transpose_triton(x, row_scale, dtype, block, (rp, cp), layouts)
  raise AssertionError(impl)


def quantize_rows(x: jax.Array, tile_expert: jax.Array, num_groups: int, dtype, impl: str | None = None):
  """Per-expert current scaling of an expert-sorted (rows, d) buffer, rows a multiple of 128.

  Returns (x_q (rows, d), x_q^T (d, rows), scales (G,)): x_q[r] = x[r] * scales[g(r)] in `dtype`
  (saturating); tile_expert as in expert_amax. Spare tiles are scaled by 1 (never read).
  """
  s = group_scales(expert_amax(x, tile_expert, num_groups), dtype)
  tile_scale = jnp.where(tile_expert >= 0, s[jnp.maximum(tile_expert, 0)], 1.0)
  q, qt = cast_transpose(x[None], jnp.repeat(tile_scale, TILE_ROWS)[None], dtype, impl)
  return q[0], qt[0], s


def quantize_gathered(src: jax.Array, index: jax.Array, tile_expert: jax.Array, num_groups: int, dtype,
                      weight: jax.Array | None = None, impl: str | None = None, block=None):
  """quantize_rows of the expert-sorted buffer fp8_block.gather_rows(src, index, weight), without writing it: the
  dispatch gather (x's rows from the tokens) and the combine's backward (each slot's dy, its token's
  gradient times its routing weight, rounded once: to `dtype`) fused into the cast.

  src (tokens, d); index (rows,) int, rows a multiple of 128, `tokens` for padding slots; weight (rows,).
  Each expert's amax comes from the tokens' row amaxes (one read of src, rows / top_k of the buffer's),
  gathered per slot and times |weight|: the same value as the buffer's amax, since |a * w| rounds
  monotonically, so max |src[t] * w| = max |src[t]| * |w| in floating point as well. Returns
  (q (rows, d), q^T (d, rows), scales (G,)), bit-equal to quantize_rows of the buffer (a NaN gives its
  experts scale 1 here always; XLA:CPU's max over an fp32 buffer may skip it, its GPU max does not).
  block: the Triton kernel's (rows, cols[, warps]) (default: TRITON_BLOCK)."""
  tokens = src.shape[0]
  real = index < tokens
  slot_amax = jnp.where(real, jnp.max(jnp.abs(src), axis=1).astype(jnp.float32)[jnp.where(real, index, 0)], 0.0)
  if weight is not None:
    slot_amax = slot_amax * jnp.abs(weight.astype(jnp.float32))
  s = group_scales(_experts_of_tiles_amax(jnp.max(slot_amax.reshape(-1, TILE_ROWS), axis=1), tile_expert, num_groups),
                   dtype)
  row_scale = jnp.repeat(jnp.where(tile_expert >= 0, s[jnp.maximum(tile_expert, 0)], 1.0), TILE_ROWS)
  shape = (1, index.shape[0], src.shape[1])
  block = block or TRITON_BLOCK
  if resolve(impl, shape, block, max(index.shape[0], src.shape[0]) * src.shape[1]) == "xla":  # src read by index too
    q, qt = _cast_transpose_xla(fp8_block.gather_rows(src, index, weight), row_scale, dtype)
  else:
    q, qt = _cast_transpose_gathered_triton(src, index, weight, row_scale, dtype, block)
  return q, qt, s


def _cast_transpose_gathered_kernel(index_ref, *refs, tokens, weighted, dtype, cols, block_cols):
  """_cast_transpose_kernel on the tile of rows src[index] (x weight, fp32): the gather reads as it casts."""
  weight_ref, refs = (refs[0], refs[1:]) if weighted else (None, refs)
  s_ref, src_ref, q_ref, qt_ref = refs
  index = index_ref[...]
  real = index < tokens  # index == tokens: a padding slot, zero
  mask = _column_mask(cols, block_cols, 1)
  row = jnp.where(real, index, 0)  # padding reads row 0
  if mask is None:
    v = src_ref[row, pl.ds(pl.program_id(1) * block_cols, block_cols)]
  else:  # a tail block: both indices as arrays, the missing columns masked
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

    col = pl.program_id(1) * block_cols + jnp.arange(block_cols)
    v = pltriton.load(src_ref.at[row[:, None], col[None, :]], mask=mask[None, :], other=0)
  v = jnp.where(real[:, None], v.astype(jnp.float32), 0.0)
  if weighted:
    v = v * weight_ref[...].astype(jnp.float32)[:, None]
  _store_both(q_ref, qt_ref, v * s_ref[...][:, None], dtype, mask)


def _cast_transpose_gathered_triton(src, index, weight, row_scale, dtype, block):
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel

  tokens, c = src.shape
  r = index.shape[0]
  br, bc, warps = (*block, 4)[:3]
  weighted = weight is not None
  rows = pl.BlockSpec((br,), lambda i, j: (i,))
  return pl.pallas_call(
      functools.partial(_cast_transpose_gathered_kernel, tokens=tokens, weighted=weighted, dtype=jnp.dtype(dtype),
                        cols=c if c % bc else None, block_cols=bc),
      grid=(r // br, pl.cdiv(c, bc)),
      in_specs=[rows] + [rows] * weighted + [rows, pl.BlockSpec(memory_space=pl.ANY)],  # src: read by index
      out_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j)), pl.BlockSpec((bc, br), lambda i, j: (j, i))],
      out_shape=[jax.ShapeDtypeStruct((r, c), dtype), jax.ShapeDtypeStruct((c, r), dtype)],
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
      interpret=INTERPRET,
      name="temoe_fp8_cast_transpose_gathered",
  )(index.astype(jnp.int32), *([weight.astype(jnp.float32)] if weighted else []), row_scale.astype(jnp.float32), src)


def quantize_experts(w: jax.Array, dtype, impl: str | None = None):
  """Per-expert current scaling of (G, K, N) weights: (w_q (G, K, N), w_q^T (G, N, K), scales (G,))."""
  g, k, _ = w.shape
  s = group_scales(weight_amax(w), dtype)
  q, qt = cast_transpose(w, jnp.broadcast_to(s[:, None], (g, k)), dtype, impl)
  return q, qt, s
