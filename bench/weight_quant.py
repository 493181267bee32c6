"""Benchmark: the expert weights' per-step FP8 passes of current scaling as the scanned train step runs
them: a layer's slice of the stacked (L, G, K, N) weights, read in place inside a `lax.scan` (MaxText's
scanned layers), per MoE layer:

- amax: each expert's max |w| (`fp8_quant.weight_amax`, the forward), in several XLA formulations;
- recast: w_q from the kept scales (`fp8_quant.cast_experts`, the backward's dgrad operand): XLA's
  fusion, its FP8 written as words, and the Triton cast kernel writing q alone;
- forward: the amax and the forward's cast (`fp8_quant.cast_transposed`, the Triton kernel on a GPU)
  together, as the forward runs them: each amax formulation beside the kernel that reads the same slice,
  and the shipped amax beside the kernel's other blocks;
- persistent: what FP8 copies kept from one step to the next would cost instead (a design not built:
  state beside the parameters that MaxText's train step would carry). The copies would be written where
  the optimizer writes the weights: MaxText's AdamW (optax.adamw with base.yml's settings, moments in the
  weights' dtype) updating the whole stack, then each expert's amax and both FP8 layouts of the new
  weights (`refresh_*`: the extra time over the update alone, per layer, XLA's fusion or the Triton
  kernel); the step would read a layer's slice of the stacked copies, forward (w_q^T) and backward (w_q)
  (`slices`: a consumer that takes the whole slice, as a kernel's operand, so an upper bound where XLA
  would copy it out of the stack). `today` is the passes they would replace (the shipped amax, forward
  cast and backward cast); `saving_*` is today minus refresh minus slices, per layer. The refreshed
  copies are checked bit-equal to the forward's and the backward's copies of the same updated weights.

Every formulation is checked bit-equal to the shipped one in the same call; time is per layer (a scan
over the layers divided by L), with the bytes it must move (amax: w once; recast: w in, w_q out).

    python bench/weight_quant.py [--out bench/results] [--shape 32,7168,4096] [--layers 4] [--iters 10] [--shipped-only]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
import moe_layer  # noqa: E402  (the timer)
import plots  # noqa: E402

from temoe.moe.experts import fp8_quant as fq  # noqa: E402

E4M3 = fq.E4M3


def _amax_two_stage(w):
  """Rows first (a reduction over N with G*K outputs), then each expert's K row maxima."""
  return jnp.max(jnp.max(jnp.abs(w), axis=2), axis=1).astype(jnp.float32)


def _amax_columns_first(w):
  """Over K first (G*N outputs, a column reduction), then N."""
  return jnp.max(jnp.max(jnp.abs(w), axis=1), axis=1).astype(jnp.float32)


def _amax_chunks(w, chunk: int = 64):
  """K in chunks of `chunk` rows: (G, K/chunk, chunk*N) reduced over its last axis, then the chunks."""
  g, k, n = w.shape
  if k % chunk:
    return fq.weight_amax(w)
  return jnp.max(jnp.max(jnp.abs(w.reshape(g, k // chunk, chunk * n)), axis=2), axis=1).astype(jnp.float32)


def _amax_bits(w):
  """max |w| as the max of its bf16 bit patterns with the sign cleared (integer max: NaN patterns sort
  above inf, so a NaN still wins), then back to float."""
  bits = jax.lax.bitcast_convert_type(w, jnp.uint16) & jnp.uint16(0x7FFF)
  top = jnp.max(jnp.max(bits, axis=2), axis=1)
  return jax.lax.bitcast_convert_type(top, jnp.bfloat16).astype(jnp.float32)


AMAX = {"shipped": fq.weight_amax, "two_stage": _amax_two_stage, "columns_first": _amax_columns_first,
        "chunks64": _amax_chunks, "bits": _amax_bits}


def _recast_words(w, s):
  """The same values written as 32-bit words (four FP8 a word), bitcast back to (G, K, N) FP8."""
  g, k, n = w.shape
  q = fq.cast_experts(w, s, E4M3, impl="xla").reshape(g, k, n // 4, 4)
  words = jax.lax.bitcast_convert_type(q, jnp.uint32)
  return jax.lax.bitcast_convert_type(words, E4M3).reshape(g, k, n)


BLOCKS = [(64, 128, 4), (128, 128, 8), (64, 256, 8), (128, 64, 4), (32, 256, 4), (128, 256, 8)]
"""The Triton cast's (rows, cols, warps) blocks tried for the weights (fp8_quant.TRITON_BLOCK first)."""
RECAST = {"shipped": lambda w, s: fq.cast_experts(w, s, E4M3, impl="xla"), "words": _recast_words,
          **{f"triton_{b[0]}x{b[1]}w{b[2]}": functools.partial(lambda w, s, b: fq.cast_experts(w, s, E4M3, impl="triton",
                                                                                              block=b), b=b)
             for b in BLOCKS}}  # the kernel writing q alone


def scanned(per_layer, stacked, *extra):
  """per_layer over each layer's slice inside one scan; returns the stacked outputs."""
  def body(carry, xs):
    return carry, per_layer(*xs)
  return jax.lax.scan(body, 0, (stacked, *extra))[1]


def consume(q):
  """A few of q's values after a barrier: a kernel's operand is read whole (the dgrad GEMM reads all of
  w_q), and the barrier keeps XLA from computing only what a reduction of a few values needs."""
  q = jax.lax.optimization_barrier(q)
  return q[:, :1, :128].astype(jnp.float32).sum()


def maxtext_adamw() -> dict:
  """optax.adamw's settings as MaxText's base.yml sets them (adam_b1, adam_b2, adam_eps, adam_eps_root,
  adam_weight_decay), read from the installed MaxText."""
  import yaml  # pylint: disable=import-outside-toplevel
  from maxtext.utils import globals as maxtext_globals  # pylint: disable=import-outside-toplevel

  with open(os.path.join(maxtext_globals.MAXTEXT_CONFIGS_DIR, "base.yml"), encoding="utf-8") as fh:
    base = yaml.safe_load(fh)
  return {k: float(base[f"adam_{k}"]) for k in ("b1", "b2", "eps", "eps_root", "weight_decay")}


def refreshed_copies(w, impl: str):
  """The FP8 copies a kept-copies design would write after the update: per layer and expert the scales
  (L, G), w_q (L, G, K, N) and w_q^T (L, G, N, K), the forward's and the backward's numbers for these w."""
  layers, g, k, n = w.shape
  s = fq.group_scales(fq.weight_amax(w.reshape(layers * g, k, n)), E4M3)
  q, qt = fq.cast_transpose(w.reshape(layers * g, k, n), jnp.broadcast_to(s[:, None], (layers * g, k)), E4M3, impl)
  return s.reshape(layers, g), q.reshape(w.shape), qt.reshape(layers, g, n, k)


def differing_elements(got, want) -> int:
  """How many elements of `got` differ from `want` in their bits (0: bit-equal)."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape:
    return int(want.size)
  bits = f"u{got.dtype.itemsize}"
  return int(np.count_nonzero(got.view(bits) != want.view(bits)))


def persistent(w, iters: int) -> dict:
  """The `persistent` section (module docstring): per layer, ms of the update alone, of each refresh over
  it, of reading the stacked copies' slices in a scan, and of today's passes; with the bit-equality check."""
  layers = w.shape[0]
  tx = optax.adamw(1e-4, mu_dtype=w.dtype, **maxtext_adamw())
  grads = (jax.random.normal(jax.random.key(1), w.shape, jnp.float32) * 1e-3).astype(w.dtype)
  state = tx.init(w)

  def update(w, g, st):
    u, st = tx.update(g, st, w)
    return optax.apply_updates(w, u), st

  out = {"update_ms_per_layer": moe_layer.timed(jax.jit(update), w, grads, state, iters=iters) * 1e3 / layers}
  new_w = jax.jit(update)(w, grads, state)[0]
  today_s = jax.jit(lambda w: scanned(lambda x: fq.group_scales(fq.weight_amax(x), E4M3), w))(new_w)
  want_qt = jax.jit(lambda w, s: scanned(
      lambda x, y: fq.cast_transposed(x, jnp.broadcast_to(y[:, None], x.shape[:2]), E4M3), w[:2], s[:2]))(new_w, today_s)
  want_q = jax.jit(lambda w, s: scanned(lambda x, y: fq.cast_experts(x, y, E4M3), w[:2], s[:2]))(new_w, today_s)
  for impl in ("xla", "triton"):
    def step(w, g, st, impl=impl):
      new, st = update(w, g, st)
      return new, st, refreshed_copies(new, impl)

    ms = moe_layer.timed(jax.jit(step), w, grads, state, iters=iters) * 1e3 / layers
    s, q, qt = jax.jit(functools.partial(refreshed_copies, impl=impl))(new_w)
    differing = {name: differing_elements(a, b) for name, a, b in
                 (("scales", s, today_s), ("w_q", q[:2], want_q), ("w_q_t", qt[:2], want_qt))}
    out[f"refresh_{impl}"] = {"ms_per_layer": ms - out["update_ms_per_layer"],
                              "bitwise_equal_forward_and_backward": not any(differing.values()),
                              "differing_elements": differing}
  f = jax.jit(lambda q, qt: scanned(lambda x, y: consume(x) + consume(y), q, qt))  # the last refresh's copies
  out["slices_ms_per_layer"] = moe_layer.timed(f, q, qt, iters=iters) * 1e3 / layers
  return out


def plot(result: dict, png: str) -> bool:
  """ms per layer of every form, one group per pass (amax, recast, forward), then today's passes against
  kept copies' refresh plus slices (persistent)."""
  passes = [p for p in ("amax", "recast", "forward") if result.get(p)]
  labels = [f"{p}: {n}" for p in passes for n in result[p]]
  values = [result[p][n]["ms_per_layer"] for p in passes for n in result[p]]
  kept = result.get("persistent")
  if kept:
    labels += ["persistent: today", *(f"persistent: refresh_{i} + slices" for i in ("xla", "triton"))]
    values += [kept["today_ms_per_layer"], *(kept[f"refresh_{i}"]["ms_per_layer"] + kept["slices_ms_per_layer"]
                                             for i in ("xla", "triton"))]
  return plots.grouped_bars(png, labels, {"ms per layer": values},
                            "ms per layer", f"weights' FP8 passes, {result['device']}, (L, G, K, N) = {result['shape']}",
                            figsize=(12, 4.5), rotate=75)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--shape", default="32,7168,4096", help="G,K,N of one layer's weights (default: DeepSeek-V3's wi "
                      "as the 1-GPU proxy has it, 32 experts)")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--shipped-only", action="store_true", help="of each pass only the shipped form (what "
                      "`persistent` compares against), no other formulation")
  args = parser.parse_args()
  g, k, n = (int(v) for v in args.shape.split(","))
  layers = args.layers
  w = jax.random.normal(jax.random.key(0), (layers, g, k, n), jnp.bfloat16)
  w = w.at[1, 3, 5, 7].set(jnp.inf).at[2, 4].set(0)  # an inf expert (scale 1) and an all-zero expert
  nbytes = g * k * n * 2
  result = {"command": " ".join(["python", "bench/weight_quant.py", *sys.argv[1:]]),
            "device": jax.devices()[0].device_kind, "shape": [layers, g, k, n], "amax": {}, "recast": {}}
  os.makedirs(args.out, exist_ok=True)

  want = None
  forms = (lambda d: {"shipped": d["shipped"]}) if args.shipped_only else (lambda d: d)
  for name, fn in forms(AMAX).items():
    f = jax.jit(lambda w, fn=fn: scanned(fn, w))
    got = np.asarray(f(w))
    want = got if want is None else want
    ms = moe_layer.timed(f, w, iters=args.iters) * 1e3 / layers
    result["amax"][name] = {"ms_per_layer": ms, "tbps": nbytes / (ms * 1e-3) / 1e12,
                            "bitwise_equal_shipped": bool(np.array_equal(got, want, equal_nan=True))}
    print("amax", name, result["amax"][name], flush=True)

  scales = jax.jit(lambda w: scanned(lambda x: fq.group_scales(fq.weight_amax(x), E4M3), w))(w)

  ref = None
  for name, fn in forms(RECAST).items():
    f = jax.jit(lambda w, s, fn=fn: scanned(lambda x, y: consume(fn(x, y)), w, s))
    full = jax.jit(lambda w, s, fn=fn: scanned(fn, w[:2], s[:2]))  # the check: the first two layers' w_q
    got = np.asarray(full(w, scales).view(jnp.uint8))
    ref = got if ref is None else ref
    ms = moe_layer.timed(f, w, scales, iters=args.iters) * 1e3 / layers
    result["recast"][name] = {"ms_per_layer": ms, "tbps": nbytes * 1.5 / (ms * 1e-3) / 1e12,
                              "bitwise_equal_shipped": bool(np.array_equal(got, ref))}
    print("recast", name, result["recast"][name], flush=True)
  result["forward"] = {}
  variants = [(name, fn, None) for name, fn in forms(AMAX).items()]
  variants += [] if args.shipped_only else [(f"shipped_triton_{b[0]}x{b[1]}w{b[2]}", AMAX["shipped"], b)
                                            for b in BLOCKS[1:]]
  for name, fn, block in variants:
    def fwd(x, fn=fn, block=block):
      s = fq.group_scales(fn(x), E4M3)
      return consume(fq.cast_transposed(x, jnp.broadcast_to(s[:, None], x.shape[:2]), E4M3, block=block))
    f = jax.jit(lambda w, fwd=fwd: scanned(fwd, w))
    ms = moe_layer.timed(f, w, iters=args.iters) * 1e3 / layers
    result["forward"][name] = {"ms_per_layer": ms}
    print("forward", name, result["forward"][name], flush=True)
  kept = persistent(w, args.iters)
  kept["today_ms_per_layer"] = result["forward"]["shipped"]["ms_per_layer"] + result["recast"]["shipped"]["ms_per_layer"]
  for impl in ("xla", "triton"):
    kept[f"saving_{impl}_ms_per_layer"] = (kept["today_ms_per_layer"] - kept[f"refresh_{impl}"]["ms_per_layer"]
                                           - kept["slices_ms_per_layer"])
  result["persistent"] = kept
  print("persistent", kept, flush=True)
  with open(os.path.join(args.out, "weight_quant.json"), "w", encoding="utf-8") as fh:
    json.dump(result, fh, indent=1)
  plot(result, os.path.join(args.out, "weight_quant.png"))


if __name__ == "__main__":
  main()
