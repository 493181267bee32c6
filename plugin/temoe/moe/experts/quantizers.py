"""Which implementation an FP8 quantizer runs, one rule for `fp8_quant` (per-expert current scaling) and
`fp8_block` (DeepSeek-V3's block scales): its Pallas Triton kernel on a GPU when the operand's dims are
whole blocks where the kernel needs them (fp8_block: both; fp8_quant's cast-transpose: rows, its last
column block masked), XLA's expression of the same math elsewhere and for other shapes; an explicit
"triton" on a shape the kernel cannot take is refused rather than run on a partial tile. Also how their
kernels write FP8 outputs too large for 32-bit element offsets (packed words)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "triton")
MAX_ELEMENTS = 2**31
"""The largest array a Triton quantizer writes as one-byte FP8 values, in elements: Pallas' Triton lowering
computes element offsets in 32-bit signed arithmetic unless an array is over 2^32 bytes, so a one-byte
array of 2^31 to 2^32 elements would wrap. Larger FP8 outputs are written as 32-bit words of four values
(`pack_words`; a quarter of the elements, the same bytes) and read back as FP8 by a bitcast (`unpack_words`)."""
WORD = 4  # FP8 values per packed 32-bit word
# `auto` takes the packed kernels: on the H200 the blockwise 2880-dim layer's wi (128 x 2944 x 5760, padded
# as read) quantizes in 3.35 ms packed against 6.6 in XLA's form, and the layer takes 15.62 ms against 18.66
# (bench/results/moe_layer.gpt_oss_like.blockwise_packed.json, _unpacked.json: one call each, same code);
# both packed kernels bit-equal to XLA there (tests/gpu/test_mosaic_kernels.py::test_packed_fp8_outputs_match_xla).


def packs(elements: int) -> bool:
  """Whether a Triton quantizer writes an FP8 output of `elements` as packed words (MAX_ELEMENTS or more)."""
  return elements >= MAX_ELEMENTS


def pack_words(q: jax.Array) -> jax.Array:
  """(..., C) FP8 -> (..., C / 4) uint32 inside a kernel, value 4j + i in byte i of word j (little-endian:
  the layout `unpack_words`' bitcast reads)."""
  b = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)
  b = b.reshape(*q.shape[:-1], q.shape[-1] // WORD, WORD)
  return jnp.sum(b << (jnp.arange(WORD, dtype=jnp.uint32) * 8), axis=-1, dtype=jnp.uint32)  # disjoint bits


def unpack_words(u: jax.Array, dtype) -> jax.Array:
  """(..., W) uint32 of `pack_words` -> (..., 4W) `dtype` (one byte each)."""
  return jax.lax.bitcast_convert_type(u, dtype).reshape(*u.shape[:-1], u.shape[-1] * WORD)


def resolve(impl: str, what: str, dims: tuple[int, ...], tile: tuple[int, ...], elements: int = 0,
            packable: bool = False) -> str:
  """"xla" or "triton" for `impl` (one of IMPLS) and an operand with these trailing `dims` and
  `elements` in all, whose Triton kernel reads `tile`-sized blocks of them; `packable`: the kernel writes
  outputs of MAX_ELEMENTS or more as packed words (`auto` and "triton" take them)."""
  if impl not in IMPLS:
    raise ValueError(f"{what} impl {impl!r}: choose one of {', '.join(IMPLS)}")
  whole = all(d % t == 0 for d, t in zip(dims, tile))
  fits = elements < MAX_ELEMENTS or packable
  if impl == "auto":
    return "triton" if jax.default_backend() == "gpu" and whole and fits else "xla"
  if impl == "triton" and not whole:
    raise ValueError(f"{what}: its Triton kernel needs dims that are multiples of {' x '.join(map(str, tile))}, "
                     f"got {dims}")
  if impl == "triton" and not fits:
    raise ValueError(f"{what}: its Triton kernel takes arrays of fewer than 2^31 elements, got {elements}")
  return impl
