"""temoe's own sync-free grouped GEMMs for Hopper (sm_90), in JAX Pallas Mosaic GPU: FP8 and bf16.

Group sizes never leave the GPU: one kernel launch per GEMM, static shapes, no host callback, no
per-expert launches (TE 2.20's FP8 `grouped_dense` copies group sizes to the host and launches one
cuBLAS GEMM per expert). Public API:

* `ROW_ALIGNMENT`: expert groups must be padded (with zero rows) to multiples of this; the rows past
  sum(group_sizes) are spare and come back exactly zero (and get exactly zero dx).
* `grouped_matmul(x, w, group_sizes, fp8=...)`: rows of group g times w[g], with a custom VJP
  (FP8: E4M3 forward, E5M2 gradient, current scaling per expert, fp32 epilogue, bf16 outputs).
* `TileConfig` / `GemmConfigs` / `default_config`: tile shapes, the sweep's defaults per GEMM, and a
  way to pass them explicitly (bench/mosaic_gemm.py).
* `check_shapes(k, n, scaling)`: config-time check; raises a one-line ValueError when K or N cannot
  run (bf16: multiples of 64; FP8: multiples of 16, the quantized copies padded where needed:
  `copy_dim`; the outputs written at the true dims where those are whole 128-byte rows: `out_dim`).
* `ragged_rows_matmul` / `ragged_contract_matmul`: the two kernels (forward & dgrad form; wgrad
  form), exposed for tests and the benchmark.

Kernel: a persistent, warp-specialised grid over the SMs the device reports. Each CTA has one TMA
producer warpgroup and `compute_wgs` wgmma warpgroups (each owns block_m / compute_wgs rows of the
block_m x block_n output tile). The producer runs one continuous multi-stage ring over the CTA's
whole tile sequence, so the next tile's loads overlap the current tile's epilogue (fp32 accumulator
-> per-group scale -> out dtype -> SMEM -> TMA store). FP8 wgmma needs the contraction dim
contiguous for both operands, so every FP8 GEMM is "A (rows, C) x B (cols, C)^T": forward reads an
FP8 copy of w^T (G, N, K), dgrad reads w (G, K, N) as stored, wgrad reads FP8 copies of x^T (K, M)
and dy^T (N, M); `fp8_quant` casts each operand once into both layouts. bf16 uses the stored layouts
directly (16-bit operands may be transposed in SMEM), so the bf16 path needs no transposes.

Scheduling (plain functions, unit-tested on CPU): `tile_groups` maps each block_m row tile to its
expert (-1 = spare rows: the tile skips the K loop and stores zeros); `contraction_schedule` gives
each expert's first token block and block count for wgrad (an empty expert's tiles store zeros) and
orders experts largest-first so the round-robin over SMs starts with the longest tiles;
`tile_coords` rasters output tiles in bands of `grid_block_n` column tiles for L2 reuse. Tile i of
the grid is handled by SM i % num_sms.

FP8 scaling (`fp8_quant`): per-expert current scaling for x, w and dy (amax on device each call). The kernels
know every tile's expert, so per-expert scales fold into the fp32 epilogue for free (one multiply
by 1 / (s_a[g] * s_b[g])); the amax pass costs the same as a per-tensor one; and an expert whose
activations or weights are smaller than the largest expert's keeps the full FP8 range instead of
sliding into subnormals. Optionally (`TileConfig.promote`) the wgmma accumulator is flushed into a
separate fp32 register sum every `promote` k-blocks (Hopper's FP8 wgmma accumulates with reduced
precision over long K); the sweep measures what it costs.

CPU: Pallas Mosaic GPU kernels do run in GPU interpret mode on CPU in JAX 0.11.2
(`plgpu.force_gpu_interpret_mode`), so tests/unit/test_mosaic_schedule.py runs these kernels on tiny
shapes there (slowly; performance only on the GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from temoe import recipes
from temoe.moe.experts import fp8_block, fp8_quant, parts, wgmma_fresh

ROW_ALIGNMENT = 128  # groups padded to multiples of this; tiles never straddle two experts

E4M3 = fp8_quant.E4M3
E5M2 = fp8_quant.E5M2
_FP8 = (jnp.dtype(E4M3), jnp.dtype(E5M2))
_SMEM_BYTES = 227 * 1024
_SWIZZLE = 128  # bytes: the default k-block row (128 FP8 / 64 bf16 elements)
SWIZZLES = (64, 128)  # a k-block's row in bytes: one swizzle tile per stage (64: half the contraction per stage)


# ----------------------------------------------------------------------------------------------
# Tile configuration


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """One kernel's tile shape. block_m x block_n is the CTA's output tile; compute_wgs wgmma
  warpgroups split its rows (each owns block_m // compute_wgs rows, a multiple of 64); block_k is
  the contraction per pipeline stage, 128 or 64 bytes of the operand dtype (None: 128; 64 lets FP8
  contract over an unpadded copy of whole 64s, at half the work per stage: for_contraction); stages is the depth of
  the TMA ring; grid_block_n the raster band width in column tiles; epi_n the epilogue's column
  chunk (None: min(block_n, 128)); promote > 0 flushes the wgmma accumulator into an fp32 register
  sum every `promote` k-blocks; overlap (block-scaled kernels) issues k-blocks in pairs into two
  accumulators, promoting the first while the second's wgmma runs; fresh (block-scaled kernels)
  issues each k-block's first wgmma with PTX scale-d = 0, so its fresh accumulator is not zeroed first
  (wgmma_fresh); col_scales (block-scaled kernels) reads B's scales per output column from shared
  memory, TMA'd with each stage (the rows form's 128 x 128 weight scales expanded per column, so a tile
  may straddle two weight blocks: block_n 160), loads them before the wgmma wait and promotes as
  total + part * (s_a s_b): DeepSeek's DeepGEMM structure with wait-then-promote (overlap off);
  gmem_scales (block-scaled, overlap off) reads both operands' scales of a k-block from global memory
  into registers before its wgmma instead of TMA'ing them into shared memory, so no proxy fence orders
  their reads before the producer's next copy into the stage."""

  block_m: int = 128
  block_n: int = 256
  block_k: int | None = None
  stages: int = 4
  compute_wgs: int = 2
  grid_block_n: int = 4
  epi_n: int | None = None
  promote: int = 0
  overlap: bool = False
  fresh: bool = False
  col_scales: bool = False
  gmem_scales: bool = False

  def name(self) -> str:
    s = f"m{self.block_m}n{self.block_n}k{self.block_k or 'auto'}s{self.stages}w{self.compute_wgs}g{self.grid_block_n}"
    if self.epi_n:
      s += f"e{self.epi_n}"
    if self.promote:
      s += f"p{self.promote}"
    if self.overlap:
      s += "o"
    if self.fresh:
      s += "f"
    if self.col_scales:
      s += "c"
    if self.gmem_scales:
      s += "r"
    return s

  def resolved_block_k(self, dtype) -> int:
    return self.block_k or _SWIZZLE // jnp.dtype(dtype).itemsize

  def resolved_epi_n(self) -> int:
    return self.epi_n or min(self.block_n, 128)

  def smem_bytes(self, a_dtype, b_dtype, out_dtype, block_scaled: bool = False) -> int:
    bk = self.resolved_block_k(a_dtype)
    stage = self.block_m * bk * jnp.dtype(a_dtype).itemsize + self.block_n * bk * jnp.dtype(b_dtype).itemsize
    if block_scaled:  # fp32 scales of A's rows and B's columns beside each stage (upper bound)
      stage += 4 * (self.block_m + self.block_n)
    return self.stages * stage + self.block_m * self.resolved_epi_n() * jnp.dtype(out_dtype).itemsize


@dataclasses.dataclass(frozen=True)
class GemmConfigs:
  """Tile configs of grouped_matmul's three GEMMs (None: default_config for the shape)."""

  fwd: TileConfig | None = None
  dgrad: TileConfig | None = None
  wgrad: TileConfig | None = None


SCALINGS = ("none", "current", "blockwise")
"""grouped_matmul's operand scaling: bf16 ("none"); FP8 with per-expert current scaling (E4M3
forward, E5M2 gradients); FP8 with DeepSeek-V3's block scales (E4M3 throughout, fp32 promotion per
128 of K: temoe.moe.experts.fp8_block)."""

# Defaults per GEMM form and scaling. "current": the best config of every one of the six dsv3 GEMMs
# in both H200 sweeps (bench/results/mosaic_gemm.json, mosaic_gemm.run1.json: 1,311-1,428 TFLOP/s);
# the other shape classes (an EP-8 slice, fine-grained 128-expert Qwen3-30B-A3B, the small model's) in one
# call (mosaic_gemm.classes.json): every best within 0-8% of it (the most: the small model's down wgrad on
# 128 x 128 tiles, 895 against 827 TFLOP/s), where one kernel timed first and again second (configs whose
# tile orders are the same) moved by 0.4-7%, the first always slower; so they keep it. The bench times
# configs in rounds since (timed_in_rounds): swept so (mosaic_gemm.classes_rounds.json), the small model's
# and Qwen3-30B-A3B's twelve GEMMs have their best within 0-3.1% of it (that down wgrad: 823 by default,
# 766 on 128 x 128 tiles). "none" (bf16): the same tile shape (its 128-byte
# k-block is 64 elements, so a stage is the same size); in the H200 bf16 sweep of eight configs
# (bench/results/mosaic_gemm_bf16.json) it is the best for all six dsv3 GEMMs (701-741 TFLOP/s) and
# within 0-15% of the best per GEMM on the small model's 1024 / 512 shape (0.06 ms of its 1.36 ms). "blockwise": its fp32 total doubles
# the accumulator registers, so a warpgroup's tile is 64 x 128 (64 x 256 would need 256 registers a
# thread for the two alone); the best of five configs for all six dsv3 GEMMs in the H200 sweep
# (bench/results/mosaic_gemm_blockwise.json: 1,007-1,078 TFLOP/s forward and dgrad, 829-839 wgrad;
# without `overlap` 908-951 / 745-779 in the same call). Measured and not kept (one H200 call,
# bench/results/mosaic_gemm_blockwise.pipelines.json): a rolling pipeline that keeps one wgmma in
# flight across pairs by re-zeroing two live accumulators (400-480 TFLOP/s: the zeroing store
# serialises the warpgroup), and CTA pairs sharing A by TMA multicast (1,008-1,056 against
# 1,027-1,085; for "current" 128 x 256 tiles 1,200-1,372 against 1,308-1,426:
# mosaic_gemm.cluster.json), so halving A's L2 -> SMEM traffic is not what bounds these kernels; and the
# two warpgroups' pairs one k-block apart, so that each one's unhidden promotion falls under the other's
# wgmma (code at c83b682; bench/results/mosaic_gemm_blockwise.stagger.json, configs timed in rounds): 843-951
# TFLOP/s forward and dgrad, 736-785 wgrad, against 1,044-1,109 / 789-830 for the pairs in step, so
# offsetting the warpgroups does not win back what the promotions cost.
# Dims that are not whole tiles (default_config's widths by TILE_FIXED_COLUMNS, current scaling's
# 64-element k-blocks), swept on the 2880-dim shape (bench/results/mosaic_gemm_bf16.gpt_oss_like.json,
# mosaic_gemm.gpt_oss_like.json): bf16's defaults best in five of six GEMMs (425-463 TFLOP/s; the down
# wgrad 366 against 399 with 128-wide tiles), 64-wide tiles 280-356; FP8's 64-element k-blocks 634-638
# against 840 for the 128-element gate/up dgrad of the same shape, so FP8 copies are padded to 128s
# (the layer 14.73 against 15.17 ms: bench/results/moe_layer.gpt_oss_like.padded128.json, kblock64.json).
_DEFAULTS = {
    ("rows", "current"): TileConfig(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=4),
    ("rows", "none"): TileConfig(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=4),
    ("rows", "blockwise"): TileConfig(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, overlap=True),
    ("contract", "current"): TileConfig(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=4),
    ("contract", "none"): TileConfig(block_m=128, block_n=256, stages=4, compute_wgs=2, grid_block_n=4),
    ("contract", "blockwise"): TileConfig(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8,
                                          overlap=True),
}


TILE_FIXED_COLUMNS = 32
"""A tile's fixed cost (its pipeline's fill and drain, its epilogue), in columns of its width: an output
dim of `size` split into tiles of width t costs ceil(size / t) * (t + 32). One number, from the H200
sweeps of DeepSeek-V3's GEMMs, where 128-wide tiles ran at 0.89-0.90 of 256-wide ones in FP8 and bf16
(bench/results/mosaic_gemm.json, mosaic_gemm_bf16.json): 128 / (128 + 32) = 0.9 x 256 / (256 + 32)."""


def _tile(size: int, largest: int) -> int:
  """The tile width (largest, largest / 2, ... >= 64) that covers `size` at the least cost by
  TILE_FIXED_COLUMNS (ties: the larger): a tile past the end computes columns that are clipped, a
  narrower tile pays its fixed cost more often (2880 takes 256: 12 tiles, 6% past the end, against 45
  tiles of 64)."""
  cands = []
  t = largest
  while t >= 64:
    cands.append(t)
    t //= 2
  return min(cands, key=lambda t: (-(-size // t) * (t + TILE_FIXED_COLUMNS), -t))


def default_config(form: str, scaling: str, n_out: int, m_out: int | None = None,
                   contract: int | None = None) -> TileConfig:
  """The default TileConfig for a kernel form ("rows": fwd/dgrad, "contract": wgrad) and scaling
  whose output has n_out columns (and, for "contract", m_out rows), contracting over `contract`
  elements: `for_contraction`'s k-blocks."""
  if scaling not in SCALINGS:
    raise ValueError(f"scaling {scaling!r}: choose one of {', '.join(SCALINGS)}")
  cfg = _DEFAULTS[(form, scaling)]
  bn = _tile(n_out, cfg.block_n)
  bm = cfg.block_m if m_out is None else _tile(m_out, cfg.block_m)
  wgs = cfg.compute_wgs if bm // cfg.compute_wgs >= 64 else 1
  epi = cfg.epi_n if cfg.epi_n is None or bn % cfg.epi_n == 0 else None
  cfg = dataclasses.replace(cfg, block_n=bn, block_m=bm, compute_wgs=wgs, epi_n=epi)
  return for_contraction(cfg, scaling, contract) if contract is not None else cfg


def for_contraction(cfg: TileConfig, scaling: str, contract: int) -> TileConfig:
  """`cfg` for a GEMM contracting over `contract` elements: current scaling over whole 64s but not 128s
  in 64-element k-blocks, twice the stages (the same bytes in flight); any other config as it is.
  grouped_matmul's copies are whole 128s (recipes.mosaic_copy_dim: 64-element k-blocks measured 634-638
  TFLOP/s against 840 on the H200), so this serves a caller passing an unpadded copy (bench/mosaic_gemm.py)."""
  if scaling == "current" and contract % _SWIZZLE and cfg.block_k is None:  # 128 FP8 elements
    return dataclasses.replace(cfg, block_k=_SWIZZLE // 2, stages=2 * cfg.stages)
  return cfg


def copy_dim(d: int, scaling: str) -> int:
  """The size of an FP8 copy's dim of true size d (recipes.mosaic_copy_dim: the one rule, which the
  memory plan reads too)."""
  return recipes.mosaic_copy_dim(d, scaling)


def check_shapes(k: int, n: int, scaling: str = "none") -> None:
  """Raises ValueError (one line) if grouped_matmul with `scaling` cannot run with contraction K and
  output N (the multiples and why: temoe.recipes.MOSAIC_DIM_MULTIPLE)."""
  m = recipes.MOSAIC_DIM_MULTIPLE[scaling]
  bad = [f"{name}={v}" for name, v in (("K", k), ("N", n)) if v <= 0 or v % m]
  if bad:
    fix = ", ".join(f"{name}={max(m, -(-v // m) * m)}" for name, v in (("K", k), ("N", n)))
    raise ValueError(
        f"temoe mosaic grouped GEMM ({scaling}) needs K and N to be positive multiples of {m}, "
        f"got {', '.join(bad)}; pad to {fix} or use the xla/te expert backend."
    )


def _check_config(cfg: TileConfig, a_dtype, b_dtype, out_dtype, rows: int, cols: int, contract: int, form: str,
                  block_scaled: bool = False):
  """Static checks that would otherwise surface as obscure lowering errors."""
  bk = cfg.resolved_block_k(a_dtype)
  wm = cfg.block_m // cfg.compute_wgs
  problems = []
  if jnp.dtype(a_dtype).itemsize != jnp.dtype(b_dtype).itemsize:
    problems.append(f"operand dtypes {a_dtype}/{b_dtype} differ in width")
  if bk * jnp.dtype(a_dtype).itemsize not in SWIZZLES:
    problems.append(f"block_k={bk} is not {' or '.join(map(str, SWIZZLES))} bytes of the operand")
  if cfg.block_m % cfg.compute_wgs or wm % 64:
    problems.append(f"block_m={cfg.block_m} / compute_wgs={cfg.compute_wgs} is not a multiple of 64")
  if form == "rows" and ROW_ALIGNMENT % cfg.block_m:
    problems.append(f"block_m={cfg.block_m} must divide ROW_ALIGNMENT={ROW_ALIGNMENT}")
  if form == "contract" and ROW_ALIGNMENT % bk:
    problems.append(f"block_k={bk} must divide ROW_ALIGNMENT={ROW_ALIGNMENT} for the wgrad form")
  n_step = 32 if block_scaled and cfg.col_scales else 64  # per-column scales: 160-wide tiles
  if cfg.block_n % n_step or cfg.block_n > 256:
    problems.append(f"block_n={cfg.block_n} must be a multiple of {n_step} and <= 256")
  epi = cfg.resolved_epi_n()
  if cfg.block_n % epi or epi % 32:
    problems.append(f"epi_n={epi} must divide block_n={cfg.block_n}")
  if form == "rows" and rows % cfg.block_m:
    problems.append(f"{rows} output rows not a multiple of block_m={cfg.block_m}")
  for name, v, item in (("contraction", contract, a_dtype), ("output columns", cols, out_dtype)):
    if v * jnp.dtype(item).itemsize % 16:
      problems.append(f"{name} {v} x {jnp.dtype(item).itemsize} bytes is not a multiple of 16 bytes (TMA rows)")
  # Mosaic GPU's TMA copies whole tiles of a dim it tiles (or a dim smaller than one tile)
  if form == "rows" and contract > bk and contract % bk:
    problems.append(f"contraction {contract} is not whole k-blocks of {bk} (TMA reads whole tiles)")
  out_tile = _out_transforms(out_dtype, epi)[0].tiling
  if cols > out_tile[1] and cols % out_tile[1]:
    problems.append(f"output columns {cols} are not whole {out_tile[1]}-column tiles of the epilogue")
  if form == "contract" and rows > out_tile[0] and rows % out_tile[0]:
    problems.append(f"output rows {rows} are not whole {out_tile[0]}-row tiles of the epilogue")
  if cfg.smem_bytes(a_dtype, b_dtype, out_dtype, block_scaled) > _SMEM_BYTES:
    problems.append(f"needs {cfg.smem_bytes(a_dtype, b_dtype, out_dtype, block_scaled)} bytes of SMEM > {_SMEM_BYTES}")
  if cfg.stages < 2:
    problems.append("stages must be >= 2")
  if not block_scaled and (cfg.fresh or cfg.col_scales or cfg.gmem_scales):
    problems.append("fresh, col_scales and gmem_scales are options of the block-scaled kernels")
  if block_scaled:
    if jnp.dtype(a_dtype) not in _FP8 or jnp.dtype(b_dtype) not in _FP8:
      problems.append("block scaling needs FP8 operands")
    if bk != 128:
      problems.append(f"block scaling needs block_k=128 (one scale per 128 of K), got {bk}")
    if form == "rows" and 128 % cfg.block_n and not cfg.col_scales:
      problems.append(f"block scaling needs a block_n dividing 128 (a tile inside one 128-wide weight block), got "
                      f"{cfg.block_n}; col_scales=True takes any")
    if cfg.fresh and (why := wgmma_fresh.unavailable()):
      problems.append(f"fresh {why}")
    if cfg.promote:
      problems.append("block scaling promotes every k-block already (promote must be 0)")
    if cfg.overlap and cfg.stages < 2:
      problems.append("overlap needs two stages in flight")
    if cfg.overlap and (cfg.col_scales or cfg.gmem_scales):
      problems.append("col_scales and gmem_scales wait, then promote (overlap must be off)")
  if problems:
    raise ValueError(f"TileConfig {cfg.name()} cannot run this GEMM: " + "; ".join(problems))


def num_sms() -> int:
  """SMs of the default device (the persistent grid's size)."""
  dev = jax.devices()[0]
  n = getattr(dev, "core_count", None)
  if not n:
    raise RuntimeError(f"device {dev} reports no core_count; pass num_sms explicitly")
  return int(n)


# ----------------------------------------------------------------------------------------------
# Scheduling (plain JAX; the kernel reads the tables these produce)


def tile_groups(group_sizes: jax.Array, num_tiles: int, block_m: int) -> jax.Array:
  """(num_tiles,) int32: the expert owning rows [t*block_m, (t+1)*block_m), or -1 past the groups.

  Groups are assumed padded to multiples of block_m (ROW_ALIGNMENT), so no tile straddles two.
  One fused compare of every tile start against every group end: searchsorted's default binary
  search is a `while` loop, which XLA:GPU runs from the host, outside CUDA graphs: the host launches
  every iteration (and, where the trip count is not known, copies the predicate back and waits).
  """
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  starts = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
  g = jnp.searchsorted(ends, starts, side="right", method="compare_all").astype(jnp.int32)
  return jnp.where(starts < ends[-1], g, -1).astype(jnp.int32)


def contraction_schedule(group_sizes: jax.Array, block_k: int):
  """For the wgrad form: (order, start_block, num_blocks), each (G,) int32.

  order lists experts largest first (stable); expert g's tokens are blocks
  [start_block[g], start_block[g] + num_blocks[g]) of block_k tokens (0 blocks: empty expert).
  """
  gs = group_sizes.astype(jnp.int32)
  starts = jnp.cumsum(gs) - gs
  order = jnp.argsort(-gs, stable=True).astype(jnp.int32)
  return order, (starts // block_k).astype(jnp.int32), (gs // block_k).astype(jnp.int32)


def tile_coords(lin, grid_m: int, grid_n: int, band: int):
  """Linear tile index -> (row tile, column tile): bands of `band` column tiles, row-major inside.

  Works on Python ints, numpy or JAX int32 scalars (the kernel calls it on traced scalars).
  """
  band = max(1, min(band, grid_n))
  per_band = grid_m * band
  b = lin // per_band
  r = lin % per_band
  width = _minimum(band, grid_n - b * band)
  return r // width, b * band + r % width


def _minimum(a, b):
  if isinstance(a, int) and isinstance(b, int):
    return min(a, b)
  return jnp.minimum(a, b)


# ----------------------------------------------------------------------------------------------
# The kernel


def _smem_transforms(dtype, block_k: int):
  """SMEM tiles of one k-block: rows of block_k elements, swizzled by their width in bytes."""
  swizzle = block_k * jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, block_k)), plgpu.SwizzleTransform(swizzle))


def _out_transforms(dtype, epi_n):
  swizzle = plgpu.find_swizzle(epi_n * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _grouped_kernel(
    *,
    form: str,
    a_shape,
    b_shape,
    a_rc: bool,
    b_rc: bool,
    a_dtype,
    b_dtype,
    out_shape,
    out_dtype,
    num_groups: int,
    cfg: TileConfig,
    sms: int,
    scaled: bool,
    block_scaled: bool = False,
    inplace: bool = False,
):
  """Builds the pallas kernel. form "rows": A (M, C) [a_rc] or (C, M), B (G, Nout, C) [b_rc] or
  (G, C, Nout), out (M, Nout), ragged rows. form "contract": A (Mout, T) [a_rc] or (T, Mout),
  B (Nout, T) [b_rc] or (T, Nout), out (G, Mout, Nout), ragged contraction over tokens T.

  block_scaled (FP8, block_k 128): the fp32 partial sum of every k-block is scaled and added to an
  fp32 register total. Two more inputs: A's scales (k-blocks, A rows), one per row and k-block, TMA'd
  beside each stage; B's scales: "rows" form (G, k-blocks, Nout / 128), one per 128 x 128 weight
  block, read by the consumer per k-block; "contract" form (k-blocks, Nout), one per column, TMA'd
  beside each stage. Columns and contraction past the operands' ends are zero-filled by TMA and
  stores past the output's ends are clipped, so Nout and C need not be multiples of the tile."""
  bm, bn, S, C = cfg.block_m, cfg.block_n, cfg.stages, cfg.compute_wgs
  bk = cfg.resolved_block_k(a_dtype)
  wm = bm // C
  epi = cfg.resolved_epi_n()
  if form == "rows":
    rows, cols = out_shape
    contract = a_shape[1] if a_rc else a_shape[0]
  else:
    _, rows, cols = out_shape
    contract = None
  grid_m, grid_n = -(-rows // bm), -(-cols // bn)
  tiles_per_plane = grid_m * grid_n
  num_tiles = tiles_per_plane if form == "rows" else num_groups * tiles_per_plane
  band = cfg.grid_block_n
  nk_static = -(-contract // bk) if form == "rows" else None
  b_block = (bn, bk) if b_rc else (bk, bn)
  # "cr" A tiles are split per compute warpgroup (one TMA each): no slicing of the swizzled dim.
  a_copies = 1 if a_rc else C
  a_smem_shape = (S, bm, bk) if a_rc else (S, C, bk, wm)
  col_scales = block_scaled and (form == "contract" or cfg.col_scales)  # B's scales per column, per stage
  smem_scales = block_scaled and not cfg.gmem_scales  # gmem_scales: read by the consumers from GMEM
  copies_per_stage = a_copies + 1 + (block_scaled + col_scales) * smem_scales
  scale_smem = {}
  if smem_scales:
    scale_smem["sa_smem"] = plgpu.SMEM((S, bm), jnp.float32)
    if col_scales:
      scale_smem["sb_smem"] = plgpu.SMEM((S, bn), jnp.float32)
  if cfg.fresh:
    wgmma_fresh.install()  # marked wgmmas (fresh accumulators) lower with scale-d = 0

  def tile_info(t, sched_refs):
    """(group, a_row0, b_row0, k_block0, num_k_blocks, out_row0, out_col0) of output tile t."""
    if form == "rows":
      (tg_ref,) = sched_refs
      mi, ni = tile_coords(t, grid_m, grid_n, band)
      g = tg_ref[mi]
      valid = g >= 0
      g = jnp.maximum(g, 0)
      nk = jnp.where(valid, jnp.int32(nk_static), jnp.int32(0))
      return g, mi * bm, ni * bn, jnp.int32(0), nk, mi * bm, ni * bn
    order_ref, start_ref, nblk_ref = sched_refs
    gi = t // tiles_per_plane
    mi, ni = tile_coords(t % tiles_per_plane, grid_m, grid_n, band)
    g = order_ref[gi]
    return g, mi * bm, ni * bn, start_ref[g], nblk_ref[g], mi * bm, ni * bn

  def body(*refs):
    n_sched = 1 if form == "rows" else 3
    sched_refs = refs[:n_sched]
    if block_scaled:
      a_gmem, b_gmem, scale_gmem, sa_gmem, sb_gmem, o_gmem = refs[n_sched:]
    else:
      a_gmem, b_gmem, scale_gmem, o_gmem = refs[n_sched:]
      sa_gmem = sb_gmem = None

    sm = lax.axis_index("sm")
    n_local = (num_tiles - sm + (sms - 1)) // sms  # tiles sm, sm + sms, ... < num_tiles

    @functools.partial(
        pl.run_scoped,
        a_smem=plgpu.SMEM(a_smem_shape, a_dtype, transforms=_smem_transforms(a_dtype, bk)),
        b_smem=plgpu.SMEM((S, *b_block), b_dtype, transforms=_smem_transforms(b_dtype, bk)),
        o_smem=plgpu.SMEM((C, wm, epi), out_dtype, transforms=_out_transforms(out_dtype, epi)),
        produced=plgpu.Barrier(num_arrivals=copies_per_stage, num_barriers=S),
        consumed=plgpu.Barrier(num_arrivals=C, num_barriers=S),
        collective_axes="wg",
        **scale_smem,
    )
    def scope(a_smem, b_smem, o_smem, produced, consumed, sa_smem=None, sb_smem=None):
      wg = lax.axis_index("wg")

      def b_view(g):
        return b_gmem.at[g] if form == "rows" else b_gmem

      @pl.when(wg == C)
      def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def tile_loop(i, step):
          g, a_row0, b_row0, k0, nk, _, _ = tile_info(sm + i * sms, sched_refs)
          bsrc = b_view(g)

          def k_loop(kk, step):
            slot = lax.rem(step, S)

            @pl.when(step >= S)
            def _():
              plgpu.barrier_wait(consumed.at[slot])

            kc = (k0 + kk) * bk
            if a_rc:
              plgpu.copy_gmem_to_smem(
                  a_gmem.at[pl.ds(a_row0, bm), pl.ds(kc, bk)], a_smem.at[slot], produced.at[slot]
              )
            else:
              for w in range(C):
                plgpu.copy_gmem_to_smem(
                    a_gmem.at[pl.ds(kc, bk), pl.ds(a_row0 + w * wm, wm)], a_smem.at[slot, w], produced.at[slot]
                )
            if b_rc:
              bsl = bsrc.at[pl.ds(b_row0, bn), pl.ds(kc, bk)]
            else:
              bsl = bsrc.at[pl.ds(kc, bk), pl.ds(b_row0, bn)]
            plgpu.copy_gmem_to_smem(bsl, b_smem.at[slot], produced.at[slot])
            if smem_scales:
              plgpu.copy_gmem_to_smem(sa_gmem.at[k0 + kk, pl.ds(a_row0, bm)], sa_smem.at[slot], produced.at[slot])
              if col_scales:
                sb_src = sb_gmem.at[k0 + kk] if form == "contract" else sb_gmem.at[g, kk]
                plgpu.copy_gmem_to_smem(sb_src.at[pl.ds(b_row0, bn)], sb_smem.at[slot], produced.at[slot])
            return step + 1

          return lax.fori_loop(0, nk, k_loop, step)

        total = lax.fori_loop(0, n_local, tile_loop, jnp.int32(0))
        # Observe the last stages' releases too, so no barrier is left mid-phase at exit.
        for j in range(S):
          s = total - S + j

          @pl.when(s >= 0)
          def _():
            plgpu.barrier_wait(consumed.at[lax.rem(jnp.maximum(s, 0), S)])

      @pl.when(wg < C)
      def _consumer():
        plgpu.set_max_registers(232 if C > 1 else 256, action="increase")

        def mma(acc, slot, fresh=False):
          if a_rc:
            a_op = a_smem.at[slot, pl.ds(wg * wm, wm)]
          else:
            a_op = a_smem.at[slot, wg].T
          b_op = b_smem.at[slot].T if b_rc else b_smem.at[slot]
          with wgmma_fresh.fresh() if fresh else contextlib.nullcontext():
            plgpu.wgmma(acc, a_op, b_op)

        def k_loop(kk, step, lo, acc):
          slot = lax.rem(step, S)
          plgpu.barrier_wait(produced.at[slot])
          mma(acc, slot)
          plgpu.wgmma_wait(1)  # the previous step's wgmma is done reading its slot

          @pl.when(kk > lo)
          def _():
            plgpu.barrier_arrive(consumed.at[lax.rem(step - 1 + S, S)])

          return step + 1

        def promote(total, part, slot, sb):
          """total + part scaled by the k-block's scales (A's per row, B's per block or column); then
          the slot, scales read, goes back to the producer."""
          sa = plgpu.load(sa_smem.at[slot, pl.ds(wg * wm, wm)], layout=plgpu.Layout.WGMMA.reduce(1))
          if form == "rows":
            part = part * lax.broadcast_in_dim(sa * sb, (wm, bn), [0])
          else:
            sbv = plgpu.load(sb_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            part = part * lax.broadcast_in_dim(sa, (wm, bn), [0]) * lax.broadcast_in_dim(sbv, (wm, bn), [1])
          # The scales were read through the generic proxy and the producer's next TMA into this slot
          # writes through the async one: a proxy fence orders the two (PTX's memory model).
          plgpu.commit_smem()
          plgpu.barrier_arrive(consumed.at[slot])
          return total + part

        def column_scales(slot):
          """col_scales: the k-block's scales of A's rows and B's columns, read before the wgmma wait."""
          sa = plgpu.load(sa_smem.at[slot, pl.ds(wg * wm, wm)], layout=plgpu.Layout.WGMMA.reduce(1))
          sbv = plgpu.load(sb_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          return sa, sbv

        def promote_columns(total, part, slot, sa, sbv):
          """total + part * (s_a s_b): one multiply and one FMA per element; then the slot goes back."""
          scale = lax.broadcast_in_dim(sa, (wm, bn), [0]) * lax.broadcast_in_dim(sbv, (wm, bn), [1])
          plgpu.commit_smem()  # the scales' generic-proxy reads before the producer's next TMA (see promote)
          plgpu.barrier_arrive(consumed.at[slot])
          return total + part * scale

        def weight_scale(g, kk, b_row0):
          # the rows form's 128 x 128 weight block scale (a GMEM scalar, loaded ahead of its use)
          return sb_gmem[g, kk, b_row0 // 128] if form == "rows" and not col_scales else None

        def block_scaled_k_loop(kk, carry, g, b_row0, a_row0, k0):
          """One k-block into a fresh accumulator, waited for, then promoted."""
          step, total = carry
          slot = lax.rem(step, S)
          if cfg.gmem_scales:  # both scales into registers before the wgmma; no shared memory, no fence
            sa = plgpu.load(sa_gmem.at[k0 + kk, pl.ds(a_row0 + wg * wm, wm)], layout=plgpu.Layout.WGMMA.reduce(1),
                            optimized=False)  # GMEM: plain per-thread loads
            if col_scales:
              sb_src = sb_gmem.at[k0 + kk] if form == "contract" else sb_gmem.at[g, kk]
              sbv = plgpu.load(sb_src.at[pl.ds(b_row0, bn)], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            else:
              sa = sa * sb_gmem[g, kk, b_row0 // 128]
            plgpu.barrier_wait(produced.at[slot])

            def acc_scope(acc):
              mma(acc, slot, cfg.fresh)
              return acc[...]

            part = pl.run_scoped(acc_scope, plgpu.ACC((wm, bn), jnp.float32))
            plgpu.barrier_arrive(consumed.at[slot])
            scale = lax.broadcast_in_dim(sa, (wm, bn), [0])
            if col_scales:
              scale = scale * lax.broadcast_in_dim(sbv, (wm, bn), [1])
            return step + 1, total + part * scale

          sb = weight_scale(g, kk, b_row0)
          plgpu.barrier_wait(produced.at[slot])

          if cfg.col_scales:
            def acc_scope(acc):
              mma(acc, slot, cfg.fresh)
              sa, sbv = column_scales(slot)
              return acc[...], sa, sbv

            part, sa, sbv = pl.run_scoped(acc_scope, plgpu.ACC((wm, bn), jnp.float32))
            return step + 1, promote_columns(total, part, slot, sa, sbv)

          def acc_scope(acc):
            mma(acc, slot, cfg.fresh)
            return acc[...]

          part = pl.run_scoped(acc_scope, plgpu.ACC((wm, bn), jnp.float32))
          return step + 1, promote(total, part, slot, sb)

        def block_scaled_pair_loop(j, carry, g, b_row0):
          """Two k-blocks into two fresh accumulators: the first is promoted while the second's
          wgmma still runs (TileConfig.overlap)."""
          step, total = carry
          s0, s1 = lax.rem(step, S), lax.rem(step + 1, S)
          sb0, sb1 = weight_scale(g, 2 * j, b_row0), weight_scale(g, 2 * j + 1, b_row0)

          def accs_scope(a0, a1):
            plgpu.barrier_wait(produced.at[s0])
            mma(a0, s0, cfg.fresh)
            plgpu.barrier_wait(produced.at[s1])
            mma(a1, s1, cfg.fresh)
            t = promote(total, plgpu.wgmma_accumulator_load(a0, wait_n=1), s0, sb0)
            return promote(t, a1[...], s1, sb1)

          acc = plgpu.ACC((wm, bn), jnp.float32)
          return step + 2, pl.run_scoped(accs_scope, acc, acc)

        def tile_loop(i, step):
          g, a_row0, b_row0, k0, nk, o_row0, o_col0 = tile_info(sm + i * sms, sched_refs)

          def run_chunk(step, lo, hi):
            """k-blocks [lo, hi) into a fresh accumulator; returns (step, fp32 value)."""

            def acc_scope(acc):
              step2 = lax.fori_loop(lo, hi, lambda kk, s: k_loop(kk, s, lo, acc), step)
              val = acc[...]  # waits for every wgmma

              @pl.when(hi > lo)
              def _():
                plgpu.barrier_arrive(consumed.at[lax.rem(step2 - 1 + S, S)])

              return step2, val

            return pl.run_scoped(acc_scope, plgpu.ACC((wm, bn), jnp.float32))

          if block_scaled:
            carry = (step, plgpu.layout_cast(jnp.zeros((wm, bn), jnp.float32), plgpu.Layout.WGMMA))
            if cfg.overlap:
              pairs = nk // 2
              carry = lax.fori_loop(0, pairs, lambda j, c: block_scaled_pair_loop(j, c, g, b_row0), carry)
              carry = lax.fori_loop(2 * pairs, nk, lambda kk, c: block_scaled_k_loop(kk, c, g, b_row0, a_row0, k0), carry)
            else:
              carry = lax.fori_loop(0, nk, lambda kk, c: block_scaled_k_loop(kk, c, g, b_row0, a_row0, k0), carry)
            step, val = carry
          elif cfg.promote:
            # Flush into an fp32 register sum every `promote` k-blocks (a fresh accumulator each).
            def chunk(c, carry):
              step, total = carry
              lo = c * cfg.promote
              step, part = run_chunk(step, lo, jnp.minimum(nk, lo + cfg.promote))
              return step, total + part

            nchunks = (nk + (cfg.promote - 1)) // cfg.promote
            step, val = lax.fori_loop(0, nchunks, chunk, (step, jnp.zeros((wm, bn), jnp.float32)))
          else:
            step, val = run_chunk(step, jnp.int32(0), nk)
          if scaled:
            val = val * scale_gmem[g]
          val = val.astype(out_dtype)
          r0 = o_row0 + wg * wm
          for j in range(bn // epi):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem free again
            o_smem[wg] = val[:, j * epi:(j + 1) * epi]
            plgpu.commit_smem()
            if form == "rows":
              dst = o_gmem.at[pl.ds(r0, wm), pl.ds(o_col0 + j * epi, epi)]
            else:
              dst = o_gmem.at[g, pl.ds(r0, wm), pl.ds(o_col0 + j * epi, epi)]
            plgpu.copy_smem_to_gmem(o_smem.at[wg], dst)
          return step

        lax.fori_loop(0, n_local, tile_loop, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body,
      out_type=() if inplace else jax.ShapeDtypeStruct(out_shape, out_dtype),
      grid=(sms,),
      grid_names=("sm",),
      num_threads=C + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )


def _run(kern, args, out):
  """Runs the kernel into a fresh buffer, or into `out` (aliased, written in place)."""
  if out is None:
    return kern(*args)
  ref = jax.new_ref(out)
  kern(*args, ref)
  return jax.freeze(ref)


def _scaling_of(dtype, block_scaled: bool) -> str:
  if block_scaled:
    return "blockwise"
  return "current" if jnp.dtype(dtype) in _FP8 else "none"


def _scales_or_ones(scales, g):
  if scales is None:
    return jnp.ones((g,), jnp.float32), False
  return jnp.broadcast_to(jnp.asarray(scales, jnp.float32), (g,)), True


def ragged_rows_matmul(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    scales: jax.Array | None = None,
    *,
    b_contract_minor: bool = True,
    out_dtype=jnp.bfloat16,
    config: TileConfig | None = None,
    sms: int | None = None,
    out: jax.Array | None = None,
    block_scales: tuple[jax.Array, jax.Array] | None = None,
    n_out: int | None = None,
) -> jax.Array:
  """out[r] = scales[g] * a[r] @ B[g] for the rows r of group g; rows past the groups are 0.

  a (M, C); b (G, Nout, C) if b_contract_minor (contraction contiguous: any dtype, required for
  FP8) else (G, C, Nout) (16-bit only); scales (G,) fp32 or None. The forward (a = x, b = w^T) and
  dgrad (a = dy, b = w) kernel. M must be a multiple of block_m (grouped_matmul pads). `out`: a
  buffer of the output's shape and dtype to write into in place (tests poison it with NaN).
  block_scales (FP8 only, instead of scales): (a's 1 x 128 scales (ceil(C/128), M), b's 128 x 128
  scales (G, ceil(C/128), ceil(Nout/128))), applied to every 128-deep partial sum (fp8_block).
  n_out: the output's columns, at most B's Nout (default): a B padded past the true N (an FP8 copy)
  writes only the true columns (the last tile's stores past them are clipped), no copy to slice.
  """
  m, c = a.shape
  g = b.shape[0]
  b_cols = b.shape[1] if b_contract_minor else b.shape[2]
  n_out = b_cols if n_out is None else n_out
  c2 = b.shape[2] if b_contract_minor else b.shape[1]
  if c != c2:
    raise ValueError(f"contraction mismatch: a {a.shape}, b {b.shape}")
  if not 0 < n_out <= b_cols:
    raise ValueError(f"n_out={n_out}: the output takes 1 to {b_cols} of B's columns")
  if not b_contract_minor and jnp.dtype(b.dtype) in _FP8:
    raise ValueError("FP8 operands need the contraction dim contiguous (b_contract_minor=True)")
  bs = block_scales is not None
  cfg = config or default_config("rows", _scaling_of(a.dtype, bs), n_out, contract=c)
  _check_config(cfg, a.dtype, b.dtype, out_dtype, m, n_out, c, "rows", bs)
  scales, scaled = _scales_or_ones(scales, g)
  extra = ()
  if bs:
    sa, sb = (jnp.asarray(v, jnp.float32) for v in block_scales)
    kb, nb = -(-c // 128), -(-b_cols // 128)
    if sa.shape != (kb, m) or sb.shape != (g, kb, nb):
      raise ValueError(f"block scales {sa.shape}, {sb.shape}: expected {(kb, m)}, {(g, kb, nb)}")
    if cfg.col_scales:  # one scale per column of B, TMA'd with each stage: (G, k-blocks, B's columns)
      sb = jnp.repeat(sb, 128, axis=2)[:, :, :b_cols]
      if cfg.gmem_scales:  # read by plain loads, which TMA's bounds do not clip: whole tiles of columns
        sb = pad_to(sb, (g, kb, -(-b_cols // cfg.block_n) * cfg.block_n))
    extra = (sa, sb)
  kern = _grouped_kernel(
      form="rows", a_shape=a.shape, b_shape=b.shape, a_rc=True, b_rc=b_contract_minor,
      a_dtype=a.dtype, b_dtype=b.dtype, out_shape=(m, n_out), out_dtype=jnp.dtype(out_dtype),
      num_groups=g, cfg=cfg, sms=sms or num_sms(), scaled=scaled, block_scaled=bs, inplace=out is not None,
  )
  tg = tile_groups(group_sizes, m // cfg.block_m, cfg.block_m)
  return _run(kern, (tg, a, b, scales, *extra), out)


def ragged_contract_matmul(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    scales: jax.Array | None = None,
    *,
    a_contract_minor: bool = True,
    b_contract_minor: bool = True,
    out_dtype=jnp.bfloat16,
    config: TileConfig | None = None,
    sms: int | None = None,
    out: jax.Array | None = None,
    block_scales: tuple[jax.Array, jax.Array] | None = None,
    out_dims: tuple[int, int] | None = None,
) -> jax.Array:
  """out[g] = scales[g] * A_g @ B_g^T over the tokens of group g (an empty group gets exactly 0).

  a (Mout, T) if a_contract_minor else (T, Mout); b (Nout, T) if b_contract_minor else (T, Nout);
  tokens past sum(group_sizes) are never read. The wgrad kernel: dw[g] = x_g^T @ dy_g with
  a = x^T, b = dy^T (FP8) or a = x, b = dy (bf16, a_/b_contract_minor=False). Returns (G, Mout, Nout); `out` as in
  ragged_rows_matmul. block_scales (FP8 only, instead of scales): the 128 x 1 scales of a and b,
  (T / 128, Mout) and (T / 128, Nout): one per feature and 128-token block (fp8_block).
  out_dims: the output's (rows, columns), at most (Mout, Nout) (default): padded FP8 copies write only
  the true dims (stores past them are clipped), no copy to slice.
  """
  if not (a_contract_minor and b_contract_minor) and (jnp.dtype(a.dtype) in _FP8 or jnp.dtype(b.dtype) in _FP8):
    raise ValueError("FP8 operands need the contraction dim contiguous (a_/b_contract_minor=True)")
  m_out, t = a.shape if a_contract_minor else a.shape[::-1]
  n_out, t2 = b.shape if b_contract_minor else b.shape[::-1]
  if t != t2:
    raise ValueError(f"token-dim mismatch: a {a.shape}, b {b.shape}")
  a_rows, b_cols = m_out, n_out
  m_out, n_out = out_dims or (m_out, n_out)
  if not (0 < m_out <= a_rows and 0 < n_out <= b_cols):
    raise ValueError(f"out_dims={out_dims}: the output takes 1 to {a_rows} rows and 1 to {b_cols} columns")
  g = group_sizes.shape[0]
  bs = block_scales is not None
  cfg = config or default_config("contract", _scaling_of(a.dtype, bs), n_out, m_out)
  _check_config(cfg, a.dtype, b.dtype, out_dtype, m_out, n_out, t, "contract", bs)
  scales, scaled = _scales_or_ones(scales, g)
  extra = ()
  if bs:
    sa, sb = (jnp.asarray(v, jnp.float32) for v in block_scales)
    if t % 128 or sa.shape != (t // 128, a_rows) or sb.shape != (t // 128, b_cols):
      raise ValueError(f"block scales {sa.shape}, {sb.shape}: expected {(t // 128, a_rows)}, {(t // 128, b_cols)}")
    if cfg.gmem_scales:  # read by plain loads, which TMA's bounds do not clip: whole tiles of rows and columns
      sa = pad_to(sa, (t // 128, -(-a_rows // cfg.block_m) * cfg.block_m))
      sb = pad_to(sb, (t // 128, -(-b_cols // cfg.block_n) * cfg.block_n))
    extra = (sa, sb)
  kern = _grouped_kernel(
      form="contract", a_shape=a.shape, b_shape=b.shape, a_rc=a_contract_minor, b_rc=b_contract_minor,
      a_dtype=a.dtype, b_dtype=b.dtype, out_shape=(g, m_out, n_out), out_dtype=jnp.dtype(out_dtype),
      num_groups=g, cfg=cfg, sms=sms or num_sms(), scaled=scaled, block_scaled=bs, inplace=out is not None,
  )
  order, start, nblk = contraction_schedule(group_sizes, cfg.resolved_block_k(a.dtype))
  return _run(kern, (order, start, nblk, a, b, scales, *extra), out)


# ----------------------------------------------------------------------------------------------
# grouped_matmul: bf16, FP8 with per-expert current scaling, or FP8 with block scales; custom VJP


def _pad_rows(x, rows):
  return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def pad_to(x, shape):
  """x zero-padded at the end of every dim to `shape` (a copy, unless an XLA fusion consumes it)."""
  pads = [(0, t - d) for d, t in zip(x.shape, shape)]
  return jnp.pad(x, pads) if any(p for _, p in pads) else x


def tile_rows(m: int) -> int:
  """m rows rounded up to whole row tiles (what the FP8 copies and the bf16 operands are padded to)."""
  return -(-m // ROW_ALIGNMENT) * ROW_ALIGNMENT


def out_dim(d: int, padded: int, dtype) -> int:
  """The size an output dim of true size d is written at when the operands are padded to `padded`:
  d itself where it is whole 128-byte rows of `dtype` (what Mosaic GPU's TMA store tiles; the stores
  past d are clipped), else `padded` (and the caller slices)."""
  return d if d * jnp.dtype(dtype).itemsize % _SWIZZLE == 0 else padded


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    scaling: str,
    out_dtype=jnp.bfloat16,
    configs: GemmConfigs | None = None,
    sms: int | None = None,
    quant: str | None = None,
    keep_fp8_weights: bool = False,
) -> jax.Array:
  """y (M, N): rows of group g of x (M, K) times w[g] (w: (G, K, N), MaxText's layout).

  group_sizes (G,) int32 stays on the device; groups must be padded to multiples of ROW_ALIGNMENT
  with sum(group_sizes) <= M; rows past the sum come back exactly 0 (and get exactly 0 dx); dw of
  an empty expert is exactly 0. scaling (SCALINGS): "none" runs the kernels in bf16; "current": E4M3
  x and w forward, E5M2 dy backward, per-expert current scaling, fp32 epilogue; "blockwise":
  DeepSeek-V3's recipe (fp8_block: E4M3 everywhere, 1 x 128 / 128 x 128 / 128 x 1 block scales,
  fp32 promotion per 128 of K). Differentiable in x and w. configs: explicit TileConfigs per GEMM
  (default: default_config); sms: persistent grid size (default: the device's SM count); quant: the
  quantizers' implementation (fp8_quant / fp8_block: "auto" = their Triton kernels on a GPU).
  keep_fp8_weights (current scaling): the backward reads the forward's FP8 copy of w (named
  parts.FP8_WEIGHTS, for te_moe_fp8_weights=device|offload) instead of casting w again from the
  forward's scales (parts.FP8_SCALES, which MaxText's custom policy keeps).
  """
  m, k = x.shape
  g, k2, n = w.shape
  if k != k2 or group_sizes.shape != (g,):
    raise ValueError(f"shapes: x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}")
  if scaling not in SCALINGS:
    raise ValueError(f"scaling {scaling!r}: choose one of {', '.join(SCALINGS)}")
  check_shapes(k, n, scaling)
  return _gmm(
      x, w, group_sizes.astype(jnp.int32), scaling, jnp.dtype(out_dtype), configs or GemmConfigs(), sms, quant,
      bool(keep_fp8_weights),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _gmm(x, w, group_sizes, scaling, out_dtype, configs, sms, quant, keep_fp8_weights):
  return _gmm_fwd(x, w, group_sizes, scaling, out_dtype, configs, sms, quant, keep_fp8_weights)[0]


def _gmm_fwd(x, w, group_sizes, scaling, out_dtype, configs, sms, quant, keep_fp8_weights):
  m, k = x.shape
  n = w.shape[2]
  mp = tile_rows(m)
  # empty arrays that carry x's and w's dtypes and true dims to the backward (the FP8 copies may be padded)
  protos = (jnp.zeros((0, k), x.dtype), jnp.zeros((0, k, n), w.dtype))
  if scaling == "current":
    # x cast once into both layouts: x_q for the forward, x_q^T (tokens contiguous) kept for wgrad.
    # The copies are padded in K and N where those are not whole 128-element k-blocks (copy_dim).
    tiles = tile_groups(group_sizes, mp // ROW_ALIGNMENT, ROW_ALIGNMENT)
    xq3 = fp8_quant.quantize_rows(pad_to(x, (mp, copy_dim(k, scaling))), tiles, w.shape[0], E4M3, quant)
    y, fp8_res = current_forward(xq3, w, group_sizes, out_dtype, configs, sms, quant, keep_fp8_weights)
    res = (*fp8_res, group_sizes, *protos)
  elif scaling == "blockwise":
    # x: 1 x 128 blocks for the forward and 128 x 1 blocks of x^T kept for wgrad, from one read;
    # w: both FP8 layouts and one set of 128 x 128 scales (a square block is the same in w^T).
    y, fp8_res = blockwise_forward(fp8_block.quantize_both(pad_to(x, (mp, copy_dim(k, scaling))), impl=quant), w,
                                   group_sizes, out_dtype, configs, sms, quant)
    res = (*fp8_res, group_sizes, *protos)
  else:  # bf16 reads x and w as they are (K and N multiples of 64: check_shapes)
    xb, wb = _pad_rows(x, mp).astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    y = ragged_rows_matmul(xb, wb, group_sizes, b_contract_minor=False, out_dtype=out_dtype, config=configs.fwd, sms=sms)
    res = (xb, None, wb, None, group_sizes, *protos)
  return y[:m, :n], res


def _gmm_bwd(scaling, out_dtype, configs, sms, quant, keep_fp8_weights, res, dy):
  del out_dtype
  xs, sx, wq, sw, group_sizes, x_proto, w_proto = res
  m = dy.shape[0]
  _, k, n = w_proto.shape
  mp = xs.shape[0] if scaling == "none" else xs.shape[1]  # FP8 residuals: x^T (Kc, Mp), w (G, Kc, Nc)
  if scaling == "current":
    tiles = tile_groups(group_sizes, mp // ROW_ALIGNMENT, ROW_ALIGNMENT)
    dyq3 = fp8_quant.quantize_rows(pad_to(dy, (mp, copy_dim(n, scaling))), tiles, group_sizes.shape[0], E5M2, quant)
    dx, dw = current_backward((xs, sx, wq, sw), dyq3, group_sizes, x_proto.dtype, w_proto.dtype, configs, sms, k, n,
                              keep_fp8_weights)
  elif scaling == "blockwise":
    dyq4 = fp8_block.quantize_both(pad_to(dy, (mp, wq.shape[2])), impl=quant)
    dx, dw = blockwise_backward((xs, sx, wq, sw), dyq4, group_sizes, x_proto.dtype, w_proto.dtype, configs, sms, k, n)
  else:
    dyb = _pad_rows(dy, mp).astype(jnp.bfloat16)
    dx = ragged_rows_matmul(dyb, wq, group_sizes, out_dtype=x_proto.dtype, config=configs.dgrad, sms=sms)
    dw = ragged_contract_matmul(
        xs, dyb, group_sizes, a_contract_minor=False, b_contract_minor=False, out_dtype=w_proto.dtype,
        config=configs.wgrad, sms=sms,
    )
  return dx[:m, :k], dw[:, :k, :n], None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def current_forward(xq3, w, group_sizes, out_dtype, configs: GemmConfigs, sms, quant, keep_fp8_weights: bool):
  """The current-scaling forward GEMM from rows already quantized: `xq3` is fp8_quant.quantize_rows's
  (x_q, x_q^T, per-expert scales) of x zero-padded to (whole tiles of rows, copy_dim of K) (or
  quantize_gathered's, whose producer quantized them as it read). The weights are cast here, once into
  both layouts (w_q^T for the forward, w_q as stored for dgrad). Returns (y (Mp, N) or (Mp, Nc): out_dim,
  the residuals `current_backward` takes)."""
  g, k, n = w.shape
  kc, nc = copy_dim(k, "current"), copy_dim(n, "current")
  # Every copy is named `quantization`: a policy that keeps them runs a recomputed forward from them.
  xq, xqt, sx = parts.tag_quantized(*xq3)
  sw = parts.tag_weight_scales(fp8_quant.group_scales(fp8_quant.weight_amax(w), E4M3))
  # the copies zero-padded to (Kc, Nc) as the cast reads w: no padded bf16 copy of the weights
  row_scale = jnp.broadcast_to(sw[:, None], (g, kc))
  if keep_fp8_weights:  # te_moe_fp8_weights=device|offload: the backward reads the forward's w_q
    wq, wqt = fp8_quant.cast_transpose(w, row_scale, E4M3, quant, padded=(kc, nc))
    wq, wqt, sw = parts.tag_quantized_weights(wq, wqt, sw)
    w_res = wq
  else:  # the backward casts w again from the saved scales (one pass, no amax): the forward writes w_q^T alone
    (wqt,) = parts.tag_quantized(fp8_quant.cast_transposed(w, row_scale, E4M3, quant, padded=(kc, nc)))
    w_res = w
  y = ragged_rows_matmul(xq, wqt, group_sizes, 1.0 / (sx * sw), out_dtype=out_dtype, config=configs.fwd, sms=sms,
                         n_out=out_dim(n, nc, out_dtype))
  return y, (xqt, sx, w_res, sw)


def current_backward(res, dyq3, group_sizes, x_dtype, w_dtype, configs: GemmConfigs, sms, k: int, n: int,
                     keep_fp8_weights: bool):
  """(dx (Mp, K or Kc), dw (G, K, N or Nc)) of the current-scaling GEMM of true dims K, N from
  `current_forward`'s residuals and the incoming gradient already quantized (dyq3 as xq3, E5M2, over
  (Mp, copy_dim of N)). Without kept FP8 weights the residual is w itself: w_q again from the forward's
  scales. An output dim that is not whole 128-byte rows comes back padded (out_dim), for the caller to slice."""
  xqt, sx, wq, sw = res
  dyq, dyqt, sdy = dyq3
  kc, nc = copy_dim(k, "current"), copy_dim(n, "current")
  if not keep_fp8_weights:
    wq = fp8_quant.cast_experts(wq, sw, E4M3, padded=(kc, nc))
  dx = ragged_rows_matmul(dyq, wq, group_sizes, 1.0 / (sdy * sw), out_dtype=x_dtype, config=configs.dgrad,
                          sms=sms, n_out=out_dim(k, kc, x_dtype))
  dw = ragged_contract_matmul(xqt, dyqt, group_sizes, 1.0 / (sx * sdy), out_dtype=w_dtype, config=configs.wgrad,
                              sms=sms, out_dims=(k, out_dim(n, nc, w_dtype)))
  return dx, dw


def blockwise_forward(xq4, w, group_sizes, out_dtype, configs: GemmConfigs, sms, quant):
  """The blockwise forward GEMM from rows already quantized: `xq4` is fp8_block.quantize_both's
  (q, s, q^T, s^T) of x zero-padded to (whole tiles of rows, whole 128s of K) (or quantize_gathered's,
  whose producer quantized them as it read). Returns (y (Mp, N) or (Mp, Np) where N is not whole 128-byte
  rows: out_dim, the residuals `blockwise_backward` takes: x^T and its 128 x 1 scales for wgrad, w as
  stored and its 128 x 128 scales for dgrad)."""
  g, k, n = w.shape
  kc, nc = copy_dim(k, "blockwise"), copy_dim(n, "blockwise")
  wq, wqt, sw = fp8_block.quantize_weights(w, impl=quant, padded=(kc, nc))  # padded as it reads: no bf16 copy
  # every FP8 copy named `quantization`, those the forward reads too (see _gmm_fwd)
  (xq, sx, xqt, sxt), (wq, wqt, sw) = parts.tag_quantized(*xq4), parts.tag_quantized_weights(wq, wqt, sw)
  y = ragged_rows_matmul(xq, wqt, group_sizes, out_dtype=out_dtype, config=configs.fwd, sms=sms, block_scales=(sx, sw),
                         n_out=out_dim(n, nc, out_dtype))
  return y, (xqt, sxt, wq, sw)


def blockwise_backward(res, dyq4, group_sizes, x_dtype, w_dtype, configs: GemmConfigs, sms, k: int, n: int):
  """(dx (Mp, K), dw (G, K, N)) of the blockwise GEMM of true dims K, N from `blockwise_forward`'s
  residuals and the incoming gradient already quantized (dyq4 as xq4, over (Mp, Np)): dy in E4M3 too (the
  recipe), 1 x 128 blocks along N for dgrad, 128 x 1 of dy^T for wgrad. dgrad reads w as stored, (G, K, N) =
  (G, Nout, C): its weight block (k-block of C = N, column block of K) is sw's (K block, N block) swapped.
  An output dim that is not whole 128-byte rows comes back padded (out_dim), for the caller to slice."""
  xqt, sxt, wq, sw = res
  dyq, sdy, dyqt, sdyt = dyq4
  kc, nc = wq.shape[1:]
  dx = ragged_rows_matmul(dyq, wq, group_sizes, out_dtype=x_dtype, config=configs.dgrad, sms=sms,
                          block_scales=(sdy, jnp.swapaxes(sw, 1, 2)), n_out=out_dim(k, kc, x_dtype))
  dw = ragged_contract_matmul(xqt, dyqt, group_sizes, out_dtype=w_dtype, config=configs.wgrad, sms=sms,
                              block_scales=(sxt, sdyt), out_dims=(k, out_dim(n, nc, w_dtype)))
  return dx, dw
