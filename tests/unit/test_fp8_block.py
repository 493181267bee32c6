"""DeepSeek-V3's block-scaled FP8 recipe (temoe.moe.experts.fp8_block) and its kernels, on CPU.

* the scale layouts against a numpy model of the recipe (1 x 128 activation blocks, 128 x 1 blocks of
  the transpose, 128 x 128 weight blocks; amax / 448, power-of-two rounding up, all-zero blocks,
  partial blocks at the ends, saturation);
* the Triton quantizers (Pallas' generic interpreter) against the XLA expression: scales and
  power-of-two quantization bit for bit, fp32-scaled values but for rare one-step roundings;
* the block-scaled kernels (forward/dgrad and wgrad forms, with and without `overlap`, and the options
  measured against them: 160-wide tiles with per-column scales, scales read from global memory) in
  Pallas' GPU interpret mode against the numpy model, into NaN-poisoned outputs, with race detection;
* grouped_matmul(scaling="blockwise") forward and gradients against the numpy model on dims that are
  not multiples of 128;
* every scaling's fwd + bwd lowers for sm_90 ahead of time on CPU (layout inference, TMA tiling), on
  the shapes the registry admits, and dims it refuses fail with one line.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from temoe import recipes
from temoe.moe.experts import fp8_block as fb
from temoe.moe.experts import mosaic_gemm as mz

INTERPRET = plgpu.InterpretGPUParams()
CFG = mz.TileConfig(block_m=128, block_n=128, stages=3, compute_wgs=2, grid_block_n=2)


# ------------------------------------------------------------------------------ numpy model


def np_scale(amax, pow2=False):
  s = np.where(amax > 0, amax.astype(np.float32) * np.float32(1 / 448), np.float32(1)).astype(np.float32)
  if pow2:
    s = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
  return s


def np_e4m3(v):
  return np.clip(v, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def np_quantize_rows(x, pow2=False):
  """(q values, scales (Cb, R)) of 1 x 128 blocks: the recipe as written in its docstring."""
  r, c = x.shape
  cb = -(-c // 128)
  s = np.zeros((cb, r), np.float32)
  q = np.zeros((r, c), np.float32)
  for j in range(cb):
    blk = x[:, j * 128:(j + 1) * 128].astype(np.float32)
    s[j] = np_scale(np.abs(blk).max(axis=1), pow2)
    q[:, j * 128:(j + 1) * 128] = np_e4m3(blk / s[j][:, None])
  return q, s


def np_quantize_weights(w, pow2=False):
  g, k, n = w.shape
  kb, nb = -(-k // 128), -(-n // 128)
  s = np.zeros((g, kb, nb), np.float32)
  q = np.zeros((g, k, n), np.float32)
  for e in range(g):
    for i in range(kb):
      for j in range(nb):
        blk = w[e, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].astype(np.float32)
        s[e, i, j] = np_scale(np.abs(blk).max(), pow2)
        q[e, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = np_e4m3(blk / s[e, i, j])
  return q, s


def assert_e4m3_close(got, want):
  """FP8 values equal but for rare one-step roundings: XLA may compute x / s one ulp away from numpy,
  which moves a value sitting on a rounding tie to the other neighbour."""
  got, want = f32(got), np.asarray(want, np.float32)
  differ = got != want
  assert differ.mean() <= 1e-3, differ.mean()
  step = np.maximum(np.abs(want), 2.0**-6) * 2.0**-3  # E4M3's spacing (subnormals: 2^-9)
  assert (np.abs(got - want)[differ] <= step[differ] * 1.0001).all()


def deq_rows(q, s):
  return q * np.repeat(s.T, 128, axis=1)[:, :q.shape[1]]


def deq_weights(q, s):
  return q * np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)[:, :q.shape[1], :q.shape[2]]


def f32(a):
  return np.asarray(jnp.asarray(a).astype(jnp.float32))


def rel(a, ref):
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def operand(rng, shape, spread=3.0):
  """bf16 values whose rows span several orders of magnitude, a zero row and an outlier."""
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-spread, spread, shape[:-1] + (1,))
  x[..., 3, :] = 0.0
  x[..., 5, 7] = 1e4
  return jnp.asarray(x, jnp.bfloat16)


# ------------------------------------------------------------------------------ scale layouts


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])  # whole tiles; partial blocks at both ends
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_both_matches_the_numpy_model(shape, pow2):
  x = operand(np.random.default_rng(0), shape)
  q, s, qt, st = jax.jit(fb.quantize_both, static_argnums=(1, 2))(x, pow2, "xla")
  assert q.dtype == qt.dtype == jnp.float8_e4m3fn and s.dtype == st.dtype == jnp.float32
  r, c = shape
  assert q.shape == (r, c) and s.shape == (-(-c // 128), r) and qt.shape == (c, r) and st.shape == (-(-r // 128), c)
  xf = f32(x)
  mq, ms = np_quantize_rows(xf, pow2)
  np.testing.assert_array_equal(f32(s), ms)
  assert_e4m3_close(q, mq)
  mqt, mst = np_quantize_rows(xf.T, pow2)  # 128 x 1 blocks of x = 1 x 128 blocks of x^T
  np.testing.assert_array_equal(f32(st), mst)
  assert_e4m3_close(qt, mqt)
  assert (f32(s)[:, 3] == 1).all()  # an all-zero block: scale 1, values 0
  assert np.abs(f32(q)).max() <= 448
  if pow2:
    assert (np.log2(f32(s)) == np.round(np.log2(f32(s)))).all()
  # dequantised, every block is within E4M3's relative rounding of x
  assert rel(deq_rows(f32(q), f32(s)), xf) < 0.04


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_weights_matches_the_numpy_model(pow2):
  w = operand(np.random.default_rng(1), (3, 256, 200))
  q, qt, s = jax.jit(fb.quantize_weights, static_argnums=(1, 2))(w, pow2, "xla")
  mq, ms = np_quantize_weights(f32(w), pow2)
  assert s.shape == (3, 2, 2)
  np.testing.assert_array_equal(f32(s), ms)
  assert_e4m3_close(q, mq)
  np.testing.assert_array_equal(f32(qt), f32(q).transpose(0, 2, 1))  # one set of scales for w and w^T


@pytest.mark.parametrize("variant, pow2", [("divide", False), ("recip+bf16amax", False), ("recip+bf16amax", True)])
def test_triton_quantizers_match_xla_in_interpret_mode(pow2, variant, monkeypatch):
  """Each arithmetic form (fp8_block.RECIPROCAL, AMAX_IN_INPUT_DTYPE; the shipped one last) in both
  implementations, the gathering kernel (padding slots) too. The flags are independent branches (the cast's
  division, the kernels' amax dtype, scale_of's rounding): the shipped form with both scale roundings, and the
  form with both flags off (the bench's "divide") with fp32 scales, where the arithmetic differs (with
  power-of-two scales every form divides exactly). So each flag runs both ways with fp32 scales; the bench's
  third form ("recip": RECIPROCAL alone) adds no branch: the amax is exact in either dtype (abs and max round
  nothing), so AMAX_IN_INPUT_DTYPE hands the cast the same scales whichever division RECIPROCAL picks."""
  monkeypatch.setattr(fb, "INTERPRET", True)
  monkeypatch.setattr(fb, "RECIPROCAL", "recip" in variant)
  monkeypatch.setattr(fb, "AMAX_IN_INPUT_DTYPE", "bf16amax" in variant)
  rng = np.random.default_rng(2)
  x = operand(rng, (256, 384))
  w = operand(rng, (2, 256, 384))
  index = jnp.asarray(rng.permutation(np.r_[np.arange(200), np.full(56, 200)]), jnp.int32)  # 56 padding slots
  for got, want in ((fb.quantize_both(x, pow2, "triton"), fb.quantize_both(x, pow2, "xla")),
                    (fb.quantize_gathered(x[:200], index, None, pow2, "triton"),
                     fb.quantize_gathered(x[:200], index, None, pow2, "xla")),
                    (fb.quantize_weights(w, pow2, "triton"), fb.quantize_weights(w, pow2, "xla")),
                    # weights of dims that are not whole blocks, padded as the kernel reads them (masked
                    # loads), against XLA's quantizer of the zero-padded copy
                    (fb.quantize_weights(w[:, :200, :300], pow2, "triton", padded=(256, 384)),
                     fb.quantize_weights(jnp.pad(w[:, :200, :300], ((0, 0), (0, 56), (0, 84))), pow2, "xla"))):
    for g, e in zip(got, want):
      assert g.shape == e.shape and g.dtype == e.dtype
      if g.dtype == jnp.float32 or pow2:  # scales, and values divided by powers of two: exact
        np.testing.assert_array_equal(f32(g), f32(e))
      else:  # on the GPU bit-equal (tests/gpu); CPU's two divisions may round a tie apart
        assert_e4m3_close(g, f32(e))
  with pytest.raises(ValueError, match="multiples of 128"):
    fb.quantize_both(x[:, :200], pow2, "triton")
  with pytest.raises(ValueError, match="multiples of 128"):
    fb.quantize_weights(w, pow2, "triton", padded=(256, 400))
  with pytest.raises(ValueError, match="smaller than"):
    fb.quantize_weights(w, pow2, "triton", padded=(128, 384))
  with pytest.raises(ValueError, match="choose one of auto, xla, triton"):
    fb.quantize_both(x, pow2, "cuda")


# ------------------------------------------------------------------------------ kernels (interpret)


# The kernels' operands quantized by XLA's form, one jitted program a shape: the same values, bit for bit, as op
# by op, where every primitive of the quantizer compiled on its own for each shape (~2 CPU-s of these tests).
quantize_both_xla = jax.jit(lambda x: fb.quantize_both(x, impl="xla"))
quantize_weights_xla = jax.jit(lambda w: fb.quantize_weights(w, impl="xla"))

SIZES = np.array([128, 0, 256, 128], np.int32)  # 512 of 640 rows: an empty expert, a spare tile
ROWS, USED = 640, 512


def per_group(fn, sizes=SIZES):
  start = 0
  for g, s in enumerate(sizes):
    fn(g, slice(start, start + int(s)))
    start += int(s)


@pytest.mark.parametrize("overlap", [False, True])
def test_block_scaled_rows_kernel_into_a_poisoned_buffer_without_races(overlap):
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(3)
  x = operand(rng, (ROWS, 384)).at[USED:].set(0)  # 3 k-blocks: one pair and a single with overlap
  w = jnp.asarray(rng.standard_normal((4, 384, 256)) * 384**-0.5, jnp.bfloat16)
  xq, sx, _, _ = quantize_both_xla(x)
  _, wqt, sw = quantize_weights_xla(w)
  poison = jnp.full((ROWS, 256), jnp.nan, jnp.bfloat16)
  cfg = dataclasses.replace(CFG, overlap=overlap)
  with plgpu.force_gpu_interpret_mode(dataclasses.replace(INTERPRET, detect_races=True)):
    y = jax.jit(lambda a, b, sa, sb: mz.ragged_rows_matmul(a, b, jnp.asarray(SIZES), config=cfg, sms=1, out=poison,
                                                           block_scales=(sa, sb)))(xq, wqt, sx, sw)
  assert not interpret_pallas_call.get_races().races_found
  y = f32(y)
  xd = deq_rows(*np_quantize_rows(f32(x)))
  wd = deq_weights(*np_quantize_weights(f32(w)))
  ref = np.zeros_like(y)
  per_group(lambda g, r: ref.__setitem__(r, xd[r] @ wd[g]))
  assert np.isfinite(y).all() and not y[USED:].any()
  assert rel(y, ref) < 4e-3  # fp32 promotion and bf16 output rounding only


@pytest.mark.parametrize("overlap", [False, True])
def test_block_scaled_contract_kernel_matches_the_numpy_model(overlap):
  rng = np.random.default_rng(4)
  x = operand(rng, (ROWS, 256)).at[USED:].set(0)
  dy = jnp.asarray(rng.standard_normal((ROWS, 384)), jnp.bfloat16).at[USED:].set(0)
  _, _, xqt, sxt = quantize_both_xla(x)
  _, _, dqt, sdt = quantize_both_xla(dy)
  poison = jnp.full((4, 256, 384), jnp.nan, jnp.bfloat16)
  cfg = dataclasses.replace(CFG, overlap=overlap)
  with plgpu.force_gpu_interpret_mode(INTERPRET):
    dw = jax.jit(lambda a, b, sa, sb: mz.ragged_contract_matmul(a, b, jnp.asarray(SIZES), config=cfg, sms=2, out=poison,
                                                                block_scales=(sa, sb)))(xqt, dqt, sxt, sdt)
  dw = f32(dw)
  xtd = deq_rows(*np_quantize_rows(f32(x).T))  # (K, T) with 128 x 1 token blocks
  dtd = deq_rows(*np_quantize_rows(f32(dy).T))
  ref = np.zeros_like(dw)
  per_group(lambda g, r: ref.__setitem__(g, xtd[:, r] @ dtd[:, r].T))
  assert np.isfinite(dw).all() and not dw[1].any()  # expert 1 is empty: exactly zero
  assert rel(dw, ref) < 4e-3


# The kernel options measured against today's (bench/mosaic_gemm.py --variants), on a tiny problem: 384 rows
# (experts of 128, 0 and 128 rows, a spare tile), 2 k-blocks, 288 columns: 160-wide tiles [0, 160) and
# [160, 320) each straddle two 128-wide weight blocks, and the second runs past the last column. Variant (b),
# the DeepGEMM structure: wait, then promote with B's scales per column (col_scales), fresh accumulators
# (scale-d = 0 once lowered; the same math here); with gmem_scales the scales come from global memory.
DEEPGEMM = mz.TileConfig(block_m=128, block_n=160, stages=2, compute_wgs=2, grid_block_n=2, epi_n=32, fresh=True,
                         col_scales=True)
VARIANTS = {
    "deepgemm160": DEEPGEMM,
    "deepgemm160_gmem_scales": dataclasses.replace(DEEPGEMM, gmem_scales=True),
    "fresh128_gmem_scales": dataclasses.replace(CFG, stages=2, epi_n=32, fresh=True, gmem_scales=True),  # a tile: one weight scale
}
SMALL = np.array([128, 0, 128], np.int32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_options_rows_kernel_matches_the_numpy_model(variant):
  rng = np.random.default_rng(6)
  x = operand(rng, (384, 256)).at[256:].set(0)
  w = operand(rng, (3, 256, 288), spread=1.0)  # weight blocks of different ranges, so a wrong column's scale shows
  xq, sx, _, _ = quantize_both_xla(x)
  _, wqt, sw = quantize_weights_xla(w)
  poison = jnp.full((384, 288), jnp.nan, jnp.bfloat16)
  cfg = VARIANTS[variant]
  with plgpu.force_gpu_interpret_mode(INTERPRET):
    y = jax.jit(lambda a, b, sa, sb: mz.ragged_rows_matmul(a, b, jnp.asarray(SMALL), config=cfg, sms=2, out=poison,
                                                           block_scales=(sa, sb)))(xq, wqt, sx, sw)
  y = f32(y)
  xd, wd = deq_rows(*np_quantize_rows(f32(x))), deq_weights(*np_quantize_weights(f32(w)))
  ref = np.concatenate([xd[:128] @ wd[0], xd[128:256] @ wd[2], np.zeros((128, 288), np.float32)])
  assert np.isfinite(y).all() and not y[256:].any()
  assert rel(y, ref) < 4e-3


@pytest.mark.parametrize("variant", ["deepgemm160", "deepgemm160_gmem_scales"])
def test_kernel_options_contract_kernel_matches_the_numpy_model(variant):
  rng = np.random.default_rng(7)
  x = operand(rng, (384, 256)).at[256:].set(0)
  dy = jnp.asarray(rng.standard_normal((384, 288)), jnp.bfloat16).at[256:].set(0)
  _, _, xqt, sxt = quantize_both_xla(x)
  _, _, dqt, sdt = quantize_both_xla(dy)
  poison = jnp.full((3, 256, 288), jnp.nan, jnp.bfloat16)
  cfg = VARIANTS[variant]
  with plgpu.force_gpu_interpret_mode(INTERPRET):
    dw = jax.jit(lambda a, b, sa, sb: mz.ragged_contract_matmul(a, b, jnp.asarray(SMALL), config=cfg, sms=2,
                                                                out=poison, block_scales=(sa, sb)))(xqt, dqt, sxt, sdt)
  dw = f32(dw)
  xtd, dtd = deq_rows(*np_quantize_rows(f32(x).T)), deq_rows(*np_quantize_rows(f32(dy).T))
  ref = np.stack([xtd[:, :128] @ dtd[:, :128].T, np.zeros((256, 288), np.float32), xtd[:, 128:256] @ dtd[:, 128:256].T])
  assert np.isfinite(dw).all() and not dw[1].any()
  assert rel(dw, ref) < 4e-3


def test_blockwise_grouped_matmul_on_dims_that_are_not_multiples_of_128():
  """On SMALL's experts (one empty; a group over two row tiles is the kernels' own tests' above): the interpreted
  kernels' time grows with the rows, so as few as keep a spare tile. One problem meets both ways an output dim
  that is not whole 128s comes back (out_dim): K = 208 (multiples of 16 only) is written padded to 256 and
  sliced (dx); N = 320 (whole 64s) is written at 320, the last tiles' stores clipped (y, and dw at 208 x 320:
  rows and columns of the wgrad form). The copies are padded to 256 x 384; the 300 rows are a partial tile past
  the experts' 256. It replaces (300, 208, 160) and (384, 192, 320), which met half of this each: the kernels
  clip or write whole tiles alike whichever GEMM they run, so what those added (an output of whole tiles then
  sliced; dx clipped at K = 192; rows of whole tiles, where the row padding is a no-op) runs here or in the
  kernels' tests above."""
  m, k, n = 300, 208, 320
  rows, used = 384, int(SMALL.sum())
  rng = np.random.default_rng(5)
  x = operand(rng, (m, k), spread=1.0).at[used:].set(0)
  w = jnp.asarray(rng.standard_normal((len(SMALL), k, n)) * k**-0.5, jnp.bfloat16)
  cot = jnp.asarray(rng.standard_normal((m, n)), jnp.float32).at[used:].set(0)
  cfgs = mz.GemmConfigs(CFG, dataclasses.replace(CFG, compute_wgs=1, overlap=True), CFG)

  def loss(x, w):
    y = mz.grouped_matmul(x, w, jnp.asarray(SMALL), scaling="blockwise", configs=cfgs, sms=2, quant="xla")
    return jnp.sum(y.astype(jnp.float32) * cot), y

  with plgpu.force_gpu_interpret_mode(INTERPRET):
    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  y, dx, dw = f32(y), f32(dx), f32(dw)
  assert y.shape == (m, n) and dx.shape == (m, k) and dw.shape == (len(SMALL), k, n)
  assert not y[used:].any() and not dx[used:].any() and not dw[1].any()
  pad = lambda a: np.pad(a, ((0, rows - m), (0, 0)))
  xf, cf = pad(f32(x)), pad(f32(cot.astype(jnp.bfloat16)))
  xd, xtd = deq_rows(*np_quantize_rows(xf)), deq_rows(*np_quantize_rows(xf.T)).T
  cd, ctd = deq_rows(*np_quantize_rows(cf)), deq_rows(*np_quantize_rows(cf.T)).T
  wd = deq_weights(*np_quantize_weights(f32(w)))
  ry, rdx, rdw = np.zeros((rows, n)), np.zeros((rows, k)), np.zeros((len(SMALL), k, n))

  def one(g, r):
    ry[r], rdx[r], rdw[g] = xd[r] @ wd[g], cd[r] @ wd[g].T, xtd[r].T @ ctd[r]

  per_group(one, SMALL)
  for name, got, ref in (("y", y, ry[:m]), ("dx", dx, rdx[:m]), ("dw", dw, rdw)):
    assert rel(got, ref) < 4e-3, (name, rel(got, ref))
  # the recipe's plain-JAX forward (one jitted program: the same values as op by op, a compile per op fewer)
  jax_ref = f32(jax.jit(fb.reference_grouped_matmul)(x, w, jnp.asarray(SMALL)))
  assert rel(jax_ref, ry[:m]) < 1e-6 and rel(y, jax_ref) < 4e-3
  # and against float32 on the originals: E4M3's rounding, no worse than a per-GEMM error of 0.04
  xo, wo = f32(x), f32(w)
  ty = np.zeros((m, n))
  per_group(lambda g, r: ty.__setitem__(r, xo[r] @ wo[g]), SMALL)
  assert rel(y, ty) < 0.04


# ------------------------------------------------------------------------------ lowering, shapes


@pytest.mark.parametrize("scaling", mz.SCALINGS)
def test_every_scaling_lowers_for_sm90_on_the_shapes_the_registry_admits(scaling):
  """Forward, dgrad and wgrad in one program per shape (the primal is the forward rule's first output, so the
  forward lowered here is the one a no-grad call lowers): one trace and one lowering a shape."""
  S = jax.ShapeDtypeStruct
  multiple = recipes.MOSAIC_DIM_MULTIPLE[scaling]

  def fwd_and_grads(x, w, s, c):
    def loss(x, w):
      y = mz.grouped_matmul(x, w, s, scaling=scaling, quant="xla", sms=132)
      return jnp.sum(y.astype(jnp.float32) * c), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return y, grads

  # DeepSeek-V3's gate/up GEMM stands for its down GEMM (2048, 7168) too: all three GEMMs take the same
  # TileConfigs (default_config: 256-wide row tiles, 128 x 256 wgrad tiles; for "blockwise" 128 x 128) on dims of
  # whole 128s (no padded copy, no clipped store), so the kernels lowered differ only in trip counts; both lower
  # again, in the fused layer, in test_mosaic_tokens.py::test_the_fused_layer_lowers_for_sm90 (the FP8 scalings).
  for k, n in ((7168, 4096), (2880, 5760), (64, 64), (32, 64), (720, 368), (704, 320)):
    if k % multiple or n % multiple:
      with pytest.raises(ValueError) as e:
        mz.check_shapes(k, n, scaling)
      assert "\n" not in str(e.value) and f"multiples of {multiple}" in str(e.value)
      continue
    args = (S((1000, k), jnp.bfloat16), S((4, k, n), jnp.bfloat16), S((4,), jnp.int32), S((1000, n), jnp.float32))
    text = jax.jit(fwd_and_grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    kernels = text.count("custom_call @mosaic_gpu")
    assert kernels == 3, (scaling, k, n, kernels)  # fwd, dgrad, wgrad


def test_block_scaled_configs_are_checked_before_lowering():
  a = jax.ShapeDtypeStruct((512, 256), mz.E4M3)
  b = jax.ShapeDtypeStruct((2, 256, 256), mz.E4M3)
  gs = jax.ShapeDtypeStruct((2,), jnp.int32)
  sa, sb = jax.ShapeDtypeStruct((2, 512), jnp.float32), jax.ShapeDtypeStruct((2, 2, 2), jnp.float32)
  for what, cfg in {"block_n dividing 128": mz.TileConfig(block_n=256), "promote must be 0": dataclasses.replace(CFG, promote=2)}.items():
    with pytest.raises(ValueError, match=what):
      jax.eval_shape(lambda a, b, g, sa, sb, cfg=cfg: mz.ragged_rows_matmul(a, b, g, config=cfg, sms=2,
                                                                            block_scales=(sa, sb)), a, b, gs, sa, sb)
  with pytest.raises(ValueError, match="block scales"):
    jax.eval_shape(lambda a, b, g, sa: mz.ragged_rows_matmul(a, b, g, config=CFG, sms=2, block_scales=(sa, sa)),
                   a, b, gs, sa)
