"""Which implementation an FP8 quantizer runs, one rule for `fp8_quant` (per-expert current scaling) and
`fp8_block` (DeepSeek-V3's block scales): its Pallas Triton kernel on a GPU when the operand is whole
kernel tiles, XLA's expression of the same math elsewhere and for other shapes; an explicit "triton" on
a shape that is not whole tiles is refused rather than run on a partial tile."""

from __future__ import annotations

import jax

IMPLS = ("auto", "xla", "triton")
MAX_ELEMENTS = 2**31
"""The largest array a Triton quantizer reads or writes, in elements: Pallas' Triton lowering computes
element offsets in 32-bit signed arithmetic unless an array is over 2^32 bytes, so a one-byte (FP8)
array of 2^31 to 2^32 elements would wrap."""


def resolve(impl: str, what: str, dims: tuple[int, ...], tile: tuple[int, ...], elements: int = 0) -> str:
  """"xla" or "triton" for `impl` (one of IMPLS) and an operand with these trailing `dims` and
  `elements` in all, whose Triton kernel reads `tile`-sized blocks of them."""
  if impl not in IMPLS:
    raise ValueError(f"{what} impl {impl!r}: choose one of {', '.join(IMPLS)}")
  whole = all(d % t == 0 for d, t in zip(dims, tile))
  fits = elements < MAX_ELEMENTS
  if impl == "auto":
    return "triton" if jax.default_backend() == "gpu" and whole and fits else "xla"
  if impl == "triton" and not whole:
    raise ValueError(f"{what}: its Triton kernel needs dims that are multiples of {' x '.join(map(str, tile))}, "
                     f"got {dims}")
  if impl == "triton" and not fits:
    raise ValueError(f"{what}: its Triton kernel takes arrays of fewer than 2^31 elements, got {elements}")
  return impl
