"""The FP8 recipes' MLP from tokens (`mosaic_tokens`: dispatch's gather and combine's backward fused
into the quantizers, blockwise and current scaling) against the same recipe unfused (dispatch ->
mosaic.mlp -> combine) and a float32 layer, on CPU in Pallas' GPU interpret mode: tiny shapes, logic only."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from compile_cache import persistent_cache
from temoe import recipes
from temoe.moe import block, dispatch, exchange
from temoe.moe.context import MoEContext
from temoe.moe.experts import fp8_block, fp8_quant, mosaic, mosaic_gemm, mosaic_tokens, xla

EXPERTS, EMB, FFN, TOKENS, TOP_K = 3, 128, 128, 96, 2
RECIPE = "te_fp8_blockwise"
RECIPES = ("te_fp8_blockwise", "te_fp8_current")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache():
  """Interpreted kernels' programs loaded, not compiled again (compile_cache)."""
  with persistent_cache():
    yield


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("recipe,float32_sum,fp8_weights", [(RECIPE, True, "remat"), ("te_fp8_current", False, "device")])
def test_tokens_mlp_matches_the_unfused_layer_and_float32(recipe, float32_sum, fp8_weights, monkeypatch):
  """Each scaling's kernels and quantizers and both weight sums (combine's XLA sum, the same code whichever
  scaling: the kernels see the same operands either way). The current scaling reads the forward's kept FP8
  weights here; its recast in the backward (remat) is mosaic_gemm.current_backward's other branch, which this
  path passes the setting to and test_mosaic_mlp shows bit-equal to the kept copies'; the blockwise GEMMs
  read no kept copy."""
  monkeypatch.setattr(mosaic_gemm, "num_sms", lambda: 4)
  align = recipes.row_alignment(recipe, "mosaic")
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.key(0), 5)
  ids = jnp.asarray(rng.choice([0, 2], (TOKENS, TOP_K)).astype(np.int32))  # expert 1 empty
  p = dispatch.plan(ids, EXPERTS, align)
  x = jax.random.normal(keys[0], (TOKENS, EMB)).astype(jnp.bfloat16)
  wi = (jax.random.normal(keys[1], (EXPERTS, EMB, 2 * FFN)) * EMB**-0.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(keys[2], (EXPERTS, FFN, EMB)) * FFN**-0.5).astype(jnp.bfloat16)
  weights = jax.nn.softmax(jax.random.normal(keys[3], (TOKENS, TOP_K)), axis=-1)
  cot = jax.random.normal(keys[4], (TOKENS, EMB))
  ctx = MoEContext(num_experts=EXPERTS, top_k=TOP_K, dtype=jnp.bfloat16, recipe=recipe, kernel="mosaic", align=align,
                   float32_weight_sum=float32_sum, fp8_weights=fp8_weights)
  none = (None, None, None)

  def fused(x, wi, wo, weights):
    return mosaic_tokens.mlp(ctx, x, p, weights, wi, wo)

  def unfused(x, wi, wo, weights, c=ctx, mlp=mosaic.mlp):
    y = mlp(c, dispatch.dispatch(x, p, TOP_K), p, wi, wo, none, None)
    return dispatch.combine(y, p, weights, float32_sum)

  def grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(cot.astype(out.dtype)))

  with plgpu.force_gpu_interpret_mode():
    got = grads(fused, x, wi, wo, weights)
    same_recipe = grads(unfused, x, wi, wo, weights)
  f32 = MoEContext(num_experts=EXPERTS, top_k=TOP_K, dtype=jnp.float32, float32_weight_sum=float32_sum)
  # float32 XLA, compared within bounds only: one jitted program (the recipe's two runs stay op by op, equal bit for bit)
  ref = jax.jit(lambda *f: grads(lambda *a: unfused(*a, c=f32, mlp=xla.mlp), *f))(
      *(a.astype(jnp.float32) for a in (x, wi, wo, weights)))
  assert got[0].dtype == same_recipe[0].dtype
  assert not np.asarray(got[2], np.float32)[1].any() and not np.asarray(got[3], np.float32)[1].any()  # empty expert
  fwd_bound, grad_bound = recipes.REGISTRY[recipe].error_bound
  for name, g, s, r in zip(("out", "dx", "dwi", "dwo", "dweights"), got, same_recipe, ref):
    assert g.shape == s.shape and g.dtype == s.dtype, name
    bound = fwd_bound if name == "out" else grad_bound
    assert rel(g, r) < bound, (name, rel(g, r))
    # the same recipe: the forward bitwise; the backward differs only where dy was rounded to bf16 first
    if name == "out":  # the same forward, to the bit
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(s, np.float32))
    else:  # the backward rounds dy once (to FP8) where the unfused layer rounds it to bf16 first
      assert rel(g, s) < bound / 2 and rel(g, r) < 1.05 * rel(s, r) + 1e-3, (name, rel(g, s), rel(g, r), rel(s, r))


def test_the_fused_gather_quantizes_what_dispatch_would_write(monkeypatch):
  monkeypatch.setattr(fp8_block, "INTERPRET", True)
  rng = np.random.default_rng(1)
  ids = jnp.asarray(rng.integers(0, EXPERTS, (TOKENS, TOP_K)).astype(np.int32))
  p = dispatch.plan(ids, EXPERTS, 128)
  x = jnp.asarray(rng.standard_normal((TOKENS, 256)) * 10.0 ** rng.uniform(-3, 3, (TOKENS, 1)), jnp.bfloat16)
  weights = jnp.asarray(rng.random((TOKENS, TOP_K)), jnp.float32)
  index = mosaic_tokens._slot_tokens(p.choice_of_slot, TOP_K, TOKENS, p.buffer_rows)  # pylint: disable=protected-access
  slot_weights = mosaic_tokens._slot_weights(p.choice_of_slot, weights, p.buffer_rows)  # pylint: disable=protected-access
  buffer = dispatch.dispatch(x, p, TOP_K)
  spare = np.asarray(p.choice_of_slot) == TOKENS * TOP_K
  assert spare.any() and (np.asarray(index)[spare] == TOKENS).all() and not np.asarray(slot_weights)[spare].any()
  scaled = buffer.astype(jnp.float32) * slot_weights[:, None]
  for weight, rows in ((None, buffer), (slot_weights, scaled)):
    want = fp8_block.quantize_both(rows, impl="xla")
    for impl in ("xla", "triton"):
      got = fp8_block.quantize_gathered(x, index, weight, impl=impl)
      for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_tokens_mlp_on_received_rows_with_empty_slots(monkeypatch):
  """The deduplicating exchange's receiver (`dedup`: rows with `slots` metadata slots, some empty, and a
  plan_expansion plan): mosaic_tokens.mlp(empty_choices=True) against its expansion -> mosaic.mlp ->
  weighted sum, the same recipe: the forward to the bit, gradients as close to float32; empty slots
  read zero rows and give their weights no gradient. One scaling: what empty_choices changes (the choices'
  rows, dx's sum over choices) is XLA code either scaling runs alike; each scaling's gathering quantizer
  reads padding slots in this file's quantizer tests, its kernels run in test_tokens_mlp_matches_the_unfused_layer."""
  recipe = "te_fp8_current"
  from temoe.moe.exchange import dedup_plan  # pylint: disable=import-outside-toplevel
  from temoe.moe.exchange.rowmaps import fan_out  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(mosaic_gemm, "num_sms", lambda: 4)
  rng = np.random.default_rng(3)
  rows, width, local = 136, 2, EXPERTS
  ids = np.zeros((rows, width), np.int64)  # local expert + 1; 0: an empty slot
  ids[:128, 0] = 3  # local expert 2: exactly one full 128-row tile, the buffer's last rows
  ids[:, 1] = rng.integers(0, 2, rows)  # local expert 0 or empty; local expert 1 empty
  ids[rows - 8:] = 0  # rows no one sent (the receive buffer's tail)
  ids = jnp.asarray(ids, jnp.int32)
  align = recipes.row_alignment(recipe, "mosaic")
  buffer = mosaic_gemm.tile_rows(int((np.asarray(ids) == 1).sum())) + 128  # no spare row: the last one is real
  gp = dedup_plan.plan_expansion(ids, local, align, buffer)
  assert (np.asarray(gp.slot_of_choice) == buffer).any() and int(gp.choice_of_slot[-1]) < rows * width
  keys = jax.random.split(jax.random.key(1), 5)
  x = jax.random.normal(keys[0], (rows, EMB)).astype(jnp.bfloat16)
  wi = (jax.random.normal(keys[1], (local, EMB, 2 * FFN)) * EMB**-0.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(keys[2], (local, FFN, EMB)) * FFN**-0.5).astype(jnp.bfloat16)
  weights = jnp.where(ids > 0, jax.nn.softmax(jax.random.normal(keys[3], (rows, width)), axis=-1), 0.0)
  cot = jax.random.normal(keys[4], (rows, EMB))
  ctx = MoEContext(num_experts=local, top_k=width, dtype=jnp.bfloat16, recipe=recipe, kernel="mosaic", align=align)
  none = (None, None, None)

  def unfused(x, wi, wo, weights, c=ctx, mlp=mosaic.mlp):  # dedup.run's expansion, MLP and weighted sum
    buf = fan_out(x, gp.choice_of_slot // width, gp.slot_of_choice.reshape(rows, width))
    y = mlp(c, buf, gp, wi, wo, none, None)
    per_pair = fan_out(y, gp.slot_of_choice, gp.choice_of_slot[:, None]).reshape(rows, width, -1)
    return dispatch.weighted_sum(per_pair, weights)

  def grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(cot.astype(out.dtype)))

  with plgpu.force_gpu_interpret_mode():
    got = grads(lambda *a: mosaic_tokens.mlp(ctx, a[0], gp, a[3], a[1], a[2], empty_choices=True), x, wi, wo, weights)
    same = grads(unfused, x, wi, wo, weights)
  f32 = MoEContext(num_experts=local, top_k=width, dtype=jnp.float32)
  # float32 XLA, compared within bounds only: one jitted program (the recipe's two runs stay op by op, equal bit for bit)
  ref = jax.jit(lambda *f: grads(lambda *a: unfused(*a, c=f32, mlp=xla.mlp), *f))(
      *(a.astype(jnp.float32) for a in (x, wi, wo, weights)))
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(same[0], np.float32))
  fwd_bound, grad_bound = recipes.REGISTRY[recipe].error_bound
  for name, g, s, r in zip(("out", "dx", "dwi", "dwo", "dweights"), got, same, ref):
    assert g.shape == s.shape and g.dtype == s.dtype, name
    assert rel(g, r) < (fwd_bound if name == "out" else grad_bound) and rel(g, r) < 1.05 * rel(s, r) + 1e-3, (
        name, rel(g, r), rel(s, r))
  empty = np.asarray(ids) == 0
  assert not np.asarray(got[4])[empty].any() and not np.asarray(got[1], np.float32)[rows - 8:].any()
  assert not np.asarray(got[2], np.float32)[1].any() and not np.asarray(got[3], np.float32)[1].any()


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_the_current_gathered_quantizer_is_quantize_rows_of_what_dispatch_would_write(impl, monkeypatch):
  """fp8_quant.quantize_gathered against quantize_rows of the buffer, bit for bit: x's rows (E4M3) and
  dy's (the tokens' gradient times each slot's routing weight, in fp32, E5M2); an empty expert, padding
  slots, rows over six decades, a NaN in one token (its experts' scales fall back to 1, as unfused). Each
  quantizer one jitted program, as in training (op by op, every primitive compiled on its own, costs more)."""
  monkeypatch.setattr(fp8_quant, "INTERPRET", True)
  rng = np.random.default_rng(2)
  ids = jnp.asarray(rng.choice([0, 2], (TOKENS, TOP_K)).astype(np.int32))  # expert 1 empty
  p = dispatch.plan(ids, EXPERTS, 128)
  tiles = mosaic_gemm.tile_groups(p.padded_group_sizes, p.buffer_rows // 128, 128)
  assert (np.asarray(tiles) == -1).any() or p.buffer_rows > sum(np.asarray(p.padded_group_sizes))
  for poison, cols in ((False, 256), (True, 256), (False, 200)):  # 200: the kernel's last column block masked
    x = rng.standard_normal((TOKENS, cols)) * 10.0 ** rng.uniform(-3, 3, (TOKENS, 1))
    if poison:
      x[5, 7] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    weights = jnp.asarray(rng.random((TOKENS, TOP_K)), jnp.float32)
    index = mosaic_tokens._slot_tokens(p.choice_of_slot, TOP_K, TOKENS, p.buffer_rows)  # pylint: disable=protected-access
    slot_weights = mosaic_tokens._slot_weights(p.choice_of_slot, weights, p.buffer_rows)  # pylint: disable=protected-access
    buffer = dispatch.dispatch(x, p, TOP_K)
    np.testing.assert_array_equal(np.asarray(fp8_block.gather_rows(x, index), np.float32),
                                  np.asarray(buffer, np.float32))
    for weight, rows, dtype in ((None, buffer, fp8_quant.E4M3),
                                (slot_weights, buffer.astype(jnp.float32) * slot_weights[:, None], fp8_quant.E5M2)):
      want = jax.jit(fp8_quant.quantize_rows, static_argnums=(2, 3, 4))(rows, tiles, EXPERTS, dtype, "xla")
      got = jax.jit(fp8_quant.quantize_gathered, static_argnums=(3, 4, 6))(x, index, tiles, EXPERTS, dtype, weight, impl)
      assert float(got[2][1]) == 1.0  # the empty expert
      sick = sorted(set(np.asarray(ids)[5].tolist())) if poison else []  # token 5's experts
      clean = ~np.isin(np.repeat(np.asarray(tiles), 128), sick)  # the rows of the other experts
      for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
      np.testing.assert_array_equal(np.asarray(got[0], np.float32)[clean], np.asarray(want[0], np.float32)[clean])
      np.testing.assert_array_equal(np.asarray(got[1], np.float32)[:, clean], np.asarray(want[1], np.float32)[:, clean])
      others = [e for e in range(EXPERTS) if e not in sick]
      np.testing.assert_array_equal(np.asarray(got[2])[others], np.asarray(want[2])[others])
      if poison:  # a NaN amax: scale 1, as a NaN-propagating max gives (numpy's; XLA:CPU's max over an fp32
        # buffer may skip the NaN, so the experts' rows are checked against the cast at numpy's scales)
        buf = np.asarray(rows, np.float32)
        amax = np.array([np.max(np.abs(buf[np.repeat(np.asarray(tiles), 128) == e]), initial=0.0) for e in sick])
        assert np.isnan(amax).all() and (np.asarray(got[2])[sick] == 1.0).all()
        row_scale = jnp.repeat(jnp.where(tiles >= 0, got[2][jnp.maximum(tiles, 0)], 1.0), 128)
        for g, w in zip(got[:2], fp8_quant._cast_transpose_xla(rows, row_scale, dtype)):  # pylint: disable=protected-access
          np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))  # NaN where NaN
        q = np.asarray(got[0], np.float32)[~clean]
        assert np.isnan(q).sum() == int((np.asarray(index) == 5).sum()) and np.isnan(q[:, 7]).sum() == np.isnan(q).sum()


def test_tokens_path_scalings_come_from_the_environment():
  assert mosaic_tokens.scalings_of(None) == {"blockwise", "current"}  # unset: both FP8 scalings
  assert mosaic_tokens.scalings_of("blockwise, current") == {"blockwise", "current"}
  assert mosaic_tokens.scalings_of("none") == set() and mosaic_tokens.scalings_of("") == set()
  with pytest.raises(ValueError, match="bf16 unknown; choose from blockwise, current"):
    mosaic_tokens.scalings_of("current,bf16")


def abstract_h200():
  """An abstract mesh on an H200, so Pallas' Triton backend lowers on a host without a GPU (its
  Python lowering to Triton IR; Triton's own compiler runs on the GPU: tests/gpu)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def test_the_triton_quantizers_lower_for_an_h200():
  S = jax.ShapeDtypeStruct
  with abstract_h200():
    for fn, args in (
        (lambda x: fp8_block.quantize_both(x, impl="triton"), (S((1024, 7168), jnp.bfloat16),)),
        (lambda w: fp8_block.quantize_weights(w, impl="triton"), (S((4, 7168, 4096), jnp.bfloat16),)),
        (lambda x, i: fp8_block.quantize_gathered(x, i, impl="triton"), (S((1000, 7168), jnp.bfloat16), S((8192,), jnp.int32))),
        (lambda g, i, w: fp8_block.quantize_gathered(g, i, w, True, impl="triton"),
         (S((1000, 7168), jnp.float32), S((8192,), jnp.int32), S((8192,), jnp.float32))),
        (lambda x, i, t: fp8_quant.quantize_gathered(x, i, t, 32, fp8_quant.E4M3, impl="triton"),
         (S((1000, 7168), jnp.bfloat16), S((8192,), jnp.int32), S((64,), jnp.int32))),
        (lambda g, i, t, w: fp8_quant.quantize_gathered(g, i, t, 32, fp8_quant.E5M2, w, impl="triton"),
         (S((1000, 2880), jnp.bfloat16), S((8192,), jnp.int32), S((64,), jnp.int32), S((8192,), jnp.float32))),
    ):
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert text.count("custom_call @__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_fused_layer_lowers_for_sm90(recipe):
  """Forward + backward of DeepSeek-V3's layer shape lowered for Hopper: six Mosaic GPU GEMMs (x's
  rows gathered by the quantizer: no other custom call; the quantizers here are XLA's, whose Triton
  kernels lower above)."""
  S = jax.ShapeDtypeStruct
  experts, emb, ffn, tokens, top_k = 32, 7168, 2048, 1024, 8
  ctx = MoEContext(num_experts=experts, top_k=top_k, dtype=jnp.bfloat16, recipe=recipe, kernel="mosaic", align=128)

  def loss(x, wi, wo, weights, ids):
    p = dispatch.plan(ids, experts, 128)
    return jnp.sum(mosaic_tokens.mlp(ctx, x, p, weights, wi, wo, quant="xla", sms=132).astype(jnp.float32) ** 2)

  args = (S((tokens, emb), jnp.bfloat16), S((experts, emb, 2 * ffn), jnp.bfloat16), S((experts, ffn, emb), jnp.bfloat16),
          S((tokens, top_k), jnp.float32), S((tokens, top_k), jnp.int32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  targets = re.findall(r"custom_call @([\w$.]+)", text)
  assert targets and all(t.startswith("mosaic_gpu") for t in targets) and len(targets) == 6, targets


def test_the_local_exchange_takes_the_tokens_path_only_where_it_applies(monkeypatch):
  calls = []
  original = mosaic_tokens.mlp
  monkeypatch.setattr(mosaic_tokens, "mlp", lambda *a, **k: calls.append(1) or original(*a, **k))
  S = jax.ShapeDtypeStruct
  args = (S((2, 48, EMB), jnp.bfloat16), S((2, 48, TOP_K), jnp.int32), S((2, 48, TOP_K), jnp.float32),
          S((EXPERTS, EMB, 2 * FFN), jnp.bfloat16), S((EXPERTS, FFN, EMB), jnp.bfloat16))
  bias = S((EXPERTS, EMB), jnp.bfloat16)

  def traced(recipe, scalings, biases=(None, None, None)):
    monkeypatch.setattr(mosaic_tokens, "SCALINGS", frozenset(scalings))
    calls.clear()
    ctx = MoEContext(num_experts=EXPERTS, top_k=TOP_K, dtype=jnp.bfloat16, recipe=recipe, kernel="mosaic",
                     align=recipes.row_alignment(recipe, "mosaic"))
    out, _ = jax.eval_shape(lambda *a: block.apply(ctx, *a[:5], biases=a[5:]), *args, *biases)
    assert out.shape == (2, 48, EMB) and out.dtype == jnp.bfloat16
    return len(calls)

  monkeypatch.setattr(mosaic_gemm, "num_sms", lambda: 4)
  default = mosaic_tokens.DEFAULT_SCALINGS
  assert traced(RECIPE, default) == 1
  assert traced(RECIPE, ()) == 0  # switched off: dispatch -> mosaic.mlp
  assert traced("te_fp8_current", default) == 1  # both FP8 scalings by default (measured faster on the H200)
  assert traced("te_fp8_current", ("blockwise",)) == 0  # TEMOE_TOKENS_MLP=blockwise: current through the buffer
  assert traced("te_no_quant", ("blockwise", "current")) == 0
  assert traced(RECIPE, default, (None, None, bias)) == 0  # row biases: mosaic.mlp


def test_the_deduplicating_exchange_takes_the_tokens_path_too(monkeypatch):
  """Under expert parallelism with the deduplicating exchange, the block hands each receiver's rows to the
  kernel's MLP from tokens (marking empty slots); the row-per-pair exchanges keep the buffer path."""
  calls = []

  def recorder(ctx, x, p, weights, wi, wo, **layout):  # which path the block takes; the math: tests above
    calls.append(layout)
    return jnp.zeros_like(x, ctx.dtype) * wo[0, 0, 0]  # (rows, emb), batched like x under vmap

  monkeypatch.setattr(mosaic_tokens, "mlp", recorder)
  monkeypatch.setattr(block, "expert_mlp", lambda ctx, x, p, wi, wo, biases: calls.append("buffer") or jnp.zeros_like(x))
  S = jax.ShapeDtypeStruct
  devices = 2
  args = (S((devices, 48, EMB), jnp.bfloat16), S((devices, 48, TOP_K), jnp.int32), S((devices, 48, TOP_K), jnp.float32),
          S((devices, EXPERTS, EMB, 2 * FFN), jnp.bfloat16), S((devices, EXPERTS, FFN, EMB), jnp.bfloat16))
  for name, taken in (("dedup", [{"empty_choices": True}]), ("padded", ["buffer"])):
    calls.clear()
    ctx = MoEContext(num_experts=devices * EXPERTS, top_k=TOP_K, dtype=jnp.bfloat16, recipe=RECIPE, kernel="mosaic",
                     align=128, ep_axis="ep", ep_size=devices)
    per_device = functools.partial(block._per_device, ctx, exchange.strategy(name))  # pylint: disable=protected-access
    out, _ = jax.eval_shape(jax.vmap(lambda *a: per_device(*a, None, None, None), axis_name="ep"), *args)
    assert out.shape == (devices, 48, EMB) and calls == taken, (name, calls)


@pytest.mark.parametrize("recipe", RECIPES)
def test_maxtexts_remat_names_reach_the_policy(recipe, monkeypatch, capsys):
  """moe_mlpwo is inside _down_combine's forward, moe_mlpwi_0/1 on _gate_up's output: a policy saving
  two of the names saves exactly those two (and nothing else of the layer's own)."""
  monkeypatch.setattr(mosaic_gemm, "num_sms", lambda: 4)
  ctx = MoEContext(num_experts=EXPERTS, top_k=TOP_K, dtype=jnp.bfloat16, recipe=recipe, kernel="mosaic", align=128)
  p = dispatch.plan(jnp.zeros((TOKENS, TOP_K), jnp.int32).at[:, 1].set(2), EXPERTS, 128)

  def layer(x, wi, wo, weights):
    return jnp.sum(mosaic_tokens.mlp(ctx, x, p, weights, wi, wo).astype(jnp.float32))

  policy = jax.checkpoint_policies.save_only_these_names("moe_mlpwo", "moe_mlpwi_0")
  args = (jnp.ones((TOKENS, EMB), jnp.bfloat16), jnp.ones((EXPERTS, EMB, 2 * FFN), jnp.bfloat16),
          jnp.ones((EXPERTS, FFN, EMB), jnp.bfloat16), jnp.ones((TOKENS, TOP_K)))
  jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(layer, policy=policy), *args)
  named = [line for line in capsys.readouterr().out.splitlines() if " named " in line]
  assert len(named) == 2 and any("'moe_mlpwo'" in n for n in named) and any("'moe_mlpwi_0'" in n for n in named), named
