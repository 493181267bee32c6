"""temoe's MoE metrics reach MaxText's metrics file under `record_internal_nn_metrics=true`."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import pytest

from temoe.maxtext import metrics


def test_record_turns_per_layer_intermediates_into_scalars():
  loads = jnp.array([[6, 2, 0, 0], [2, 2, 2, 2]], jnp.int32)  # 2 MoE layers x 4 experts, scanned
  intermediates = {"decoder": {"moe": {
      metrics.EXPERT_LOAD: (loads,), metrics.ENTROPY: (jnp.array([0.5, 1.0]),), metrics.PADDING: (jnp.array([0.1, 0.3]),)}}}
  out = {"scalar": {}}
  metrics.record(out, intermediates, type("Cfg", (), {"num_experts": 4})())
  s = {k: float(v) for k, v in out["scalar"].items()}
  assert s["temoe/load_max_over_mean/moe_layer_000"] == 3.0 and s["temoe/load_max_over_mean/moe_layer_001"] == 1.0
  assert s["temoe/empty_experts/moe_layer_000"] == 2 and s["temoe/empty_experts"] == 2
  assert s["temoe/load_min/moe_layer_001"] == 2 and s["temoe/load_max_over_mean"] == 3.0
  assert s["temoe/router_entropy"] == pytest.approx(0.75) and s["temoe/padding_fraction"] == pytest.approx(0.2)
  assert s["temoe/expert_load/moe_layer_000/expert_000"] == 6


def test_router_entropy_bounds():
  uniform = jnp.full((2, 3, 8), 0.3)
  assert float(metrics.router_entropy(uniform)) == pytest.approx(math.log(8), rel=1e-6)
  one_hot = jnp.zeros((2, 3, 8)).at[..., 2].set(1.0)
  assert float(metrics.router_entropy(one_hot)) == 0.0


def test_training_logs_moe_metrics(profiled_smoke):
  """The session's profiled smoke run (conftest's profiled_smoke: `temoe profile`, 5 training steps with
  record_internal_nn_metrics=true) wrote temoe's per-layer MoE metrics in every row of MaxText's metrics file."""
  run, _ = profiled_smoke
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == list(range(5))
  routed_rows = 8 * 64 * 4  # global batch x sequence x top-4, every one counted once
  for row in rows:
    for layer in range(2):  # the smoke model's two MoE layers
      loads = [row[f"temoe/expert_load/moe_layer_{layer:03d}/expert_{e:03d}"] for e in range(16)]
      assert sum(loads) == routed_rows
      assert row[f"temoe/load_max_over_mean/moe_layer_{layer:03d}"] == pytest.approx(max(loads) / (routed_rows / 16))
      assert 0 < row[f"temoe/router_entropy/moe_layer_{layer:03d}"] <= math.log(16) + 1e-6
      assert row[f"temoe/padding_fraction/moe_layer_{layer:03d}"] == 0.0  # the xla backend pads nothing
