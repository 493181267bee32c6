"""The opt-in non-finite guard names the MoE layer whose output or incoming gradient is not finite."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import maxtext_config
from parity_check import build, forward_and_grads
from temoe.maxtext import adapter

COMMON = ("dtype=float32", "weight_dtype=float32", "te_moe_check_finite=true", "scan_layers=false")


def layer_and_input(seed=0):
  cfg = maxtext_config(*COMMON)
  layer, mesh = build(cfg, seed)
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((2, 16, cfg.emb_dim)), jnp.float32)
  return layer, mesh, x


def test_finite_values_pass():
  layer, mesh, x = layer_and_input()
  out, *_ = forward_and_grads(layer, mesh, x, jnp.ones_like(x))
  assert bool(jnp.isfinite(out).all())


def test_nan_in_output_names_the_layer():
  layer, mesh, x = layer_and_input()
  layer.wo[...] = layer.wo[...].at[0, 0, 0].set(jnp.nan)
  layer.gate.bias[...] = jnp.zeros_like(layer.gate.bias[...]).at[0].set(1e3)  # every token uses expert 0
  with pytest.raises(Exception, match=r"non-finite values in the output of MoE layer \d+"):
    forward_and_grads(layer, mesh, x, jnp.ones_like(x))


def test_inf_in_gradient_names_the_layer():
  layer, mesh, x = layer_and_input()
  cotangent = jnp.ones_like(x).at[0, 0, 0].set(jnp.inf)
  with pytest.raises(Exception, match=r"non-finite values in the gradient of MoE layer \d+"):
    forward_and_grads(layer, mesh, x, cotangent)


def test_scanned_layers_are_reported_as_the_stack():
  cfg = maxtext_config("dtype=float32", "te_moe_check_finite=true", "scan_layers=true")
  layer, _ = build(cfg, 0)
  assert "scanned MoE layers" in adapter.layer_name(layer)
