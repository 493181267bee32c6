"""Tile-config sweep of temoe's Mosaic GPU grouped GEMMs (temoe.moe.experts.mosaic_gemm) on one GPU.

In one process, per shape (dsv3: hidden 7168, expert ffn 2048, 32 experts, 8192 tokens top-8;
dsv3_ep8: 7168/2048, 8 experts, top-2; qwen3_30b_a3b: 2048/768, 128 experts, top-8), with a skewed
(Zipf-like) load padded to 128-row groups in a static dispatch buffer of tokens*top_k + experts*127
rows (rounded to 128; the rows past the groups are spare):

* the six FP8 GEMMs of the expert MLP (gate/up and down: forward, dgrad, wgrad) on pre-quantised
  operands, each under several TileConfigs: TFLOP/s (useful FLOPs: real routed rows only, not
  padding) and the relative error against float32 math on the same FP8 operand values (a broken
  config shows up here), plus, for the best config, the FP8 recipe's error against float32 on the
  bf16 originals;
* ceilings and comparators for each forward GEMM: TE 2.20's FP8 grouped_dense (current scaling,
  forward, and forward+backward, TE's quantisation included), TE dense FP8 (current scaling,
  quantisation included) and XLA's FP8 dot on pre-quantised operands (cuBLASLt) on the same
  real-rows x K x N problem;
* grouped_matmul end to end (quantisation included) with the sweep's best configs, forward and
  forward+backward; the bf16 path (temoe's kernels in bf16, and tokamax's mosaic ragged_dot).

Writes OUT/mosaic_gemm.json (incrementally) and OUT/mosaic_gemm.png.
  PYTHONPATH=$PWD/plugin python3 bench/mosaic_gemm.py --out bench/results [--shapes dsv3,...] [--quick]
  PYTHONPATH=$PWD/plugin python3 bench/mosaic_gemm.py --shapes dsv3 --scaling blockwise --variants --no-comparators
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import signal
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from temoe.moe.experts import fp8_block as fb
from temoe.moe.experts import fp8_quant as fq
from temoe.moe.experts import mosaic_gemm as mz

SHAPES = {
    "dsv3": dict(hidden=7168, ffn=2048, experts=32, tokens=8192, top_k=8),
    "dsv3_ep8": dict(hidden=7168, ffn=2048, experts=8, tokens=8192, top_k=2),
    "qwen3_30b_a3b": dict(hidden=2048, ffn=768, experts=128, tokens=8192, top_k=8),
    "small_dsv3": dict(hidden=1024, ffn=512, experts=32, tokens=8192, top_k=8),  # the small model's layer
    "gpt_oss_like": dict(hidden=2880, ffn=2880, experts=128, tokens=8192, top_k=4),  # dims of whole 64s, not 128s
    "smoke": dict(hidden=256, ffn=128, experts=4, tokens=256, top_k=2),  # first stage of a device call
    "smoke64": dict(hidden=192, ffn=192, experts=4, tokens=128, top_k=2),  # CPU test: whole 64s, not 128s
}
TC = mz.TileConfig
ROWS_CONFIGS = [
    TC(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=4),
    TC(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=8),
    TC(block_m=128, block_n=256, stages=3, compute_wgs=2, grid_block_n=4, epi_n=256),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=4),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=4, promote=4),
    TC(block_m=128, block_n=64, stages=6, compute_wgs=2, grid_block_n=8),
]
CONTRACT_CONFIGS = ROWS_CONFIGS[:2] + [
    TC(block_m=256, block_n=128, stages=4, compute_wgs=2, grid_block_n=4, epi_n=64),
] + ROWS_CONFIGS[3:]
# Blockwise (fp32 total beside the accumulator: a warpgroup's tile is at most 64 x 128); rows-form
# tiles sit inside one 128-wide weight-scale block. The same list serves the wgrad form.
BLOCKWISE_CONFIGS = [
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, overlap=True),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8),
    TC(block_m=128, block_n=128, stages=6, compute_wgs=2, grid_block_n=8, epi_n=64, overlap=True),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=4, overlap=True),
    TC(block_m=128, block_n=128, stages=4, compute_wgs=2, grid_block_n=8, overlap=True),
]
# --variants (blockwise): today's kernel (k-blocks in overlapped pairs, and wait-then-promote) against
# (a) the same with each k-block's first wgmma issued with scale-d = 0 (TileConfig.fresh: no zeroing of the
# fresh accumulator) and (b) DeepGEMM's structure: wait, then promote with B's scales per column from shared
# memory, read before the wait (col_scales), fresh accumulators, at 128, 160 and 192 columns (fp32 total and
# accumulator: 2 x block_n / 2 registers a thread of the 232 a consumer warpgroup gets); and the scales read
# from global memory into registers before each wgmma instead of through shared memory (gmem_scales: no
# proxy fence per k-block); (b) without fresh at 128 and 160 (its measure should fresh fail), and at 160 with a
# raster band of 4 column tiles.
BLOCKWISE_VARIANTS = [
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, overlap=True),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, overlap=True, fresh=True),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, fresh=True),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, fresh=True, col_scales=True),
    TC(block_m=128, block_n=160, stages=5, compute_wgs=2, grid_block_n=8, epi_n=32, fresh=True, col_scales=True),
    TC(block_m=128, block_n=160, stages=4, compute_wgs=2, grid_block_n=8, epi_n=160, fresh=True, col_scales=True),
    TC(block_m=128, block_n=192, stages=4, compute_wgs=2, grid_block_n=8, epi_n=64, fresh=True, col_scales=True),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, fresh=True, gmem_scales=True),
    TC(block_m=128, block_n=160, stages=5, compute_wgs=2, grid_block_n=8, epi_n=32, fresh=True, col_scales=True,
       gmem_scales=True),
    TC(block_m=128, block_n=192, stages=4, compute_wgs=2, grid_block_n=8, epi_n=64, fresh=True, col_scales=True,
       gmem_scales=True),
    TC(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, col_scales=True),  # (b) without fresh
    TC(block_m=128, block_n=160, stages=5, compute_wgs=2, grid_block_n=8, epi_n=32, col_scales=True),
    TC(block_m=128, block_n=160, stages=5, compute_wgs=2, grid_block_n=4, epi_n=32, fresh=True, col_scales=True),
]
# bf16 ("none"): a 128-byte k-block is 64 elements, so a stage holds half the FP8 contraction; the
# short-K shapes (the small model's 1024 / 512) have few k-blocks per tile, so smaller and deeper
# tiles are in the list beside the FP8 default's 128 x 256 (at most 4 stages of 128 x 256 and 6 of
# 128 x 128 fit the 227 KiB of shared memory with the epilogue's buffer).
BF16_CONFIGS = [
    TC(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=4),
    TC(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=8),
    TC(block_m=128, block_n=256, stages=3, compute_wgs=2, grid_block_n=4, epi_n=256),
    TC(block_m=128, block_n=128, stages=6, compute_wgs=2, grid_block_n=4),
    TC(block_m=128, block_n=128, stages=6, compute_wgs=2, grid_block_n=8),
    TC(block_m=128, block_n=128, stages=6, compute_wgs=2, grid_block_n=16),
    TC(block_m=256, block_n=128, stages=4, compute_wgs=2, grid_block_n=4, epi_n=64),
    TC(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=2),
    TC(block_m=128, block_n=64, stages=8, compute_wgs=2, grid_block_n=8),
    TC(block_m=64, block_n=256, stages=4, compute_wgs=1, grid_block_n=4),
]
QUICK = 3  # --quick: first configs of each list only


def skewed_counts(seed: int, tokens: int, experts: int, top_k: int, skew: float = 1.2) -> np.ndarray:
  """Routed rows per expert: top-k distinct experts per token from a Zipf-like popularity."""
  key = jax.random.key(seed)
  logits = -skew * jnp.log1p(jnp.arange(experts, dtype=jnp.float32))
  _, ids = jax.lax.top_k(logits + jax.random.gumbel(key, (tokens, experts)), top_k)
  return np.bincount(np.asarray(ids).reshape(-1), minlength=experts)


def timed_in_rounds(calls: list, iters: int = 10, reps: int = 3) -> list[float]:
  """Seconds per call of each (fn, args) in `calls`: the best of `reps` rounds, each round a batch of
  `iters` back-to-back calls of every fn in turn. In turns, no fn is the one timed first after the GPU
  sat idle (compiling): timed one after another, the first of a sweep ran up to 7% slower than the same
  kernel timed next (bench/results/mosaic_gemm.classes.json: configs whose tile orders are identical)."""
  for fn, args in calls:
    jax.block_until_ready(fn(*args))
  best = [float("inf")] * len(calls)
  for _ in range(reps):
    for i, (fn, args) in enumerate(calls):
      t0 = time.perf_counter()
      for _ in range(iters):
        out = fn(*args)
      jax.block_until_ready(out)
      best[i] = min(best[i], (time.perf_counter() - t0) / iters)
  return best


def timed(fn, *args, iters: int = 10, reps: int = 3) -> float:
  """Seconds per call: the best of `reps` back-to-back batches of `iters` calls."""
  return timed_in_rounds([(fn, args)], iters, reps)[0]


def err_line(exc: BaseException) -> str:
  lines = [l for l in str(exc).splitlines() if l.strip()]
  return f"{type(exc).__name__}: {(lines[0] if lines else '')[:400]}"


def rel(a, ref, rows=None) -> float:
  a, ref = a.astype(jnp.float32), ref.astype(jnp.float32)
  if rows is not None:
    a, ref = a[:rows], ref[:rows]
  return float(jnp.linalg.norm(a - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


# ---------------------------------------------------------------------------------- references


@jax.jit
def ref_rows(a, b, tile_group):
  """float32 a[rows of g] @ b[g]^T (a (M, C), b (G, Nout, C), both float32 values as the kernel
  sees them, scales applied), one 128-row tile at a time."""
  t = tile_group.shape[0]
  a_t = a.reshape(t, -1, a.shape[1])

  def one(args):
    at, g = args
    gg = jnp.maximum(g, 0)
    y = jnp.dot(at, b[gg].T, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(g >= 0, y, 0.0)

  return jax.lax.map(one, (a_t, tile_group), batch_size=8).reshape(a.shape[0], -1)


@jax.jit
def ref_contract(a, b, group_sizes):
  """float32 a[:, tokens of g] @ b[:, tokens of g]^T; a (Mout, T), b (Nout, T) float32 values."""
  ends = jnp.cumsum(group_sizes)
  tok = jnp.arange(a.shape[1])

  def one(g):
    mask = (tok >= ends[g] - group_sizes[g]) & (tok < ends[g])
    return jnp.dot(jnp.where(mask[None, :], a, 0), b.T, precision=jax.lax.Precision.HIGHEST)

  return jax.lax.map(one, jnp.arange(group_sizes.shape[0]))


# ---------------------------------------------------------------------------------- problem


@dataclasses.dataclass
class Problem:
  name: str
  hidden: int
  ffn: int
  experts: int
  rows: int  # dispatch buffer rows
  real: int  # routed rows (useful)
  counts: np.ndarray
  sizes: jax.Array  # padded group sizes


def make_problem(name: str, seed: int = 0) -> Problem:
  s = SHAPES[name]
  counts = skewed_counts(seed, s["tokens"], s["experts"], s["top_k"])
  padded = -(-counts // mz.ROW_ALIGNMENT) * mz.ROW_ALIGNMENT
  rows = -(-(s["tokens"] * s["top_k"] + s["experts"] * (mz.ROW_ALIGNMENT - 1)) // mz.ROW_ALIGNMENT) * mz.ROW_ALIGNMENT
  return Problem(name, s["hidden"], s["ffn"], s["experts"], rows, int(counts.sum()), counts, jnp.asarray(padded, jnp.int32))


def real_rows_mask(p: Problem) -> jax.Array:
  ends = np.cumsum(np.asarray(p.sizes))
  starts = ends - np.asarray(p.sizes)
  mask = np.zeros(p.rows, bool)
  for s, c in zip(starts, p.counts):
    mask[s:s + c] = True
  return jnp.asarray(mask)


def operands(p: Problem, key):
  """bf16 activations/gradients (zero off the real rows) and weights of the expert MLP."""
  mask = real_rows_mask(p)[:, None]
  ks = jax.random.split(key, 5)
  h, f, g = p.hidden, p.ffn, p.experts
  x = jnp.where(mask, jax.random.normal(ks[0], (p.rows, h)), 0).astype(jnp.bfloat16)
  act = jnp.where(mask, jax.random.normal(ks[1], (p.rows, f)), 0).astype(jnp.bfloat16)
  wi = (jax.random.normal(ks[2], (g, h, 2 * f)) * h**-0.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(ks[3], (g, f, h)) * f**-0.5).astype(jnp.bfloat16)
  dy_up = jnp.where(mask, jax.random.normal(ks[4], (p.rows, 2 * f)), 0).astype(jnp.bfloat16)
  dy_down = jnp.where(mask, jax.random.normal(jax.random.fold_in(key, 9), (p.rows, h)), 0).astype(jnp.bfloat16)
  return dict(x=x, act=act, wi=wi, wo=wo, dy_up=dy_up, dy_down=dy_down)


def _quantized(p: Problem, ops, scaling: str):
  """Per operand: (kernel operand, its scale argument, its float32 value as the kernel sees it).

  Rows operands (x, act, dy_up, dy_down) in both layouts; weights in both layouts. "current":
  per-expert scales (fp8_quant); "blockwise": DeepSeek-V3's block scales (fp8_block)."""
  f32 = lambda a: a.astype(jnp.float32)
  tiles = mz.tile_groups(p.sizes, p.rows // mz.ROW_ALIGNMENT, mz.ROW_ALIGNMENT)
  rg = jnp.repeat(jnp.clip(tiles, 0, p.experts - 1), mz.ROW_ALIGNMENT)
  out = {}
  if scaling == "none":  # bf16: the operands as they are, in the layouts grouped_matmul passes
    for name in ("x", "act", "dy_up", "dy_down", "wi", "wo"):
      out[name] = (ops[name], None, f32(ops[name]))
    return out
  # grouped_matmul's FP8 copies: padded to copy_dim (whole 128s for both FP8 scalings)
  ops = {k: mz.pad_to(v, (*v.shape[:-2], *(mz.copy_dim(d, scaling) if i or v.ndim == 3 else d
                                           for i, d in enumerate(v.shape[-2:]))))
         for k, v in ops.items()}
  for name in ("x", "act", "dy_up", "dy_down"):
    if scaling == "current":
      dtype = mz.E5M2 if name.startswith("dy") else mz.E4M3
      q, qt, s = jax.jit(fq.quantize_rows, static_argnums=(2, 3))(ops[name], tiles, p.experts, dtype)
      v = f32(q) / s[rg][:, None]
      out[name] = (q, s, v)
      out[name + "^T"] = (qt, s, v.T)
    else:
      q, s, qt, st = jax.jit(fb.quantize_both)(ops[name])
      out[name] = (q, s, fb.dequantize_rows(q, s))
      out[name + "^T"] = (qt, st, fb.dequantize_rows(qt, st))
  for name in ("wi", "wo"):
    if scaling == "current":
      q, qt, s = jax.jit(fq.quantize_experts, static_argnums=1)(ops[name], mz.E4M3)
      v = f32(q) / s[:, None, None]
    else:
      q, qt, s = jax.jit(fb.quantize_weights)(ops[name])
      v = fb.dequantize_weights(q, s)
    out[name] = (q, s, v)  # (G, K, N): dgrad's b (Nout = K, C = N)
    out[name + "^T"] = (qt, s, jnp.swapaxes(v, 1, 2))  # (G, N, K): the forward's b
  return out


def gemm_specs(p: Problem, ops, scaling: str = "current"):
  """The six GEMMs: name -> (form, a, b, scale kwargs, flops, float32 operand values (a, b) as the
  reference takes them, bf16 originals (a, b) for the recipe error, static layout kwargs)."""
  q = _quantized(p, ops, scaling)
  tr = jax.jit(lambda a: jnp.swapaxes(a, -1, -2))
  r, h, f = p.real, p.hidden, p.ffn
  if scaling == "none":
    return _bf16_specs(q, tr, r, h, f)

  def spec(form, a, b, flops, orig):
    qa, sa, va = q[a]
    qb, sb, vb = q[b]
    if scaling == "blockwise":
      if b in ("wi", "wo"):  # dgrad reads w as stored: its weight block is (C block, Nout block) swapped
        sb = jnp.swapaxes(sb, 1, 2)
      kw = {"block_scales": (sa, sb)}
    elif form == "rows":
      kw = {"scales": 1.0 / (sa * sb)}
    else:
      kw = {"scales": 1.0 / (sa * sb)}
    return (form, qa, qb, kw, flops, (va, vb), orig, {})

  return {
      "gateup_fwd": spec("rows", "x", "wi^T", 2 * r * h * 2 * f, (ops["x"], tr(ops["wi"]))),
      "down_fwd": spec("rows", "act", "wo^T", 2 * r * f * h, (ops["act"], tr(ops["wo"]))),
      "gateup_dgrad": spec("rows", "dy_up", "wi", 2 * r * 2 * f * h, (ops["dy_up"], ops["wi"])),
      "down_dgrad": spec("rows", "dy_down", "wo", 2 * r * h * f, (ops["dy_down"], ops["wo"])),
      "gateup_wgrad": spec("contract", "x^T", "dy_up^T", 2 * r * h * 2 * f, (tr(ops["x"]), tr(ops["dy_up"]))),
      "down_wgrad": spec("contract", "act^T", "dy_down^T", 2 * r * f * h, (tr(ops["act"]), tr(ops["dy_down"]))),
  }


def _bf16_specs(q, tr, r, h, f):
  """The six bf16 GEMMs in the layouts grouped_matmul(scaling="none") passes: the weights as stored
  (G, K, N) in the forward (b_contract_minor=False) and dgrad, token-major x and dy in wgrad."""
  def spec(form, a, b, flops, ref_a, ref_b, static):  # bf16 is its own original: the same values twice
    return (form, q[a][0], q[b][0], {}, flops, (ref_a, ref_b), (ref_a, ref_b), static)

  v = {k: q[k][2] for k in q}
  return {
      "gateup_fwd": spec("rows", "x", "wi", 2 * r * h * 2 * f, v["x"], tr(v["wi"]), {"b_contract_minor": False}),
      "down_fwd": spec("rows", "act", "wo", 2 * r * f * h, v["act"], tr(v["wo"]), {"b_contract_minor": False}),
      "gateup_dgrad": spec("rows", "dy_up", "wi", 2 * r * 2 * f * h, v["dy_up"], v["wi"], {}),
      "down_dgrad": spec("rows", "dy_down", "wo", 2 * r * h * f, v["dy_down"], v["wo"], {}),
      "gateup_wgrad": spec("contract", "x", "dy_up", 2 * r * h * 2 * f, tr(v["x"]), tr(v["dy_up"]),
                           {"a_contract_minor": False, "b_contract_minor": False}),
      "down_wgrad": spec("contract", "act", "dy_down", 2 * r * f * h, tr(v["act"]), tr(v["dy_down"]),
                         {"a_contract_minor": False, "b_contract_minor": False}),
  }


def kernel_fn(form, cfg, sizes, kw_names, static=None):
  static = static or {}
  if form == "rows":
    return lambda a, b, *kw: mz.ragged_rows_matmul(a, b, sizes, config=cfg, **static, **_kwargs(kw_names, kw))
  return lambda a, b, *kw: mz.ragged_contract_matmul(a, b, sizes, config=cfg, **static, **_kwargs(kw_names, kw))


def _kwargs(names, values):
  out = {}
  for name, v in zip(names, values):
    if name == "block_scales":
      out[name] = tuple(v)
    else:
      out[name] = v
  return out


def reference(form, a, b, sizes, block_m=128):
  if form == "rows":
    return ref_rows(a, b, mz.tile_groups(sizes, a.shape[0] // block_m, block_m))
  return ref_contract(a, b, sizes)


def gemm_dims(form, a, b, static):
  """(output rows or None, output columns, contraction) of one GEMM's operands, as the kernels read them."""
  if form == "rows":
    return None, (b.shape[1] if static.get("b_contract_minor", True) else b.shape[2]), a.shape[1]
  m_out = a.shape[0] if static.get("a_contract_minor", True) else a.shape[1]
  n_out, t = b.shape if static.get("b_contract_minor", True) else b.shape[::-1]
  return m_out, n_out, t


def with_default(configs, form, scaling, a, b, static):
  """The configs to sweep for one GEMM: grouped_matmul's default for it first, then the list's, each
  current-scaling config over a contraction of whole 64s but not 128s (an unpadded copy, only where one is
  passed explicitly: grouped_matmul pads to 128s) in 64-element k-blocks, twice the stages."""
  m_out, n_out, contract = gemm_dims(form, a, b, static)
  out = [mz.default_config(form, scaling, n_out, m_out, contract)]
  for cfg in configs:
    cfg = mz.for_contraction(cfg, scaling, contract)
    if cfg not in out:
      out.append(cfg)
  return out


def sweep_gemm(name, spec, p: Problem, configs, pool, scaling="current"):
  form, a, b, kw, flops, values, originals, static = spec
  names, vals = list(kw), [kw[k] for k in kw]
  configs = with_default(configs, form, scaling, a, b, static)
  out = {"flops": flops, "form": form, "default": configs[0].name(), "configs": []}
  ref = reference(form, values[0], values[1], p.sizes)
  lowered = []
  for cfg in configs:
    try:
      lowered.append((cfg, jax.jit(kernel_fn(form, cfg, p.sizes, names, static)).lower(a, b, *vals)))
    except Exception as exc:  # pylint: disable=broad-exception-caught
      out["configs"].append({"config": cfg.name(), "fields": dataclasses.asdict(cfg), "error": err_line(exc)})
  compiled = list(pool.map(lambda cl: _try(lambda: cl[1].compile()), lowered))
  checked = []  # (cfg, rec, compiled) of the configs that ran: checked first, then timed in rounds
  for (cfg, _), comp in zip(lowered, compiled):
    rec = {"config": cfg.name(), "fields": dataclasses.asdict(cfg)}
    try:
      if isinstance(comp, BaseException):
        raise comp
      y = comp(a, b, *vals)
      rec["finite"] = bool(jnp.isfinite(y.astype(jnp.float32)).all())
      if form == "rows":
        rec["spare_rows_zero"] = bool((y[int(p.sizes.sum()):] == 0).all())
      else:
        rec["empty_experts_zero"] = bool((y[np.asarray(p.sizes) == 0] == 0).all())
      rec["rel_err_same_operands"] = rel(y, ref)
      del y
      checked.append((cfg, rec, comp))
    except Exception as exc:  # pylint: disable=broad-exception-caught
      rec["error"] = err_line(exc)
    out["configs"].append(rec)
  try:
    secs = timed_in_rounds([(comp, (a, b, *vals)) for _, _, comp in checked])
  except Exception as exc:  # pylint: disable=broad-exception-caught
    secs = [None] * len(checked)
    for _, rec, _ in checked:
      rec["error"] = err_line(exc)
  best = None
  for (cfg, rec, comp), sec in zip(checked, secs):
    if sec is None:
      continue
    rec["ms"] = sec * 1e3
    rec["tflops"] = flops / sec / 1e12
    ok = rec["finite"] and rec["rel_err_same_operands"] < 1e-2 and rec.get("spare_rows_zero", True) \
        and rec.get("empty_experts_zero", True)
    rec["ok"] = ok
    if ok and (best is None or rec["tflops"] > best[1]["tflops"]):
      best = (cfg, rec, comp)
  for rec in out["configs"]:
    print(f"  {name} {rec['config']}: " + (f"{rec['tflops']:.0f} TFLOP/s, err {rec['rel_err_same_operands']:.1e}"
                                            if "tflops" in rec else rec.get("error", "?")), flush=True)
  del ref
  if best is not None:
    out["best"] = {"config": best[0].name(), "fields": dataclasses.asdict(best[0]), "tflops": best[1]["tflops"],
                   "ms": best[1]["ms"]}
    # the recipe's error: the best config's output against float32 on the bf16 originals
    try:
      y = best[2](a, b, *vals)  # the executable checked and timed above, not compiled again
      f32 = lambda v: v.astype(jnp.float32)
      ref0 = reference(form, *(mz.pad_to(f32(o), v.shape) for o, v in zip(originals, values)), p.sizes)
      out["best"]["recipe_rel_err_vs_bf16"] = rel(y, ref0)
      del y, ref0
    except Exception as exc:  # pylint: disable=broad-exception-caught
      out["best"]["recipe_error"] = err_line(exc)
  return out, (best[0] if best else None)


def _try(fn):
  try:
    return fn()
  except Exception as exc:  # pylint: disable=broad-exception-caught
    return exc


# ---------------------------------------------------------------------------------- comparators


def te_grouped(x, w, sizes, fp8=True):
  from transformer_engine.jax.dense import grouped_dense  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode  # pylint: disable=import-outside-toplevel

  qs = QuantizerFactory.create_set(
      scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, fwd_dtype=jnp.float8_e4m3fn, bwd_dtype=jnp.float8_e5m2,
      n_groups=w.shape[0],
  )
  covering = sizes.at[-1].add(x.shape[0] - jnp.sum(sizes))  # TE's FP8 path needs sum == rows
  return grouped_dense(x, w, covering, contracting_dims=((1,), (1,)), preferred_element_type=jnp.bfloat16,
                       quantizer_set=qs)


def te_dense(x, w):
  from transformer_engine.jax.dense import dense  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode  # pylint: disable=import-outside-toplevel

  qs = QuantizerFactory.create_set(
      scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, fwd_dtype=jnp.float8_e4m3fn, bwd_dtype=jnp.float8_e5m2
  )
  return dense(x, w, contracting_dims=((1,), (0,)), quantizer_set=qs)


def fwd_and_fwdbwd(matmul, x, w, sizes, cot):
  fwd = jax.jit(lambda x, w: matmul(x, w, sizes))

  def loss(x, w):
    return jnp.sum(matmul(x, w, sizes).astype(jnp.float32) * cot)

  return fwd, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def comparators(p: Problem, ops, best_cfgs, skip_te: bool, save=lambda res: None, only=(), scaling="current"):
  """Per forward GEMM: TE grouped FP8, dense ceilings, grouped_matmul end to end, bf16 paths."""
  res = {}
  r = p.real
  for gemm, x, w, cot in (("gateup", ops["x"], ops["wi"], ops["dy_up"]), ("down", ops["act"], ops["wo"], ops["dy_down"])):
    k, n = w.shape[1], w.shape[2]
    flops = 2 * r * k * n
    rec = {"flops_fwd": flops, "flops_fwdbwd": 3 * flops}
    cot = cot.astype(jnp.float32)
    cfgs = mz.GemmConfigs(best_cfgs.get(f"{gemm}_fwd"), best_cfgs.get(f"{gemm}_dgrad"), best_cfgs.get(f"{gemm}_wgrad"))
    paths = {
        f"mosaic_{scaling}": lambda x, w, s: mz.grouped_matmul(x, w, s, scaling=scaling, configs=cfgs),
        "mosaic_bf16": lambda x, w, s: mz.grouped_matmul(x, w, s, scaling="none"),
    }
    if not skip_te:
      paths["te_grouped_fp8"] = te_grouped
    try:
      import tokamax  # pylint: disable=import-outside-toplevel

      paths["tokamax_bf16"] = lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation="mosaic")
    except Exception as exc:  # pylint: disable=broad-exception-caught
      rec["tokamax_bf16_error"] = err_line(exc)
    for name, mm in paths.items():
      if only and name not in only:
        continue
      t0 = time.time()
      try:
        fwd, fb = fwd_and_fwdbwd(mm, x, w, p.sizes, cot)
        rec[f"{name}_fwd_tflops"] = flops / timed(fwd, x, w) / 1e12
        rec[f"{name}_fwdbwd_tflops"] = 3 * flops / timed(fb, x, w) / 1e12
      except Exception as exc:  # pylint: disable=broad-exception-caught
        rec[f"{name}_error"] = err_line(exc)
      rec[f"{name}_wall_s"] = time.time() - t0  # compile + timing: what a device call spends here
      save({**res, gemm: rec})
      print(f"  {gemm} {name}: " + ", ".join(f"{k2} {v:.0f}" if isinstance(v, float) else f"{k2} {v}"
                                            for k2, v in rec.items() if k2.startswith(name)), flush=True)
    # dense ceilings on the real rows
    xd, wd = x[:r], w[0]
    try:
      xq = xd.astype(mz.E4M3)
      wqt = wd.T.astype(mz.E4M3)
      dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16))
      rec["xla_dense_fp8_prequantized_tflops"] = flops / timed(dot, xq, wqt) / 1e12
    except Exception as exc:  # pylint: disable=broad-exception-caught
      rec["xla_dense_fp8_error"] = err_line(exc)
    if not skip_te:
      try:
        rec["te_dense_fp8_fwd_tflops"] = flops / timed(jax.jit(te_dense), xd, wd) / 1e12
      except Exception as exc:  # pylint: disable=broad-exception-caught
        rec["te_dense_fp8_error"] = err_line(exc)
    print(f"  {gemm} dense: " + ", ".join(f"{k2} {v:.0f}" for k2, v in rec.items() if "dense" in k2 and isinstance(v, float)),
          flush=True)
    res[gemm] = rec
    save(res)
  return res


# ---------------------------------------------------------------------------------- main


def plot(result, path):
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  shapes = [s for s in result["shapes"] if result["shapes"][s].get("gemms")]
  if not shapes:
    return
  fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
  for ax, s in zip(axes[0], shapes):
    gemms = result["shapes"][s]["gemms"]
    names = list(gemms)
    best = [gemms[g].get("best", {}).get("tflops", 0) for g in names]
    ax.bar(range(len(names)), best, color="#76b900", label="temoe mosaic FP8 (best config)")
    comp = result["shapes"][s].get("comparators", {})
    for i, g in enumerate(names):
      base = g.split("_")[0]
      c = comp.get(base, {})
      if g.endswith("_fwd"):
        for key, color, lab in (("te_grouped_fp8_fwd_tflops", "#1f77b4", "TE grouped_dense FP8 fwd (incl. quant)"),
                                ("xla_dense_fp8_prequantized_tflops", "#d62728", "dense FP8 GEMM (cuBLASLt)"),
                                ("te_dense_fp8_fwd_tflops", "#9467bd", "TE dense FP8 fwd (incl. quant)")):
          if key in c:
            ax.plot([i - 0.4, i + 0.4], [c[key]] * 2, color=color, lw=2, label=lab if i == 0 else None)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s (useful)")
    ax.set_title(s)
    ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--shapes", default="dsv3,dsv3_ep8,qwen3_30b_a3b")
  parser.add_argument("--gemms", default="gateup_fwd,down_fwd,gateup_dgrad,down_dgrad,gateup_wgrad,down_wgrad")
  parser.add_argument("--scaling", default="current", choices=("current", "blockwise", "none"),
                      help="the recipe swept: FP8 per-expert current scaling, DeepSeek-V3's block scales, or bf16 (none)")
  parser.add_argument("--quick", action="store_true", help=f"first {QUICK} configs per GEMM only")
  parser.add_argument("--max-configs", type=int, default=None, help="first N configs per GEMM only")
  parser.add_argument("--configs", default="", help="comma list of TileConfig names (TileConfig.name()) to keep")
  parser.add_argument("--variants", action="store_true",
                      help="with --scaling blockwise: sweep BLOCKWISE_VARIANTS (today's kernel, fresh, col_scales)")
  parser.add_argument("--no-comparators", action="store_true")
  parser.add_argument("--skip-te", action="store_true")
  parser.add_argument("--comparators", default="", help="comma list: mosaic_fp8,mosaic_bf16,te_grouped_fp8,"
                      "tokamax_bf16 (default: all; the dense ceilings always run)")
  parser.add_argument("--interpret", action="store_true", help="CPU plumbing check: GPU interpret mode, 2 'SMs'")
  parser.add_argument("--plot-only", metavar="JSON", help="redraw the PNG of an existing mosaic_gemm.json")
  args = parser.parse_args()
  if args.variants and args.scaling != "blockwise":
    parser.error("--variants sweeps the block-scaled kernels' options: add --scaling blockwise")
  if args.plot_only:
    with open(args.plot_only, encoding="utf-8") as f:
      plot(json.load(f), os.path.join(os.path.dirname(args.plot_only), "mosaic_gemm.png"))
    return
  if args.interpret:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

    plgpu.set_gpu_interpret_mode(plgpu.InterpretGPUParams())
    mz.num_sms = lambda: 2
  out_dir = args.out[:-len("mosaic_gemm.json")] if args.out.endswith("mosaic_gemm.json") else args.out
  os.makedirs(out_dir or ".", exist_ok=True)
  json_path = os.path.join(out_dir, "mosaic_gemm.json")
  dev = jax.devices()[0]
  result = {
      "command": " ".join(["python3", "bench/mosaic_gemm.py", *sys.argv[1:]]),
      "device": dev.device_kind,
      "num_sms": mz.num_sms(),
      "jax": jax.__version__,
      "timing": "best of 3 rounds, each a batch of 10 back-to-back calls of every config in turn (wall clock, after a warm-up call of each)",
      "shapes": {},
  }
  pool = concurrent.futures.ThreadPoolExecutor(8)
  t_start = time.time()

  def on_term(*_):
    raise KeyboardInterrupt("SIGTERM")

  signal.signal(signal.SIGTERM, on_term)
  try:
    run_shapes(args, result, json_path, pool, t_start)
  except KeyboardInterrupt as exc:
    result["interrupted"] = f"{exc} after {time.time() - t_start:.0f} s"
    print("interrupted:", result["interrupted"], flush=True)
  result["elapsed_s"] = time.time() - t_start
  with open(json_path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  plot(result, os.path.join(out_dir, "mosaic_gemm.png"))
  summary = {s: {g: v.get("best", {}).get("tflops") for g, v in r["gemms"].items()} for s, r in result["shapes"].items()}
  print(json.dumps(summary, indent=1))


def run_shapes(args, result, json_path, pool, t_start):
  for s in args.shapes.split(","):
    p = make_problem(s)
    sres = {
        "dims": SHAPES[s], "buffer_rows": p.rows, "real_rows": p.real, "loads": p.counts.tolist(),
        "load_max_over_mean": float(p.counts.max() / p.counts.mean()), "empty_experts": int((p.counts == 0).sum()),
        "gemms": {},
    }
    result["shapes"][s] = sres
    print(f"{s}: rows {p.rows} (real {p.real}), load max/mean {sres['load_max_over_mean']:.2f}", flush=True)
    ops = operands(p, jax.random.key(1))
    specs = gemm_specs(p, ops, args.scaling)
    best_cfgs = {}
    for g in [g for g in args.gemms.split(",") if g and g != "none"]:
      form = specs[g][0]
      if args.scaling == "blockwise":
        configs = BLOCKWISE_VARIANTS if args.variants else BLOCKWISE_CONFIGS
      elif args.scaling == "none":
        configs = BF16_CONFIGS
      else:
        configs = ROWS_CONFIGS if form == "rows" else CONTRACT_CONFIGS
      configs = configs[:QUICK] if args.quick else configs
      configs = configs[:args.max_configs] if args.max_configs else configs
      if args.configs:
        configs = [c for c in configs if c.name() in args.configs.split(",")]
      try:
        sres["gemms"][g], best_cfgs[g] = sweep_gemm(g, specs[g], p, configs, pool, args.scaling)
      except Exception as exc:  # pylint: disable=broad-exception-caught
        sres["gemms"][g] = {"error": err_line(exc), "traceback": traceback.format_exc()[-2000:]}
      with open(json_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    del specs
    if not args.no_comparators:
      def save(res, sres=sres):
        sres["comparators"] = res
        with open(json_path, "w", encoding="utf-8") as f:
          json.dump(result, f, indent=1)

      only = tuple(c for c in args.comparators.split(",") if c)
      sres["comparators"] = comparators(p, ops, best_cfgs, args.skip_te, save, only, args.scaling)
    result["elapsed_s"] = time.time() - t_start
    with open(json_path, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
    del ops


if __name__ == "__main__":
  main()
