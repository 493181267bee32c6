"""The `mosaic` expert kernel (temoe's Hopper grouped GEMMs behind the expert-MLP contract) against
the xla reference, on CPU in Pallas' GPU interpret mode: tiny shapes, logic only (speed: tests/gpu)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from compile_cache import persistent_cache
from temoe import recipes
from temoe.moe import dispatch
from temoe.moe.context import MoEContext
from temoe.moe.experts import mosaic, mosaic_gemm, xla

EXPERTS, EMB, FFN, TOKENS, TOP_K = 3, 128, 128, 96, 2


@pytest.fixture(scope="module", autouse=True)
def _compile_cache():
  """Interpreted kernels' programs loaded, not compiled again (compile_cache)."""
  with persistent_cache():
    yield


@pytest.mark.parametrize("recipe", ["te_no_quant", "te_fp8_current", "te_fp8_blockwise"])
def test_mosaic_mlp_matches_xla_in_interpret_mode(recipe, monkeypatch):
  """Forward and gradients against float32 within the recipe's bounds, spare rows and the empty expert zero;
  te_fp8_current with te_moe_fp8_weights=remat (the backward casts the weights again from the forward's
  scales) and with device (it reads the forward's FP8 copies): the same output and gradients, bit for bit. Each
  forward and backward is one jitted program, as in training (op by op, every primitive compiled on its own, cost
  a fifth more CPU)."""
  monkeypatch.setattr(mosaic_gemm, "num_sms", lambda: 4)  # a CPU device reports no SMs: a 4-SM persistent grid
  align = recipes.row_alignment(recipe, "mosaic")
  keys = jax.random.split(jax.random.key(0), 4)
  ids = jnp.asarray(np.random.default_rng(0).choice([0, 2], (TOKENS, TOP_K)).astype(np.int32))  # expert 1 empty
  p = dispatch.plan(ids, EXPERTS, align)
  x = dispatch.dispatch(jax.random.normal(keys[0], (TOKENS, EMB)).astype(jnp.bfloat16), p, TOP_K)
  wi = (jax.random.normal(keys[1], (EXPERTS, EMB, 2 * FFN)) * EMB**-0.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(keys[2], (EXPERTS, FFN, EMB)) * FFN**-0.5).astype(jnp.bfloat16)
  ctx = MoEContext(num_experts=EXPERTS, top_k=TOP_K, dtype=jnp.bfloat16, recipe=recipe, kernel="mosaic", align=align)
  ref_ctx = MoEContext(num_experts=EXPERTS, top_k=TOP_K, dtype=jnp.float32)
  none = (None, None, None)

  def loss(mlp, c, x, wi, wo):
    y = mlp(c, x, p, wi, wo, none, None)
    return jnp.sum(y[p.slots].astype(jnp.float32) ** 2), y

  with plgpu.force_gpu_interpret_mode():
    (_, y), grads = jax.jit(jax.value_and_grad(lambda *a: loss(mosaic.mlp, ctx, *a), argnums=(0, 1, 2), has_aux=True))(x, wi, wo)
    if recipe == "te_fp8_current":
      kept = dataclasses.replace(ctx, fp8_weights="device")
      (_, y_kept), grads_kept = jax.jit(jax.value_and_grad(lambda *a: loss(mosaic.mlp, kept, *a), argnums=(0, 1, 2),
                                                   has_aux=True))(x, wi, wo)
      assert np.asarray(grads[1], np.float32).any()
      for a, b in zip((y, *grads), (y_kept, *grads_kept)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  f32 = [a.astype(jnp.float32) for a in (x, wi, wo)]
  (_, ref_y), ref_grads = jax.jit(jax.value_and_grad(lambda *a: loss(xla.mlp, ref_ctx, *a), argnums=(0, 1, 2),
                                                     has_aux=True))(*f32)
  slots = np.asarray(p.slots)
  spare = np.arange(int(p.padded_group_sizes.sum()), p.buffer_rows)
  assert not np.asarray(y, np.float32)[spare].any(), "spare rows past the last group are not zero"
  assert not np.asarray(grads[1], np.float32)[1].any() and not np.asarray(grads[2], np.float32)[1].any()
  fwd_bound, grad_bound = recipes.REGISTRY[recipe].error_bound

  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)

  assert rel(np.asarray(y, np.float32)[slots], np.asarray(ref_y)[slots]) < fwd_bound
  for g, r in zip(grads, ref_grads):
    assert rel(np.asarray(g, np.float32), np.asarray(r)) < grad_bound

