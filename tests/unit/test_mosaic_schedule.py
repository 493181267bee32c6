"""temoe's Mosaic GPU grouped GEMMs on CPU: the tile/group scheduling against numpy models, the
config checks, the FP8 scaling helpers, and the kernels themselves in Pallas' GPU interpret mode
(JAX 0.11.2 runs Mosaic GPU kernels on CPU, simulating SMEM, TMA, barriers and wgmma; allocations,
the output buffer included, start as NaN, so an element a kernel leaves unwritten reads NaN).

Interpret-mode shapes are tiny (a few 128-row tiles, 2-3 "SMs") so each SM walks several tiles and
the TMA ring wraps; performance is measured on the GPU only (tests/gpu/test_mosaic_kernels.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from temoe.moe.experts import fp8_quant as fq
from temoe.moe.experts import mosaic_gemm as mz

INTERPRET = plgpu.InterpretGPUParams()
# jitted once each: op-by-op dispatch would compile every primitive separately (slow on CPU)
tile_groups = jax.jit(mz.tile_groups, static_argnums=(1, 2))
contraction_schedule = jax.jit(mz.contraction_schedule, static_argnums=1)
tile_coords = jax.jit(mz.tile_coords, static_argnums=(1, 2, 3))
quantize_rows = jax.jit(fq.quantize_rows, static_argnums=(2, 3, 4))
quantize_experts = jax.jit(fq.quantize_experts, static_argnums=(1, 2))
CFG = mz.TileConfig(block_m=128, block_n=128, stages=2, compute_wgs=2, grid_block_n=2)


def f32(a) -> np.ndarray:
  """a's values as float32 numpy (ml_dtypes converts bf16 and FP8 exactly): no XLA convert compiled per shape."""
  return np.asarray(a).astype(np.float32)


def normal(key, shape):
  """jax.random.normal's values behind an optimization barrier: the scaling and casts that follow in the jitted
  helpers below do not fuse into it, so the values are those the same ops give op by op, bit for bit."""
  return jax.lax.optimization_barrier(jax.random.normal(key, shape))


def random_sizes(rng, groups: int, rows: int, empty: int = 0) -> np.ndarray:
  """Group sizes, multiples of 128, `empty` of them zero, summing to at most `rows`."""
  tiles = rows // 128
  cuts = np.sort(rng.integers(0, tiles + 1, groups - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [rng.integers(cuts[-1] if groups > 1 else 0, tiles + 1)]])) * 128
  sizes[rng.choice(groups, empty, replace=False)] = 0
  return sizes.astype(np.int32)


# ---------------------------------------------------------------------------------- schedules


def np_tile_groups(sizes, num_tiles, block_m):
  out = np.full(num_tiles, -1, np.int32)
  start = 0
  for g, n in enumerate(sizes):
    for r in range(start, start + n, block_m):
      out[r // block_m] = g
    start += n
  return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block_m", [64, 128])
def test_tile_groups_matches_numpy(seed, block_m):
  rng = np.random.default_rng(seed)
  sizes = random_sizes(rng, groups=int(rng.integers(1, 9)), rows=2048, empty=int(rng.integers(0, 2)))
  got = np.asarray(tile_groups(jnp.asarray(sizes), 2048 // block_m, block_m))
  np.testing.assert_array_equal(got, np_tile_groups(sizes, 2048 // block_m, block_m))


def test_tile_groups_edge_loads():
  # one expert takes all rows; all experts empty; groups exactly fill the buffer
  np.testing.assert_array_equal(np.asarray(tile_groups(jnp.array([0, 512, 0]), 4, 128)), [1, 1, 1, 1])
  np.testing.assert_array_equal(np.asarray(tile_groups(jnp.array([0, 0]), 3, 128)), [-1, -1, -1])
  np.testing.assert_array_equal(np.asarray(tile_groups(jnp.array([128, 0, 256]), 5, 128)), [0, 2, 2, -1, -1])


def test_schedules_compile_without_a_while_loop():
  """XLA:GPU runs a while loop from the host (each iteration launched, outside CUDA graphs), so the
  schedules every grouped GEMM computes on device must be loop-free."""
  sizes = jnp.asarray([256, 0, 1024, 128] * 8, jnp.int32)
  for fn in (lambda s: mz.tile_groups(s, 544, 128), lambda s: mz.contraction_schedule(s, 64)):
    text = jax.jit(fn).lower(sizes).compile().as_text()
    assert not re.search(r"\bwhile\(", text), text


@pytest.mark.parametrize("seed", range(2))
def test_expert_amax_matches_numpy(seed):
  rng = np.random.default_rng(seed)
  sizes = random_sizes(rng, groups=5, rows=1024, empty=1)
  x = rng.standard_normal((1024, 64)).astype(np.float32) * rng.uniform(0.1, 10, (1024, 1)).astype(np.float32)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  expect = [np.abs(x[starts[g]:starts[g + 1]]).max() if sizes[g] else 0.0 for g in range(5)]
  tiles = tile_groups(jnp.asarray(sizes), 8, 128)
  got = jax.jit(fq.expert_amax, static_argnums=2)(jnp.asarray(x), tiles, 5)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expect, np.float32))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("block_k", [64, 128])
def test_contraction_schedule_matches_numpy(seed, block_k):
  rng = np.random.default_rng(seed)
  sizes = random_sizes(rng, groups=7, rows=4096, empty=2)
  order, start, nblk = (np.asarray(a) for a in contraction_schedule(jnp.asarray(sizes), block_k))
  np.testing.assert_array_equal(order, sorted(range(7), key=lambda g: (-sizes[g], g)))  # largest first, stable
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  for g in range(7):
    assert start[g] * block_k == starts[g] and nblk[g] * block_k == sizes[g]
  # the blocks of all experts tile the used tokens exactly once
  blocks = np.concatenate([np.arange(start[g], start[g] + nblk[g]) for g in range(7)])
  np.testing.assert_array_equal(np.sort(blocks), np.arange(sizes.sum() // block_k))


@pytest.mark.parametrize("grid_m,grid_n,band", [(5, 7, 2), (4, 4, 4), (3, 8, 3), (6, 1, 4), (1, 5, 8), (9, 6, 1)])
def test_tile_coords_is_a_banded_bijection(grid_m, grid_n, band):
  lin = np.arange(grid_m * grid_n)
  mi, ni = tile_coords(jnp.asarray(lin, jnp.int32), grid_m, grid_n, band)
  mi, ni = np.asarray(mi), np.asarray(ni)
  # numpy model: bands of `band` columns left to right, row-major inside a band
  expect = [(m, n) for b0 in range(0, grid_n, band) for m in range(grid_m) for n in range(b0, min(b0 + band, grid_n))]
  assert list(zip(mi.tolist(), ni.tolist())) == expect
  # the same function on Python ints (as the numpy model of one tile) agrees
  assert [mz.tile_coords(int(t), grid_m, grid_n, band) for t in lin] == expect


@pytest.mark.parametrize("num_tiles,sms", [(10, 3), (3, 8), (132 * 4 + 5, 132), (1, 1)])
def test_persistent_grid_covers_each_tile_once(num_tiles, sms):
  # the kernel's per-SM loop: SM s handles tiles s, s + sms, ... (n_local of them)
  seen = []
  for s in range(sms):
    n_local = (num_tiles - s + (sms - 1)) // sms
    seen += [s + i * sms for i in range(n_local)]
  assert sorted(seen) == list(range(num_tiles))


# ---------------------------------------------------------------------------------- config checks


def test_check_shapes_one_line_errors():
  for scaling in mz.SCALINGS:
    mz.check_shapes(7168, 4096, scaling)
    mz.check_shapes(2880, 2880, scaling)  # a multiple of 64, not of 128
  mz.check_shapes(720, 368, "current")  # FP8: multiples of 16 (its copies are padded)
  for scaling, k, n in [("none", 720, 4096), ("none", 7168, 100), ("current", 0, 128), ("blockwise", 100, 130)]:
    with pytest.raises(ValueError) as e:
      mz.check_shapes(k, n, scaling)
    msg = str(e.value)
    assert "\n" not in msg and "multiples of" in msg and "pad to" in msg, msg
  with pytest.raises(ValueError, match=r"\(none\) .*multiples of 64, got K=7000; pad to K=7040, N=4096"):
    mz.check_shapes(7000, 4096, "none")
  with pytest.raises(ValueError, match=r"multiples of 16, got K=7000; pad to K=7008"):
    mz.check_shapes(7000, 4096, "blockwise")


def test_default_config_divides_the_shapes():
  for form in ("rows", "contract"):
    for scaling in mz.SCALINGS:
      dtype = jnp.bfloat16 if scaling == "none" else mz.E4M3
      for n in (128, 384, 768, 1536, 2048, 4096, 7168):
        cfg = mz.default_config(form, scaling, n, 768 if form == "contract" else None)
        assert n % cfg.block_n == 0 and cfg.block_n % cfg.resolved_epi_n() == 0
        assert (cfg.block_m // cfg.compute_wgs) % 64 == 0
        assert cfg.smem_bytes(dtype, dtype, jnp.bfloat16, scaling == "blockwise") <= 227 * 1024
  # the least ceil(n / t) * (t + TILE_FIXED_COLUMNS): 2880 takes 256 (12 x 288 = 3456 against 23 x 160 =
  # 3680 for 128 and 45 x 96 = 4320 for 64), as does 2896 (3456 / 3680 / 4368); 320 takes 128 (480 for
  # 128 and for 64, the larger on a tie; 576 for 256); the wgrad form's rows the same way (2880 rows: 128)
  assert mz.TILE_FIXED_COLUMNS == 32
  assert mz.default_config("rows", "none", 2880).block_n == 256
  assert mz.default_config("rows", "current", 2896).block_n == 256
  assert mz.default_config("rows", "none", 320).block_n == 128
  wgrad = mz.default_config("contract", "none", 2880, 2880)
  assert (wgrad.block_m, wgrad.compute_wgs, wgrad.block_n) == (128, 2, 256)
  # an explicit current-scaling contraction over whole 64s but not 128s (an unpadded copy: grouped_matmul
  # pads its copies to 128s, recipes.mosaic_copy_dim): 64-element k-blocks, twice the stages
  for k, block_k in ((2880, 64), (2944, None), (7168, None)):
    cfg = mz.default_config("rows", "current", 4096, contract=k)
    assert cfg.block_k == block_k and cfg.stages == (8 if block_k else 4)
    assert cfg.smem_bytes(mz.E4M3, mz.E4M3, jnp.bfloat16) <= 227 * 1024
  assert mz.default_config("rows", "blockwise", 4096, contract=2880).block_k is None  # padded to 2944 instead


def test_bad_configs_are_rejected_before_lowering():
  a = jax.ShapeDtypeStruct((512, 256), mz.E4M3)
  b = jax.ShapeDtypeStruct((2, 256, 256), mz.E4M3)
  gs = jax.ShapeDtypeStruct((2,), jnp.int32)
  bad = {
      "SMEM": mz.TileConfig(block_n=256, stages=6),
      "multiple of 64": mz.TileConfig(block_m=64, compute_wgs=2),
      "ROW_ALIGNMENT": mz.TileConfig(block_m=256),
      "block_k": mz.TileConfig(block_k=96),
  }
  for what, cfg in bad.items():
    with pytest.raises(ValueError, match=what):
      jax.eval_shape(lambda a, b, g, cfg=cfg: mz.ragged_rows_matmul(a, b, g, config=cfg, sms=2), a, b, gs)
  with pytest.raises(ValueError, match="contraction dim contiguous"):
    jax.eval_shape(lambda a, b, g: mz.ragged_rows_matmul(a, b, g, b_contract_minor=False, sms=2), a, b, gs)


def test_kernels_lower_for_cuda_without_a_gpu():
  # Mosaic GPU lowers ahead of time for sm_90 on CPU (layout inference, SMEM budget): every operand
  # layout and kernel variant is checked here; the bf16 layouts' numerics run on the GPU
  # (tests/gpu/test_mosaic_kernels.py), interpret mode below covers the FP8 ones.
  S = jax.ShapeDtypeStruct
  gs = S((4,), jnp.int32)
  cases = [
      (lambda a, b, g, c: mz.ragged_rows_matmul(a, b, g, config=c, sms=132), S((1024, 7168), mz.E5M2),
       S((4, 2048, 7168), mz.E4M3), [mz.default_config("rows", "current", 2048), dataclasses.replace(CFG, promote=4, stages=5)]),
      (lambda a, b, g, c: mz.ragged_rows_matmul(a, b, g, b_contract_minor=False, config=c, sms=132),
       S((1024, 2048), jnp.bfloat16), S((4, 2048, 768), jnp.bfloat16), [mz.default_config("rows", "none", 768)]),
      (lambda a, b, g, c: mz.ragged_contract_matmul(a, b, g, a_contract_minor=False, b_contract_minor=False, config=c,
                                                    sms=132),
       S((1024, 2048), jnp.bfloat16), S((1024, 1536), jnp.bfloat16), [mz.default_config("contract", "none", 1536, 2048)]),
      (lambda a, b, g, c: mz.ragged_contract_matmul(a, b, g, config=c, sms=132), S((2048, 1024), mz.E4M3),
       S((768, 1024), mz.E5M2), [mz.default_config("contract", "current", 768, 2048),
                                 mz.TileConfig(block_m=256, block_n=128, stages=4, epi_n=64)]),
  ]
  for fn, a, b, cfgs in cases:
    for cfg in cfgs:
      low = jax.jit(lambda a, b, g, cfg=cfg, fn=fn: fn(a, b, g, cfg))
      text = low.trace(a, b, gs).lower(lowering_platforms=("cuda",)).as_text()
      assert text.count("mosaic_gpu") >= 1, cfg


# ---------------------------------------------------------------------------------- FP8 scaling


def test_quantize_rows_scales_each_expert_to_its_own_amax():
  sizes = jnp.array([128, 0, 256], jnp.int32)
  x = jnp.asarray(np.concatenate([np.full((128, 4), 2.0), np.full((256, 4), -0.5), np.full((128, 4), 9.0)]),
                  jnp.float32)  # last 128 spare
  xq, xqt, s = quantize_rows(x, tile_groups(sizes, 4, 128), 3, mz.E4M3, "xla")
  np.testing.assert_allclose(np.asarray(s), [448 / 2.0, 1.0, 448 / 0.5])  # empty expert: scale 1
  assert f32(xq)[0, 0] == 448 and f32(xq)[200, 0] == -448
  np.testing.assert_array_equal(f32(xqt), f32(xq).T)
  w = jnp.asarray(np.stack([np.arange(6.0).reshape(2, 3), np.zeros((2, 3))]), jnp.float32)
  wq, wqt, sw = quantize_experts(w, mz.E5M2, "xla")
  np.testing.assert_allclose(np.asarray(sw), [57344 / 5.0, 1.0])
  assert wq.shape == (2, 2, 3) and wqt.shape == (2, 3, 2)
  np.testing.assert_array_equal(f32(wqt), f32(wq).transpose(0, 2, 1))
  assert f32(wq)[0, 1, 2] == 57344


def test_cast_transpose_triton_kernel_matches_xla_in_interpret_mode(monkeypatch):
  """The Pallas Triton cast-transpose (Pallas' generic interpreter on CPU) writes the same FP8 values
  as the XLA expression in both layouts, saturating past the format's range."""
  monkeypatch.setattr(fq, "INTERPRET", True)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 128, 256)) * 300, jnp.bfloat16)
  scale = jnp.asarray(rng.uniform(0.5, 2.0, (2, 128)), jnp.float32)
  for dtype in (mz.E4M3, mz.E5M2):
    ours = jax.jit(fq.cast_transpose, static_argnums=(2, 3))(x, scale, dtype, "triton")
    ref = jax.jit(fq.cast_transpose, static_argnums=(2, 3))(x, scale, dtype, "xla")
    assert ours[0].shape == (2, 128, 256) and ours[1].shape == (2, 256, 128)
    for got, want in zip(ours, ref):
      np.testing.assert_array_equal(f32(got), f32(want))
    if dtype == mz.E4M3:  # |x * scale| reaches ~2,000 > 448: saturated, not NaN
      assert np.abs(f32(ours[0])).max() == 448
  with pytest.raises(ValueError, match="choose one of auto, xla, triton"):
    fq.cast_transpose(x, scale, mz.E4M3, "cuda")
  # columns that are not whole 128s (current scaling's unpadded copies): the last column block is masked,
  # bit-equal to XLA's for each way a block meets the columns' end. 192 columns in every block shape: a masked
  # tail after a whole block (the default 64 x 128), whole blocks (64 x 64: no mask), one block wider than all
  # the columns (32 x 256, with 32-row blocks); 200 and 16 in the default block only, a tail and a block wider
  # than all the columns again (the kernel's mask is one expression, program_id * block + arange < cols: the
  # other blocks' 200 and 16 are these same cases, a tail after whole blocks or one wider block).
  for cols, blocks in ((192, (fq.TRITON_BLOCK, (64, 64, 4), (32, 256, 4))), (200, (fq.TRITON_BLOCK,)),
                       (16, (fq.TRITON_BLOCK,))):
    part = x[:, :, :cols]
    assert fq.resolve("triton", part.shape) == "triton"
    ref = jax.jit(fq.cast_transpose, static_argnums=(2, 3))(part, scale, mz.E4M3, "xla")
    for block in blocks:
      ours = jax.jit(fq.cast_transpose, static_argnums=(2, 3, 4))(part, scale, mz.E4M3, "triton", block)
      assert ours[0].shape == (2, 128, cols) and ours[1].shape == (2, cols, 128)
      for got, want in zip(ours, ref):
        np.testing.assert_array_equal(f32(got), f32(want))
  with pytest.raises(ValueError, match="multiples of 64"):  # rows are whole blocks
    fq.resolve("triton", (2, 2880 + 16, 2880))
  # the weights' copies zero-padded as the kernel reads them (rows and columns past x's ends masked), as
  # a 2880-dim layer's are to whole 128s: bit-equal to XLA's cast of the padded copy, zeros past the ends
  for rows, cols, padded in ((100, 200, (128, 256)), (128, 192, (128, 256)), (72, 256, (128, 384))):
    part = x[:, :rows, :cols]
    ref = fq.cast_transpose(part, scale, mz.E4M3, "xla", padded=padded)
    ours = jax.jit(fq.cast_transpose, static_argnums=(2, 3, 4, 5))(part, scale, mz.E4M3, "triton", None, padded)
    assert ours[0].shape == (2, *padded) and ours[1].shape == (2, padded[1], padded[0])
    for got, want in zip(ours, ref):
      np.testing.assert_array_equal(f32(got), f32(want))
    assert not f32(ours[0])[:, rows:].any()
    assert not f32(ours[0])[:, :, cols:].any()
    # q^T alone (the forward's weight copy where the backward casts w_q again): the same bits, both forms
    for impl in ("triton", "xla"):
      alone = jax.jit(fq.cast_transposed, static_argnums=(2, 3, 4, 5))(part, scale, mz.E4M3, impl, None, padded)
      np.testing.assert_array_equal(f32(alone), f32(ref[1]))
  with pytest.raises(ValueError, match="smaller than"):
    fq.cast_transpose(x, scale, mz.E4M3, "xla", padded=(64, 256))


# ---------------------------------------------------------------------------------- kernels (interpret)


def np_rows(a, b, sizes, scales, b_contract_minor=True):
  a = f32(a).astype(np.float64)
  b = f32(b).astype(np.float64)
  if b_contract_minor:
    b = b.transpose(0, 2, 1)
  out, start = np.zeros((a.shape[0], b.shape[2])), 0
  for g, n in enumerate(sizes):
    out[start:start + n] = a[start:start + n] @ b[g] * scales[g]
    start += n
  return out


def rel(a, ref) -> float:
  a = f32(a).astype(np.float64)
  return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


SIZES = np.array([128, 0, 128, 128], np.int32)  # 384 of 512 rows: expert 1 empty, one spare tile
ROWS, USED = 512, 384
SCALES = np.array([0.5, 3.0, 2.0, 1.25], np.float32)


def test_kernel_writes_every_element_of_a_poisoned_buffer_without_races():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # pylint: disable=import-outside-toplevel

  # the forward form x (M, K) @ (w^T (G, N, K))^T, E4M3, two compute warpgroups, one SM walking all
  # tiles through a 2-stage ring
  a, b = jax.jit(lambda: (normal(jax.random.key(3), (ROWS, 128)).astype(mz.E4M3),
                          normal(jax.random.key(4), (4, 128, 128)).astype(mz.E4M3)))()  # one program
  poison = jnp.full((ROWS, 128), jnp.nan, jnp.bfloat16)
  with plgpu.force_gpu_interpret_mode(dataclasses.replace(INTERPRET, detect_races=True)):
    y = jax.jit(lambda a, b: mz.ragged_rows_matmul(a, b, jnp.asarray(SIZES), jnp.asarray(SCALES), config=CFG, sms=1,
                                                   out=poison))(a, b)
    y = f32(y)
  assert not interpret_pallas_call.get_races().races_found
  assert np.isfinite(y).all() and not y[USED:].any()
  assert rel(y, np_rows(a, b, SIZES, SCALES)) < 4e-3


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def operands(key, m: int, k: int, n: int, used: int, cot_dtype=jnp.float32):
  """x (m, k) bf16, w (4, k, n) bf16 (times k^-1/2) and a cotangent (m, n), x's and the cotangent's rows past
  `used` zero: jax.random's normals in one jitted program (the same values as op by op, where every op and
  shape compiles a program of its own)."""
  kx, kw, kc = jax.random.split(key, 3)
  x = normal(kx, (m, k)).astype(jnp.bfloat16).at[used:].set(0)
  w = (normal(kw, (4, k, n)) * k**-0.5).astype(jnp.bfloat16)
  return x, w, normal(kc, (m, n)).astype(cot_dtype).at[used:].set(0)


def per_group_reference(xs, ws, dys, sizes):
  """float64 y, dx, dw of the grouped matmul on the given (dequantised) operand values."""
  m, k = xs.shape
  n = ws.shape[2]
  y, dx, dw = np.zeros((m, n)), np.zeros((m, k)), np.zeros((len(sizes), k, n))
  start = 0
  for g, s in enumerate(sizes):
    rows = slice(start, start + s)
    y[rows], dx[rows], dw[g] = xs[rows] @ ws[g], dys[rows] @ ws[g].T, xs[rows].T @ dys[rows]
    start += s
  return y, dx, dw


@jax.jit
def fp8_operands(x, w, sizes, dy):
  """grouped_matmul's FP8 recipe on the operands: the dequantised E4M3 x, w and E5M2 dy values."""
  g, m = w.shape[0], x.shape[0]
  mp = -(-m // 128) * 128  # grouped_matmul pads the rows to whole tiles
  x, dy = (jnp.pad(a, ((0, mp - m), (0, 0))) for a in (x, dy))
  tiles = mz.tile_groups(sizes, mp // 128, 128)
  rg = jnp.repeat(jnp.clip(tiles, 0, g - 1), 128)
  xq, _, sx = fq.quantize_rows(x, tiles, g, mz.E4M3)
  wq, _, sw = fq.quantize_experts(w, mz.E4M3)
  dyq, _, sdy = fq.quantize_rows(dy.astype(jnp.bfloat16), tiles, g, mz.E5M2)
  f32 = lambda q: q.astype(jnp.float32)
  return (f32(xq) / sx[rg][:, None])[:m], f32(wq) / sw[:, None, None], (f32(dyq) / sdy[rg][:, None])[:m]


def test_grouped_matmul_fp8_forward_and_grads():
  m, k, n = 450, 128, 128  # 450 rows: padded to 512 inside, 384 routed
  sizes = jnp.asarray(SIZES)
  x, w, cot = operands(jax.random.key(5), m, k, n, USED)
  # two compute warpgroups forward (flushing its accumulator into fp32 every k-block) and wgrad,
  # one for dgrad (E5M2 x E4M3)
  cfgs = mz.GemmConfigs(dataclasses.replace(CFG, promote=1), dataclasses.replace(CFG, compute_wgs=1), CFG)

  def loss(x, w):
    y = mz.grouped_matmul(x, w, sizes, scaling="current", configs=cfgs, sms=2)
    return jnp.sum(y.astype(jnp.float32) * cot), y

  with plgpu.force_gpu_interpret_mode(INTERPRET):
    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  y, dx, dw = (f32(a) for a in (y, dx, dw))
  assert y.shape == (m, n) and dx.shape == (m, k) and dw.shape == (4, k, n)
  assert all(np.isfinite(a).all() for a in (y, dx, dw))
  assert not y[USED:].any() and not dx[USED:].any() and not dw[1].any()
  # the kernels must reproduce the FP8 recipe exactly, up to fp32 accumulation and bf16 output rounding
  ry, rdx, rdw = per_group_reference(*[np.asarray(a, np.float64) for a in fp8_operands(x, w, sizes, cot)], SIZES)
  for name, got, ref in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw)):
    assert rel(jnp.asarray(got), ref) < 4e-3, (name, rel(jnp.asarray(got), ref))


SMALL = np.array([128, 0, 128, 0], np.int32)
"""256 of 384 rows: two empty experts, one spare tile. For the tests about K and N (the interpreted kernels' time
grows with the rows: a fourth fewer than SIZES's 512)."""
SMALL_ROWS, SMALL_USED = 384, 256


def grouped_matmul_grads(scaling, x, w, cot, sms=2, sizes=SMALL):
  """(y, dx, dw) of grouped_matmul with its default tile configs, in interpret mode, as float32 numpy."""
  def loss(x, w):
    y = mz.grouped_matmul(x, w, jnp.asarray(sizes), scaling=scaling, sms=sms)
    return jnp.sum(y.astype(jnp.float32) * cot), y

  with plgpu.force_gpu_interpret_mode(INTERPRET):
    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  return tuple(f32(a) for a in (y, dx, dw))


def test_current_scaling_pads_its_copies_to_whole_128s_as_the_cast_reads_the_weights():
  """K = 192 and N = 320 are not whole 128s: current scaling's FP8 copies are zero-padded to 256 and 384
  (every GEMM contracts in 128-element k-blocks), the weights' by the cast as it reads them (no padded
  bf16 copy of w in the program), and the outputs come back at the true dims (the last tiles' stores
  clipped): still the recipe's result, exactly. The program's copies on SIZES's 512 rows (traced only), the
  numbers on SMALL's 384."""
  m, k, n = ROWS, 192, 320
  x, w, cot = operands(jax.random.key(6), m, k, n, USED)
  assert [mz.copy_dim(d, "current") for d in (k, n)] == [256, 384]
  assert mz.default_config("rows", "current", n, contract=256).block_k is None  # 128 FP8 elements
  grads = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(
      mz.grouped_matmul(x, w, jnp.asarray(SIZES), scaling="current", sms=2, quant="triton").astype(jnp.float32)),
      argnums=(0, 1)))
  program = str(grads.trace(x, w).jaxpr)  # the Triton kernels lower only on a GPU: their jaxpr here
  fp8_shapes = set(re.findall(r"f8_e(?:4m3fn|5m2)\[([0-9,]+)\]", program))
  assert {"4,256,384", "4,384,256", "512,256", "256,512", "512,384", "384,512"} <= fp8_shapes, fp8_shapes
  pads = re.findall(r"pad\[[^\]]*\] (\w+)", program)
  padded_shapes = {re.search(rf"\b{v}:(\w+\[[0-9,]+\])", program).group(1) for v in pads}
  assert "bf16[4,192,320]" not in padded_shapes, padded_shapes  # no padded bf16 copy of the weights:
  assert "bf16[4,256,384]" not in program  # the cast pads as it reads, the backward's cast pads its FP8 copy
  x, cot = x[:SMALL_ROWS].at[SMALL_USED:].set(0), cot[:SMALL_ROWS].at[SMALL_USED:].set(0)
  y, dx, dw = grouped_matmul_grads("current", x, w, cot)
  assert y.shape == (SMALL_ROWS, n) and dx.shape == (SMALL_ROWS, k) and dw.shape == (4, k, n)
  assert all(np.isfinite(a).all() for a in (y, dx, dw))
  assert not y[SMALL_USED:].any() and not dx[SMALL_USED:].any() and not dw[1].any() and not dw[3].any()
  ry, rdx, rdw = per_group_reference(*[np.asarray(a, np.float64) for a in fp8_operands(x, w, jnp.asarray(SMALL), cot)],
                                     SMALL)
  for name, got, ref in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw)):
    assert rel(jnp.asarray(got), ref) < 4e-3, (name, rel(jnp.asarray(got), ref))


def test_bf16_tiles_past_the_end_of_the_output_are_clipped():
  """N = 320 in 128-wide tiles, K = 192 in a 256-wide dgrad tile, wgrad rows in 64s: loads past the
  operands' ends read zeros, stores past the outputs' ends are dropped (bf16: operands as stored)."""
  m, k, n = SMALL_ROWS, 192, 320
  assert mz.default_config("rows", "none", n).block_n == 128 and mz.default_config("rows", "none", k).block_n == 256
  x, w, cot = operands(jax.random.key(7), m, k, n, SMALL_USED, jnp.bfloat16)
  y, dx, dw = grouped_matmul_grads("none", x, w, cot)
  assert all(np.isfinite(a).all() for a in (y, dx, dw))
  ry, rdx, rdw = per_group_reference(*[f32(a).astype(np.float64) for a in (x, w, cot)], SMALL)
  for name, got, ref in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw)):
    assert rel(jnp.asarray(got), ref) < 4e-3, (name, rel(jnp.asarray(got), ref))
