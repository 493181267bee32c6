"""DeepSeek-V3's block-scaled FP8 recipe (`te_fp8_blockwise`) on temoe's Hopper kernels, and temoe's
kernels on dims that are not multiples of 128.

Same loads and poisoning as tests/gpu/test_mosaic_kernels.py (random, skewed, empty experts, one
expert takes all; outputs written into NaN-filled buffers; spare rows NaN where a kernel must not read):

* the forward/dgrad and wgrad kernels with block scales against float32 math on exactly the operand
  values they are given (the recipe's numpy model: dequantised E4M3 times its block scales), by default
  and in the kernel options measured against it (VARIANTS: fresh accumulators issued with scale-d = 0,
  and DeepGEMM's structure on 160-wide tiles, its scales through shared or global memory);
* the Triton quantizers against the XLA expression of the same math (scales bit-equal; FP8 values
  equal but for rare one-step roundings, since the division is the GPU's), the gathering one too;
* the MLP from tokens with dispatch's gather and combine's backward fused into the quantizers
  (mosaic_tokens, blockwise and current scaling) against the unfused layer: the forward bit-equal,
  gradients as accurate; current scaling's gathering cast bit-equal to XLA's;
* grouped_matmul(scaling="blockwise") forward and both gradients against float32 on the bf16
  originals: within the registry's bound and at least as accurate as per-expert current scaling
  on the same inputs; spare rows and empty experts' dw exactly zero;
* its jitted forward + backward: three Mosaic GPU kernels, nothing that talks to the host;
* every scaling on dims that are not multiples of 128 (FP8: K, N = 720, 368, multiples of 16, its
  copies padded; bf16: 704, 320, multiples of 64): TMA's zero-filled loads and clipped stores, against
  float32.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.devices()[0].platform != "gpu" or getattr(jax.devices()[0], "compute_capability", "") != "9.0":
  pytest.skip("the Mosaic GPU grouped GEMMs need a Hopper (sm_90) GPU", allow_module_level=True)

# pylint: disable=wrong-import-position
from temoe import recipes
from temoe.moe.experts import fp8_block as fb
from test_mosaic_kernels import (  # the shared problem set of the Hopper kernel tests
    G, K, LOADS, N, ROWS, KERNEL_TOL, contract_kernel, f32, make_problem, nan_spare, per_group, poison_free_memory,
    reference, rel, rows_kernel, value_and_grads,
)

from temoe.moe.experts import mosaic_gemm as mz

FWD_BOUND, GRAD_BOUND = recipes.REGISTRY["te_fp8_blockwise"].error_bound
VARIANTS = {
    "default": None,
    "fresh": mz.TileConfig(block_m=128, block_n=128, stages=5, compute_wgs=2, grid_block_n=8, overlap=True, fresh=True),
    "deepgemm160": mz.TileConfig(block_m=128, block_n=160, stages=5, compute_wgs=2, grid_block_n=8, epi_n=32, fresh=True,
                                 col_scales=True),
    "deepgemm160_gmem_scales": mz.TileConfig(block_m=128, block_n=160, stages=5, compute_wgs=2, grid_block_n=8, epi_n=32,
                                             fresh=True, col_scales=True, gmem_scales=True),
}


def deq_rows(q, s):
  return f32(fb.dequantize_rows(q, s))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", LOADS)
@pytest.mark.parametrize("gemm", ["fwd", "dgrad"])
def test_block_scaled_rows_kernel(kind, gemm, variant, record_property):
  x, w, sizes, _, cot = make_problem(kind)
  used = int(sizes.sum())
  a_src = x if gemm == "fwd" else cot.astype(jnp.bfloat16)
  aq, sa, _, _ = fb.quantize_both(a_src)
  wq, wqt, sw = fb.quantize_weights(w)
  b, sb = (wqt, sw) if gemm == "fwd" else (wq, jnp.swapaxes(sw, 1, 2))
  av, wv = deq_rows(aq, sa), f32(fb.dequantize_weights(wq, sw))
  bv = wv if gemm == "fwd" else wv.transpose(0, 2, 1)  # (G, C, Nout)
  aq = nan_spare(aq, used)
  poison = jnp.full((ROWS, b.shape[1]), jnp.nan, jnp.bfloat16)
  y = f32(rows_kernel(aq, b, sizes, out=poison, block_scales=(sa, sb), config=VARIANTS[variant]))
  ref = np.zeros_like(y)
  per_group(sizes, lambda g, r: ref.__setitem__(r, av[r] @ bv[g]))
  assert np.isfinite(y).all(), "NaN in the output: an unwritten element or a read of a spare row"
  assert not y[used:].any(), "spare rows must be exactly zero"
  err = rel(y, ref)
  print(f"block-scaled ragged_rows {gemm} {kind} {variant}: rel. error vs the recipe's float32 model {err:.2e}")
  record_property("rel_err", err)
  assert err < KERNEL_TOL


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", LOADS)
def test_block_scaled_contract_kernel(kind, variant, record_property):
  x, _, sizes, _, cot = make_problem(kind)
  used = int(sizes.sum())
  _, _, xqt, sxt = fb.quantize_both(x)
  _, _, dqt, sdt = fb.quantize_both(cot.astype(jnp.bfloat16))
  av, bv = deq_rows(xqt, sxt), deq_rows(dqt, sdt)  # (K, T), (N, T)
  poison = jnp.full((G, K, N), jnp.nan, jnp.bfloat16)
  dw = f32(contract_kernel(nan_spare(xqt, used, axis=1), nan_spare(dqt, used, axis=1), sizes, out=poison,
                           block_scales=(sxt, sdt), config=VARIANTS[variant]))
  ref = np.zeros_like(dw)
  per_group(sizes, lambda g, r: ref.__setitem__(g, av[:, r] @ bv[:, r].T))
  assert np.isfinite(dw).all()
  empty = np.flatnonzero(np.asarray(sizes) == 0)
  assert not dw[empty].any(), f"dw of empty experts {empty} must be exactly zero"
  err = rel(dw, ref)
  print(f"block-scaled ragged_contract wgrad {kind} {variant}: rel. error vs the recipe's float32 model {err:.2e}")
  record_property("rel_err", err)
  assert err < KERNEL_TOL


@pytest.mark.parametrize("pow2", [False, True])
def test_triton_quantizers_match_xla(pow2, record_property):
  x, w, _, _, _ = make_problem("skewed")
  x = x * jnp.logspace(-3, 3, K, dtype=jnp.float32).astype(jnp.bfloat16)  # blocks of very different ranges
  for got, want, what in (
      (fb.quantize_both(x, pow2, "triton"), fb.quantize_both(x, pow2, "xla"), "rows"),
      (fb.quantize_weights(w * 1e3, pow2, "triton"), fb.quantize_weights(w * 1e3, pow2, "xla"), "weights"),
  ):
    for g, e in zip(got, want):
      g, e = np.asarray(f32(g)), np.asarray(f32(e))
      assert g.shape == e.shape
      differ = float(np.mean(g != e))
      record_property(f"{what}_mismatch", differ)
      print(f"triton vs xla {what} pow2={pow2}: shape {g.shape}, fraction differing {differ:.2e}")
      # scales are a max and one multiply: exact; FP8 values may differ by one step where the GPU's
      # division rounds the other way
      assert differ <= 1e-3, (what, g.shape, differ)


def test_weights_padded_as_read_match_the_padded_copy():
  """Blockwise weights of dims that are not whole 128s (the 2880-dim layer's): the Triton quantizer reads w
  as it is, its last blocks masked, and writes the padded copies bit-equal to XLA's of the zero-padded w."""
  w = jax.random.normal(jax.random.key(5), (8, 2880, 2880), jnp.float32).astype(jnp.bfloat16)
  got = jax.jit(lambda a: fb.quantize_weights(a, impl="triton", padded=(2944, 2944)))(w)
  want = jax.jit(lambda a: fb.quantize_weights(jnp.pad(a, ((0, 0), (0, 64), (0, 64))), impl="xla"))(w)
  for g, e in zip(got, want):
    assert g.shape == e.shape
    np.testing.assert_array_equal(f32(g), f32(e))


def test_triton_gathered_quantizer_matches_xla(record_property):
  """dispatch's gather and combine's backward fused into the quantizer (mosaic_tokens): rows of x by
  token index, padding slots zero, optionally times a routing weight."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((1000, K)) * 10.0 ** rng.uniform(-3, 3, (1000, 1)), jnp.bfloat16)
  index = jnp.asarray(np.where(rng.random(ROWS) < 0.1, 1000, rng.integers(0, 1000, ROWS)), jnp.int32)
  weight = jnp.asarray(rng.random(ROWS), jnp.float32)
  for wt in (None, weight):
    for g, e in zip(fb.quantize_gathered(x, index, wt, impl="triton"), fb.quantize_gathered(x, index, wt, impl="xla")):
      g, e = np.asarray(f32(g)), np.asarray(f32(e))
      differ = float(np.mean(g != e))
      record_property(f"gathered_mismatch_{wt is not None}", differ)
      assert g.shape == e.shape and differ <= 1e-3, (g.shape, differ)


def test_triton_gathered_current_cast_matches_xla(record_property):
  """Current scaling's gathering cast (mosaic_tokens with TEMOE_TOKENS_MLP=...,current): x's rows by token
  index (E4M3) and dy's times a routing weight (E5M2), padding slots zero: bit-equal to XLA's (a multiply)."""
  from temoe.moe.experts import fp8_quant  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(4)
  tiles = ROWS // 128
  tile_expert = jnp.asarray(np.where(np.arange(tiles) < tiles - 2, np.arange(tiles) * G // tiles, -1), jnp.int32)
  for cols in (K, 2880):
    x = jnp.asarray(rng.standard_normal((1000, cols)) * 10.0 ** rng.uniform(-3, 3, (1000, 1)), jnp.bfloat16)
    index = jnp.asarray(np.where(rng.random(ROWS) < 0.1, 1000, rng.integers(0, 1000, ROWS)), jnp.int32)
    weight = jnp.asarray(rng.random(ROWS), jnp.float32)
    for wt, dtype in ((None, fp8_quant.E4M3), (weight, fp8_quant.E5M2)):
      got = fp8_quant.quantize_gathered(x, index, tile_expert, G, dtype, wt, impl="triton")
      want = fp8_quant.quantize_gathered(x, index, tile_expert, G, dtype, wt, impl="xla")
      for g, e in zip(got, want):
        g, e = np.asarray(f32(g)), np.asarray(f32(e))
        record_property(f"current_gathered_mismatch_{cols}_{wt is not None}", float(np.mean(g != e)))
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("recipe", ["te_fp8_blockwise", "te_fp8_current"])
def test_tokens_mlp_fused_matches_the_unfused_layer(recipe, record_property):
  """mosaic_tokens (the local exchange's fused path) against dispatch -> mosaic.mlp -> combine on the
  GPU: the forward to the bit, the gradients within the recipe's bound of each other and of float32."""
  from temoe.moe import dispatch  # pylint: disable=import-outside-toplevel
  from temoe.moe.context import MoEContext  # pylint: disable=import-outside-toplevel
  from temoe.moe.experts import mosaic, mosaic_tokens, xla  # pylint: disable=import-outside-toplevel

  experts, emb, ffn, tokens, top_k = 8, 1024, 512, 2048, 4
  keys = jax.random.split(jax.random.key(5), 6)
  ids = jax.random.randint(keys[0], (tokens, top_k), 0, experts - 1)  # the last expert empty
  weights = jax.nn.softmax(jax.random.normal(keys[1], (tokens, top_k)), axis=-1)
  x = jax.random.normal(keys[2], (tokens, emb)).astype(jnp.bfloat16)
  wi = (jax.random.normal(keys[3], (experts, emb, 2 * ffn)) * emb**-0.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(keys[4], (experts, ffn, emb)) * ffn**-0.5).astype(jnp.bfloat16)
  cot = jax.random.normal(keys[5], (tokens, emb))
  ctx = MoEContext(num_experts=experts, top_k=top_k, dtype=jnp.bfloat16, recipe=recipe, kernel="mosaic",
                   align=recipes.row_alignment(recipe, "mosaic"))
  fwd_bound, grad_bound = recipes.REGISTRY[recipe].error_bound
  f32ctx = MoEContext(num_experts=experts, top_k=top_k, dtype=jnp.float32)
  p = dispatch.plan(ids, experts, ctx.align)
  none = (None, None, None)

  def unfused(c, mlp):
    return lambda x, wi, wo, w: dispatch.combine(mlp(c, dispatch.dispatch(x, p, top_k), p, wi, wo, none, None), p, w)

  def grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(cot.astype(out.dtype)))

  def run(fn, *args):  # compiled, then brought to the host as float32
    return [f32(a) for a in jax.jit(lambda *a: grads(fn, *a))(*args)]

  got = run(lambda x, wi, wo, w: mosaic_tokens.mlp(ctx, x, p, w, wi, wo), x, wi, wo, weights)
  same = run(unfused(ctx, mosaic.mlp), x, wi, wo, weights)
  ref = run(unfused(f32ctx, xla.mlp), *(a.astype(jnp.float32) for a in (x, wi, wo, weights)))
  np.testing.assert_array_equal(got[0], same[0])
  for name, g, s, r in zip(("out", "dx", "dwi", "dwo", "dweights"), got, same, ref):
    assert np.isfinite(g).all(), name
    record_property(f"fused_rel_err_{name}", rel(g, r))
    record_property(f"unfused_rel_err_{name}", rel(s, r))
    print(f"tokens mlp {recipe} {name}: fused {rel(g, r):.3e}, unfused {rel(s, r):.3e} vs float32; apart {rel(g, s):.3e}")
    assert rel(g, r) < (fwd_bound if name == "out" else grad_bound) and rel(g, r) <= 1.05 * rel(s, r) + 1e-3, name
  assert not got[2][-1].any() and not got[3][-1].any()  # the empty expert's dwi, dwo


def mosaic_blockwise(x, w, sizes):
  return mz.grouped_matmul(x, w, sizes, scaling="blockwise")


def mosaic_current(x, w, sizes):
  return mz.grouped_matmul(x, w, sizes, scaling="current")


@pytest.mark.parametrize("kind", LOADS)
def test_blockwise_grouped_matmul_vs_float32_and_current(kind, record_property):
  x, w, sizes, real, cot = make_problem(kind)
  used = int(sizes.sum())
  fn = value_and_grads(mosaic_blockwise)
  jax.block_until_ready(fn(x, w, sizes, cot))
  poison_free_memory()
  y, dx, dw = (f32(a) for a in fn(x, w, sizes, cot))
  ry, rdx, rdw = reference(x, w, sizes, cot)
  for name, a in (("y", y), ("dx", dx), ("dw", dw)):
    assert np.isfinite(a).all(), f"{name} has non-finite values"
  assert not y[used:].any() and not dx[used:].any()
  empty = np.flatnonzero(np.asarray(sizes) == 0)
  assert not dw[empty].any()
  ours = {"y": rel(y[real], ry[real]), "dx": rel(dx[real], rdx[real]), "dw": rel(dw, rdw)}
  cy, cdx, cdw = (f32(a) for a in value_and_grads(mosaic_current)(x, w, sizes, cot))
  cur = {"y": rel(cy[real], ry[real]), "dx": rel(cdx[real], rdx[real]), "dw": rel(cdw, rdw)}
  print(f"grouped_matmul blockwise {kind}: rel. error vs float32 " + ", ".join(f"{k} {v:.3e}" for k, v in ours.items())
        + " | current scaling " + ", ".join(f"{k} {v:.3e}" for k, v in cur.items()))
  for k, v in ours.items():
    record_property(f"rel_err_{k}", v)
    record_property(f"current_rel_err_{k}", cur[k])
  assert ours["y"] < FWD_BOUND and max(ours["dx"], ours["dw"]) < GRAD_BOUND, ours
  for k in ours:
    assert ours[k] <= cur[k] * 1.05 + 1e-3, (k, ours, cur)


def test_blockwise_fwd_bwd_hlo_stays_on_device():
  x, w, sizes, _, cot = make_problem("skewed")
  text = value_and_grads(mosaic_blockwise).lower(x, w, sizes, cot).compile().as_text()
  kernels = re.findall(r'custom_call_target="(mosaic_gpu[^"]*)"', text)
  assert len(kernels) == 3, kernels
  targets = set(re.findall(r'custom_call_target="([^"]+)"', text))
  hostish = {t for t in targets if re.search(r"callback|host|python|cpu", t, re.I)}
  assert not hostish, hostish
  # no host transfer, and no while loop (XLA:GPU launches each iteration from the host)
  for pattern in (r"\bsend\(", r"\brecv\(", r"\binfeed\(", r"\boutfeed\(", r"S\(5\)", r"MoveToHost", r"MoveToDevice",
                  r"\bwhile\("):
    assert not re.search(pattern, text), pattern


@pytest.mark.parametrize("scaling, k, n", [
    ("none", 704, 320),  # whole 64s: bf16 reads them as stored, its last tiles run past N and K
    ("current", 704, 320),  # copies padded to 768 x 384 (the weights' as the cast reads them), outputs at the true dims
    ("current", 720, 368),  # multiples of 16: the same, outputs sliced
    ("blockwise", 704, 320),  # copies padded to 768 x 384, outputs written at the true dims
    ("blockwise", 720, 368),
])
def test_dims_that_are_not_multiples_of_128(scaling, k, n, record_property):
  x, w, sizes, real, cot = make_problem("skewed")
  x, w, cot = x[:, :k], w[:, :k, :n] * (K / k) ** 0.5, cot[:, :n]
  fn = value_and_grads(lambda a, b, s: mz.grouped_matmul(a, b, s, scaling=scaling))
  jax.block_until_ready(fn(x, w, sizes, cot))
  poison_free_memory()
  y, dx, dw = (f32(a) for a in fn(x, w, sizes, cot))
  xf, wf, cf = f32(x), f32(w), f32(cot)
  ry, rdx, rdw = np.zeros_like(y), np.zeros_like(dx), np.zeros_like(dw)

  def one(g, r):
    ry[r], rdx[r], rdw[g] = xf[r] @ wf[g], cf[r] @ wf[g].T, xf[r].T @ cf[r]

  per_group(sizes, one)
  used = int(sizes.sum())
  for name, a in (("y", y), ("dx", dx), ("dw", dw)):
    assert np.isfinite(a).all(), name
  assert not y[used:].any() and not dx[used:].any()
  errs = {"y": rel(y[real], ry[real]), "dx": rel(dx[real], rdx[real]), "dw": rel(dw, rdw)}
  print(f"grouped_matmul {scaling} K={k} N={n}: rel. error vs float32 " + ", ".join(f"{a} {v:.3e}" for a, v in errs.items()))
  for a, v in errs.items():
    record_property(f"rel_err_{a}", v)
  bound = {"none": (1e-2, 1e-2), "current": recipes.REGISTRY["te_fp8_current"].error_bound,
           "blockwise": (FWD_BOUND, GRAD_BOUND)}[scaling]
  assert errs["y"] < bound[0] and max(errs["dx"], errs["dw"]) < bound[1], errs
