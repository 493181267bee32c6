"""No silent drops: a bounded expert-parallel receive buffer that overflows is detected on device,
surfaced as MaxText's te_moe_* metrics, and stops the run with a clear error; the default
(worst-case) buffer never overflows, whatever the skew."""

from __future__ import annotations

import json
import os
import sys

import pytest

import runs
from conftest import HANG_S, SMOKE, xla_flags

HERE = os.path.dirname(os.path.dirname(__file__))  # tests/, where the helper modules live
FOUR_DEVICES = {"XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}

SKEW_PROBE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from parity_check import build, forward_and_grads
from conftest import maxtext_config

for factor in sys.argv[1:]:
  cfg = maxtext_config("te_moe_block=true", "dtype=float32", "weight_dtype=float32", "ici_expert_parallelism=4",
                       "ici_fsdp_parallelism=1", f"ragged_buffer_factor={factor}")
  layer, mesh = build(cfg, 0)
  bias = np.zeros(cfg.num_experts, np.float32); bias[:2] = 1e3  # every token picks experts 0 and 1 (device 0)
  layer.gate.bias[...] = jnp.asarray(bias)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 32, cfg.emb_dim)), jnp.float32)
  out, _, _, _, sown = forward_and_grads(layer, mesh, x, jnp.ones_like(x))
  named = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(sown)}
  pick = lambda k: [v.item() for n, v in named.items() if k in n][0]
  print("SKEW " + json.dumps({"factor": factor, "received": pick("te_moe_total_recv_tokens"),
                              "capacity": pick("te_moe_recv_capacity_per_rank"),
                              "overflow": pick("te_moe_capacity_overflow"), "finite": bool(jnp.isfinite(out).all())}))
"""


@pytest.fixture(scope="module")
def skew_probe(tmp_path_factory) -> dict[str, dict]:
  """{ragged_buffer_factor: what the layer reported}, both factors in one process (one start-up, one model) on 4
  host devices, forked like the file's training run (tests/runs.py's launch: MaxText imported once for both)."""
  factors, log = ("1.0", "-1"), tmp_path_factory.mktemp("skew") / "probe.log"
  tests_dir = {"PYTHONPATH": os.pathsep.join(filter(None, (HERE, os.environ.get("PYTHONPATH"))))}  # unforked: -c's path
  code = runs.launch([sys.executable, "-c", SKEW_PROBE, *factors], log, {**FOUR_DEVICES, **tests_dir}).wait(HANG_S)
  text = log.read_text(encoding="utf-8")
  rows = [json.loads(l[5:]) for l in text.splitlines() if l.startswith("SKEW ")]
  assert code == 0 and [r["factor"] for r in rows] == list(factors), text[-3000:]
  return {r["factor"]: r for r in rows}


def test_bounded_buffer_overflow_is_detected_under_extreme_skew(skew_probe):
  r = skew_probe["1.0"]  # each device may receive its balanced share, no more
  # 4 devices x 32 tokens x top-4 rows: device 0 owns experts 0-3 and is sent at least half of all rows.
  assert r["overflow"] is True and r["received"] > r["capacity"], r
  assert r["finite"], r


def test_worst_case_buffer_never_overflows_under_extreme_skew(skew_probe):
  r = skew_probe["-1"]
  assert r["overflow"] is False and r["received"] <= r["capacity"], r


def test_overflowing_training_stops_with_a_clear_error(tmp_path, smoke_data):
  """A training run, forked like the session's others (tests/runs.py's launch)."""
  proc = runs.launch([sys.executable, "-m", "temoe.cli", "train", SMOKE, f"base_output_directory={tmp_path}",
                      "run_name=overflow", f"grain_train_files={smoke_data}", "steps=3", "ici_expert_parallelism=4",
                      "ici_fsdp_parallelism=1", "per_device_batch_size=2", "ragged_buffer_factor=1.0",
                      "te_ep_overflow_check_every_n_steps=1"], tmp_path / "overflow.log", FOUR_DEVICES)
  code, log = runs.finish(proc, tmp_path, "overflow")
  assert code != 0
  assert "receive capacity overflow at training step 0" in log, log[-3000:]
