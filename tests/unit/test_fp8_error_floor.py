"""bench/fp8_error_floor.py's layer, on CPU at tiny dims: its hand-written backward is autodiff's,
its recipe sites are fp8_block's quantizers, and its best-scale blocks never round worse than the
recipe's."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import fp8_error_floor as floor  # noqa: E402  # pylint: disable=wrong-import-position
import moe_layer  # noqa: E402  # pylint: disable=wrong-import-position

HIDDEN, FFN, EXPERTS, TOKENS, TOP_K = 256, 128, 4, 96, 2


def problem():
  key = jax.random.key(3)
  ids, weights = moe_layer.skewed_routing(key, EXPERTS, TOKENS, TOP_K)
  k = jax.random.split(key, 4)
  x = jax.random.normal(k[0], (TOKENS, HIDDEN))
  wi = jax.random.normal(k[1], (EXPERTS, HIDDEN, 2 * FFN)) * HIDDEN**-0.5
  wo = jax.random.normal(k[2], (EXPERTS, FFN, HIDDEN)) * FFN**-0.5
  cot = jax.random.normal(k[3], (TOKENS, HIDDEN))
  return ids, weights, x, wi, wo, cot


def test_the_written_out_layer_is_autodiffs_float32_layer():
  ids, weights, x, wi, wo, cot = problem()
  groups = floor.expert_rows(np.asarray(ids), EXPERTS)
  assert all(len(g) % 128 == 0 for g in groups)
  loads = np.bincount(np.asarray(ids).reshape(-1), minlength=EXPERTS)
  ref = moe_layer.float32_layer_vjp(ids, weights, EXPERTS, TOP_K, int(loads.max()))(x, wi, wo, cot)
  got = floor.layer_with(floor.variants()["float32"], x, wi, wo, cot, weights, groups, TOP_K)
  for g, r in zip(got, ref):
    assert g.shape == r.shape and moe_layer.rel_l2(g, r) < 1e-5
  quantized = floor.layer_with(floor.variants()["recipe"], x, wi, wo, cot, weights, groups, TOP_K)
  assert all(0.01 < moe_layer.rel_l2(g, r) < 0.1 for g, r in zip(quantized, ref))  # E4M3's few percent


def test_best_scaled_blocks_round_no_worse_than_the_recipe_and_stay_e4m3_values():
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((64, 384)) * 10.0 ** rng.uniform(-3, 3, (64, 1)), jnp.float32)
  recipe, best = floor.rows_q(a, "recipe"), floor.rows_q(a, "oracle")
  block_err = lambda q: np.sum(np.asarray(q - a).reshape(64, 3, 128) ** 2, axis=-1)  # noqa: E731
  assert (block_err(best) <= block_err(recipe) * (1 + 1e-6)).all() and (block_err(best) < block_err(recipe)).mean() > 0.5
  w = jnp.asarray(rng.standard_normal((2, 256, 256)), jnp.float32)
  werr = lambda q: float(jnp.sum((q - w) ** 2))  # noqa: E731
  assert werr(floor.weights_q(w, "oracle")) <= werr(floor.weights_q(w, "recipe"))
  np.testing.assert_array_equal(floor.cols_q(a, "recipe"), floor.rows_q(a.T, "recipe").T)
