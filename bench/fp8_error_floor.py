"""Where the blockwise FP8 layer's error comes from, and the floor under any recipe that keeps an
operand in E4M3 (runs on CPU: it is arithmetic, not speed).

One MoE layer (dispatch, gate/up, SwiGLU, down, combine) forward and backward written out GEMM by
GEMM in float32 (HIGHEST precision), each GEMM reading its operands through a quantizer:

  forward   x (1 x 128 blocks) @ wi (128 x 128);  h (1 x 128) @ wo (128 x 128)
  backward  dy (1 x 128) @ wo^T;  h^T (128 x 1) @ dy (128 x 1);  dgu (1 x 128) @ wi^T;  x^T (128 x 1) @ dgu (128 x 1)

where dy is each slot's incoming gradient (its token's, times its routing weight) and dgu the
activation's gradient. A site (x, wi, h, wo, dy, dgu) is read through one of:

  none    float32 as it is
  recipe  te_fp8_blockwise's quantizers (temoe.moe.experts.fp8_block, XLA form): what the kernels
          multiply, up to their fp32 accumulation order (rel. 0.0017 on the H200: mosaic_gemm_blockwise.json)
  pow2    the same with power-of-two scales (each value then rounds as to 3 mantissa bits with an
          exponent of its own, but in E4M3's subnormals)
  oracle  the same blocks, each at the scale (of 51 from 0.75x to 2x amax / 448) that minimises its own
          squared error: what E4M3 with one scale per block reaches with the best scale for every
          block, which no rule computing scales from the block can beat by more than the search's step

Variants: every site at one setting, the forward sites only, and one site at a time. Errors are the
relative L2 of (y, dx, dwi, dwo) against the float32 layer, as bench/moe_layer.py's `--errors`
computes them (same data: Gaussian x and cotangent, weights scaled by fan-in^-0.5, the skewed
routing), on DeepSeek-V3's dims with fewer tokens (a rounding error is per element, so the relative
errors do not depend on the row count). The float32 variant is checked against autodiff of
bench/moe_layer.py's float32 layer; the recipe variant is printed beside the H200's measured errors.

    python bench/fp8_error_floor.py [--out bench/results] [--tokens 1024] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import plots  # bench/plots.py, beside this file
from moe_layer import float32_layer_vjp, rel_l2, skewed_routing  # the GPU layer benchmark's data and reference
from temoe import recipes
from temoe.moe.context import swiglu
from temoe.moe.experts import fp8_block, parts

SITES = ("x", "wi", "h", "wo", "dy", "dgu")
FORWARD = ("x", "wi", "h", "wo")
HI = jax.lax.Precision.HIGHEST


SEARCH = np.linspace(0.75, 2.0, 51)
"""Scales tried per block by `oracle`, as multiples of the recipe's amax / 448: the grid of E4M3 values
repeats every factor of 2, so [1, 2) covers every alignment of it to a block's values without clipping,
and below 1 the largest values clip in exchange for a finer grid."""


def best_scaled(blocks: jax.Array) -> jax.Array:
  """blocks (..., B) each read through E4M3 with the one scale of SEARCH that minimises its squared error."""
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  base = jnp.where(amax > 0, amax / fp8_block.FMAX, 1.0)
  candidates = jnp.asarray(SEARCH, jnp.float32)

  def step(i, carry):  # one candidate at a time: a loop, so memory stays a few copies of the blocks
    best, best_err = carry
    s = base * candidates[i]
    q = jnp.clip(blocks / s, -fp8_block.FMAX, fp8_block.FMAX).astype(fp8_block.E4M3).astype(jnp.float32) * s
    err = jnp.sum((q - blocks) ** 2, axis=-1, keepdims=True)
    return jnp.where(err < best_err, q, best), jnp.minimum(err, best_err)

  return jax.lax.fori_loop(0, len(SEARCH), step, (blocks * 0.0, jnp.full(amax.shape, jnp.inf)))[0]


def rows_q(a, kind):
  """a (R, C) read in 1 x 128 blocks along C."""
  if kind == "none":
    return a
  if kind == "oracle":
    r, c = a.shape
    padded = jnp.pad(a, ((0, 0), (0, fp8_block.blocks(c) * 128 - c)))
    return best_scaled(padded.reshape(r, -1, 128)).reshape(r, -1)[:, :c]
  q, s = fp8_block.quantize_rows_xla(a, pow2=kind == "pow2")
  return fp8_block.dequantize_rows(q, s)


def cols_q(a, kind):
  """a (R, C) read in 128 x 1 blocks along R (the wgrad operands: contraction over rows)."""
  return rows_q(a.T, kind).T


def weights_q(w, kind):
  """w (G, K, N) read in 128 x 128 blocks."""
  if kind == "none":
    return w
  if kind == "oracle":
    g, k, n = w.shape  # DeepSeek-V3's dims are whole blocks
    b = w.reshape(g, k // 128, 128, n // 128, 128).transpose(0, 1, 3, 2, 4).reshape(g, k // 128, n // 128, -1)
    return best_scaled(b).reshape(g, k // 128, n // 128, 128, 128).transpose(0, 1, 3, 2, 4).reshape(g, k, n)
  q, _, s = fp8_block.quantize_weights_xla(w, pow2=kind == "pow2")
  return fp8_block.dequantize_weights(q, s)


def expert_rows(ids: np.ndarray, experts: int, block: int = 128):
  """Per expert: the flat (token * top_k + choice) of its rows, padded with -1 to whole 128-row blocks
  (the kernels' groups are padded so, and 128 x 1 blocks never straddle two experts)."""
  flat = ids.reshape(-1)
  out = []
  for e in range(experts):
    mine = np.flatnonzero(flat == e)
    out.append(np.concatenate([mine, np.full(-(-len(mine) // block) * block - len(mine), -1)]).astype(np.int64))
  return out


def layer_with(setting: dict, x, wi, wo, cot, weights, groups, top_k):
  """(y, dx, dwi, dwo) of the layer with each site read as `setting[site]` says."""
  tokens, emb = x.shape
  wiq, woq = weights_q(wi, setting["wi"]), weights_q(wo, setting["wo"])
  wflat = weights.reshape(-1)
  y = jnp.zeros((tokens, emb), jnp.float32)
  dx = jnp.zeros((tokens, emb), jnp.float32)
  dwi, dwo = [], []
  for e, rows in enumerate(groups):
    real = rows >= 0
    r = np.where(real, rows, 0)
    tok = r // top_k
    w_row = jnp.where(real, wflat[r], 0.0)
    xe = jnp.where(real[:, None], x[tok], 0.0)
    gu = jnp.dot(rows_q(xe, setting["x"]), wiq[e], precision=HI)
    g0, g1 = parts.split_gate_up(gu)
    h, act_vjp = jax.vjp(swiglu, g0, g1)
    ye = jnp.dot(rows_q(h, setting["h"]), woq[e], precision=HI)
    y = y.at[tok].add(jnp.where(real[:, None], w_row[:, None] * ye, 0.0))
    dy = jnp.where(real[:, None], w_row[:, None] * cot[tok], 0.0)
    dh = jnp.dot(rows_q(dy, setting["dy"]), woq[e].T, precision=HI)
    dwo.append(jnp.dot(cols_q(h, setting["h"]).T, cols_q(dy, setting["dy"]), precision=HI))
    dgu = jnp.concatenate(act_vjp(dh), axis=1)
    dxe = jnp.dot(rows_q(dgu, setting["dgu"]), wiq[e].T, precision=HI)
    dwi.append(jnp.dot(cols_q(xe, setting["x"]).T, cols_q(dgu, setting["dgu"]), precision=HI))
    dx = dx.at[tok].add(jnp.where(real[:, None], dxe, 0.0))
  return y, dx, jnp.stack(dwi), jnp.stack(dwo)


def variants() -> dict[str, dict]:
  """name -> the reading of each site."""
  every = lambda kind, sites=SITES: {s: (kind if s in sites else "none") for s in SITES}  # noqa: E731
  out = {"float32": every("none")}
  for kind in ("recipe", "pow2", "oracle"):
    out[kind] = every(kind)
    out[f"{kind}_forward_only"] = every(kind, FORWARD)
  for site in SITES:
    out[f"recipe_{site}_only"] = every("recipe", (site,))
  for site in ("x", "wi", "dy"):
    out[f"oracle_{site}_only"] = every("oracle", (site,))
  return out


def measured_on_h200(path: str = os.path.join(os.path.dirname(__file__), "results", "moe_layer.json")) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)["shapes"]["dsv3"]["errors"]["temoe_fp8_blockwise"]
  except (OSError, KeyError, ValueError):
    return {}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--top-k", type=int, default=2)
  parser.add_argument("--hidden", type=int, default=7168)
  parser.add_argument("--ffn", type=int, default=2048)
  parser.add_argument("--variants", default="", help="comma-separated subset (default: all)")
  args = parser.parse_args(argv)
  start = time.time()
  hidden, ffn, experts, tokens, top_k = args.hidden, args.ffn, args.experts, args.tokens, args.top_k
  key = jax.random.key(0)
  ids, weights = skewed_routing(key, experts, tokens, top_k)
  kx, kw, ko, kc = jax.random.split(jax.random.fold_in(key, 7), 4)
  x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16).astype(jnp.float32)  # bf16 values, as the layer's input
  wi = (jax.random.normal(kw, (experts, hidden, 2 * ffn), jnp.float32) * hidden**-0.5).astype(jnp.bfloat16).astype(jnp.float32)
  wo = (jax.random.normal(ko, (experts, ffn, hidden), jnp.float32) * ffn**-0.5).astype(jnp.bfloat16).astype(jnp.float32)
  cot = jax.random.normal(kc, (tokens, hidden), jnp.float32)
  groups = expert_rows(np.asarray(ids), experts)
  loads = np.bincount(np.asarray(ids).reshape(-1), minlength=experts)
  ref = float32_layer_vjp(ids, weights, experts, top_k, int(loads.max()))(x, wi, wo, cot)
  fwd_bound, grad_bound = recipes.REGISTRY["te_fp8_blockwise"].error_bound
  chosen = [v for v in args.variants.split(",") if v] or list(variants())
  result = {
      "command": "python bench/fp8_error_floor.py " + " ".join(argv if argv is not None else sys.argv[1:]),
      "device": jax.devices()[0].device_kind, "jax": jax.__version__,
      "dims": {"hidden": hidden, "ffn": ffn, "experts": experts, "tokens": tokens, "top_k": top_k},
      "loads": loads.tolist(), "targets": {"y": 0.035, "grads": 0.04}, "registry_bound": [fwd_bound, grad_bound],
      "h200_measured_recipe": measured_on_h200(), "variants": {},
  }
  table = variants()
  for name in chosen:
    layer = jax.jit(lambda *a, setting=table[name]: layer_with(setting, *a, groups, top_k))
    got = layer(x, wi, wo, cot, weights)
    errs = {k: rel_l2(g, r) for k, g, r in zip(("y", "dx", "dwi", "dwo"), got, ref)}
    result["variants"][name] = {"sites": table[name], "errors": errs}
    print(f"{name:24s} " + "  ".join(f"{k} {v:.4f}" for k, v in errs.items()), flush=True)
  result["elapsed_s"] = time.time() - start
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "fp8_error_floor.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  shown = [v for v in ("recipe", "oracle", "recipe_forward_only", "oracle_forward_only") if v in result["variants"]]
  plots.grouped_bars(os.path.join(args.out, "fp8_error_floor.png"), ["y", "dx", "dwi", "dwo"],
                     {v: [result["variants"][v]["errors"][k] for k in ("y", "dx", "dwi", "dwo")] for v in shown},
                     "rel. L2 error vs float32", "E4M3 layer error: the recipe, and each block at its best scale")
  return 0


if __name__ == "__main__":
  sys.exit(main())
