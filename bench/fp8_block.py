"""Benchmark: the blockwise-FP8 quantizers (temoe.moe.experts.fp8_block) on the DeepSeek-V3 layer's
operands, alone, on one GPU: each operand's one pass (bf16 in, both FP8 layouts and their scales out)
with the Pallas Triton kernels at several warp counts and as XLA's fusion, every output checked
against XLA's in the same call. Milliseconds and the bandwidth the pass moves (2 bytes read, 2 written
per element, plus the scales) say what each operand's quantization costs in the layer.

    python bench/fp8_block.py [--out bench/results] [--warps 4,8,16] [--variants base,recip,bf16amax,recip+bf16amax]

Variants (fp8_block's module flags): recip casts x * (1 / s) (RECIPROCAL; XLA's reference follows),
bf16amax takes the amax on the bf16 input (AMAX_IN_INPUT_DTYPE); keys triton_<variant>_w<warps>_*
(base: triton_w<warps>_*, as before).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_layer import timed  # bench/moe_layer.py, beside this file
from temoe.moe.experts import fp8_block as fb

ROWS = 69632  # the dsv3 layer's dispatch buffer: 8192 tokens x top-8 + 32 experts x 127, in 128-row tiles
OPERANDS = {  # name -> shape; rows operands are (rows, dim), weights (experts, K, N)
    "x (gate/up input, dgrad of the dispatch)": ("rows", (ROWS, 7168)),
    "h (down input)": ("rows", (ROWS, 2048)),
    "d gate/up (gate/up dgrad and wgrad)": ("rows", (ROWS, 4096)),
    "wi (32 x 7168 x 4096)": ("weights", (32, 7168, 4096)),
    "wo (32 x 2048 x 7168)": ("weights", (32, 2048, 7168)),
}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--warps", default="4,8,16")
  parser.add_argument("--variants", default="base")
  args = parser.parse_args()
  result = {"command": " ".join(["python3", "bench/fp8_block.py", *sys.argv[1:]]), "device": jax.devices()[0].device_kind,
            "operands": {}}
  key = jax.random.key(0)
  for name, (kind, shape) in OPERANDS.items():
    x = jax.random.normal(key, shape, jnp.bfloat16)
    quant = fb.quantize_both if kind == "rows" else fb.quantize_weights
    elems = int(np.prod(shape))
    moved = elems * (2 + 2) + elems // 128 * 4 * (2 if kind == "rows" else 1 / 64)
    rec = {"shape": shape, "bytes_moved": moved}
    shipped = (fb.ROWS_WARPS, fb.WEIGHTS_WARPS, fb.RECIPROCAL, fb.AMAX_IN_INPUT_DTYPE)
    for variant in args.variants.split(","):
      fb.RECIPROCAL, fb.AMAX_IN_INPUT_DTYPE = "recip" in variant, "bf16amax" in variant
      tag = "" if variant == "base" else f"{variant}_"
      ref = jax.jit(lambda a, quant=quant: quant(a, impl="xla"))(x)
      if variant in ("base", "recip"):
        sec = timed(jax.jit(lambda a, quant=quant: quant(a, impl="xla")), x, iters=10)
        rec[f"xla_{tag}ms"], rec[f"xla_{tag}tb_s"] = sec * 1e3, moved / sec / 1e12
      for warps in (int(w) for w in args.warps.split(",")):
        fb.ROWS_WARPS = fb.WEIGHTS_WARPS = warps
        fn = jax.jit(lambda a, quant=quant: quant(a, impl="triton"))
        key_ = f"triton_{tag}w{warps}"
        try:
          got = fn(x)
          rec[f"{key_}_differs"] = max(float(jnp.mean((g.astype(jnp.float32) != r.astype(jnp.float32))))
                                       for g, r in zip(got, ref))
          sec = timed(fn, x, iters=10)
          rec[f"{key_}_ms"], rec[f"{key_}_tb_s"] = sec * 1e3, moved / sec / 1e12
        except Exception as exc:  # pylint: disable=broad-exception-caught
          rec[f"{key_}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        del fn
      del ref
    fb.ROWS_WARPS, fb.WEIGHTS_WARPS, fb.RECIPROCAL, fb.AMAX_IN_INPUT_DTYPE = shipped
    result["operands"][name] = rec
    print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
    del x
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "fp8_block.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
