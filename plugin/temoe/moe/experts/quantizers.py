"""Which implementation an FP8 quantizer runs, one rule for `fp8_quant` (per-expert current scaling) and
`fp8_block` (DeepSeek-V3's block scales): its Pallas Triton kernel on a GPU when the operand is whole
kernel tiles, XLA's expression of the same math elsewhere and for other shapes; an explicit "triton" on
a shape that is not whole tiles is refused rather than run on a partial tile."""

from __future__ import annotations

import jax

IMPLS = ("auto", "xla", "triton")


def resolve(impl: str, what: str, dims: tuple[int, ...], tile: tuple[int, ...]) -> str:
  """"xla" or "triton" for `impl` (one of IMPLS) and an operand with these trailing `dims`, whose Triton
  kernel reads `tile`-sized blocks of them."""
  if impl not in IMPLS:
    raise ValueError(f"{what} impl {impl!r}: choose one of {', '.join(IMPLS)}")
  whole = all(d % t == 0 for d, t in zip(dims, tile))
  if impl == "auto":
    return "triton" if jax.default_backend() == "gpu" and whole else "xla"
  if impl == "triton" and not whole:
    raise ValueError(f"{what}: its Triton kernel needs dims that are multiples of {' x '.join(map(str, tile))}, "
                     f"got {dims}")
  return impl
