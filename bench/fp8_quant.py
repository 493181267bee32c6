"""Benchmark: the FP8 casts around temoe's Hopper grouped GEMMs (`temoe.moe.experts.fp8_quant`), per
operand of one MoE layer, on one GPU: the per-expert amax and the cast that writes both FP8 layouts,
XLA's fusion vs the Pallas Triton cast-transpose over a sweep of block shapes, each checked
bit-for-bit against the XLA expression in the same call. Effective bandwidth counts the bf16 read
and both FP8 writes once (the minimum a two-layout cast moves).

    python bench/fp8_quant.py [--out bench/results] [--shapes dsv3,qwen3_30b_a3b] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import moe_layer  # noqa: E402  (the layer benchmark's shapes, routing and timer)
import plots  # noqa: E402

from temoe.moe import dispatch  # noqa: E402
from temoe.moe.experts import fp8_quant as fq  # noqa: E402
from temoe.moe.experts import mosaic_gemm as mz  # noqa: E402

BLOCKS = [(64, 128, 4), (64, 128, 8), (32, 128, 4), (128, 128, 8), (64, 256, 8), (64, 64, 4), (32, 256, 4),
          (128, 64, 4), (128, 64, 8), (64, 64, 2), (256, 64, 8)]  # 64 wide: operands of whole 64s, not 128s


def operands(name: str):
  """The layer's four FP8 activation operands (expert-sorted, padded rows) and two weights."""
  hidden, ffn, experts, tokens, top_k = moe_layer.SHAPES[name]
  ids, _ = moe_layer.skewed_routing(jax.random.key(0), experts, tokens, top_k)
  p = dispatch.plan(ids, experts, 128)
  rows = -(-p.buffer_rows // 128) * 128
  sizes = p.padded_group_sizes
  key = jax.random.key(1)
  acts = {
      "x": (rows, hidden), "dy_gate_up": (rows, 2 * ffn), "h": (rows, ffn), "dy_down": (rows, hidden),
  }
  out = {n: ("rows", jax.random.normal(jax.random.fold_in(key, i), s, jnp.bfloat16)) for i, (n, s) in enumerate(acts.items())}
  # the MLP from tokens' two gathering casts (mosaic_tokens): x's rows and dy's (times a routing weight) from the tokens
  out["x_gathered"] = ("gathered", jax.random.normal(jax.random.fold_in(key, 7), (tokens, hidden), jnp.bfloat16))
  out["wi"] = ("experts", jax.random.normal(jax.random.fold_in(key, 9), (experts, hidden, 2 * ffn), jnp.bfloat16))
  out["wo"] = ("experts", jax.random.normal(jax.random.fold_in(key, 10), (experts, ffn, hidden), jnp.bfloat16))
  return out, sizes, experts, rows, p


def plot(result: dict, path: str) -> None:
  """Effective TB/s per operand: XLA's fusion and each Triton block."""
  rows = [(f"{s}/{op}", r) for s, ops in result["shapes"].items() for op, r in ops.items()]
  impls = sorted({k[:-3] for _, r in rows for k in r if k.endswith("_ms") and k != "amax_ms"},
                 key=lambda k: (k != "xla", k))
  series = {impl: [r["bytes_moved_min"] / r[f"{impl}_ms"] / 1e9 if f"{impl}_ms" in r else 0 for _, r in rows]
            for impl in impls}  # bytes per ms / 1e9 = TB/s
  plots.grouped_bars(path, [n for n, _ in rows], series, "TB/s (bf16 in + both FP8 layouts out)",
                     f"FP8 cast-transpose per operand, {result['device']}", figsize=(10, 4), rotate=30, legend_size=6)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--shapes", default="dsv3,qwen3_30b_a3b")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--operands", help="comma list of the operands to time (default: all): x, dy_gate_up, h, dy_down, "
                      "x_gathered, wi, wo")
  parser.add_argument("--plot-only", metavar="JSON", help="redraw the PNG of an existing fp8_quant.json")
  args = parser.parse_args()
  if args.plot_only:
    with open(args.plot_only, encoding="utf-8") as f:
      plot(json.load(f), args.plot_only.removesuffix(".json") + ".png")
    return
  result = {"command": " ".join(["python", "bench/fp8_quant.py", *sys.argv[1:]]),
            "device": jax.devices()[0].device_kind, "shapes": {}}
  os.makedirs(args.out, exist_ok=True)
  for name in args.shapes.split(","):
    ops, sizes, experts, rows, p = operands(name)
    tiles = mz.tile_groups(sizes, rows // 128, 128)
    res = result["shapes"][name] = {}
    for op, (kind, a) in ops.items():
      if args.operands and op not in args.operands.split(","):
        continue
      if kind == "gathered":
        top_k = moe_layer.SHAPES[name][4]  # each buffer row's token; padding reads the zero row `tokens`
        index = jnp.pad(p.choice_of_slot // top_k, (0, rows - p.choice_of_slot.shape[0]), constant_values=a.shape[0])

        def quant(a, impl, block=None):
          return fq.quantize_gathered(a, index, tiles, experts, fq.E4M3, impl=impl, block=block)[:2]
        amax_fn = jax.jit(lambda a: jnp.max(jnp.abs(a), axis=1))
      elif kind == "rows":
        def quant(a, impl, block=None):
          amax = fq.expert_amax(a, tiles, experts)
          s = fq.group_scales(amax, fq.E4M3)
          ts = jnp.where(tiles >= 0, s[jnp.maximum(tiles, 0)], 1.0)
          return fq.cast_transpose(a[None], jnp.repeat(ts, 128)[None], fq.E4M3, impl, block)
        amax_fn = jax.jit(lambda a: fq.expert_amax(a, tiles, experts))
      else:
        def quant(a, impl, block=None):
          s = fq.group_scales(jnp.max(jnp.abs(a), axis=(1, 2)), fq.E4M3)
          return fq.cast_transpose(a, jnp.broadcast_to(s[:, None], a.shape[:2]), fq.E4M3, impl, block)
        amax_fn = jax.jit(lambda a: jnp.max(jnp.abs(a), axis=(1, 2)))
      nbytes = (rows if kind == "gathered" else a.shape[0] if a.ndim == 2 else a.shape[0] * a.shape[1]) * a.shape[-1] * 4
      # (gathered: rows x d, as a gather of the written buffer would read) 2 read + 1 + 1 written
      row = res[op] = {"shape": list(a.shape), "bytes_moved_min": nbytes}
      row["amax_ms"] = moe_layer.timed(amax_fn, a, iters=args.iters) * 1e3
      ref = jax.jit(lambda a: quant(a, "xla"))
      row["xla_ms"] = moe_layer.timed(ref, a, iters=args.iters) * 1e3
      want = [np.asarray(t.astype(jnp.float32)) for t in ref(a)]
      for block in BLOCKS:
        key = f"triton_{block[0]}x{block[1]}w{block[2]}"
        try:
          fn = jax.jit(lambda a, block=block: quant(a, "triton", block))
          got = fn(a)
          same = all(np.array_equal(np.asarray(g.astype(jnp.float32)), w) for g, w in zip(got, want))
          row[f"{key}_ms"] = moe_layer.timed(fn, a, iters=args.iters) * 1e3
          row[f"{key}_bitwise_equal_xla"] = bool(same)
        except Exception as exc:  # pylint: disable=broad-exception-caught
          row[f"{key}_error"] = moe_layer.error_text(exc)
      times = {k[:-3]: v for k, v in row.items() if k.endswith("_ms") and k != "amax_ms"}
      best = min(times, key=times.get)
      row["best"], row["best_gbps"] = best, nbytes / (row[f"{best}_ms"] * 1e-3) / 1e9
      print(name, op, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
      with open(os.path.join(args.out, "fp8_quant.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
  plot(result, os.path.join(args.out, "fp8_quant.png"))
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
