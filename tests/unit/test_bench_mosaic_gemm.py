"""bench/mosaic_gemm.py's bf16 sweep (--scaling none) on CPU in Pallas' GPU interpret mode: each of
the six GEMMs runs the kernel in grouped_matmul's bf16 layouts and its float32 reference in the
reference's layouts, so a layout the bench maps wrongly shows up as a large error here."""

from __future__ import annotations

import concurrent.futures
import sys

import jax
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import mosaic_gemm as bench  # noqa: E402  # pylint: disable=wrong-import-position
from temoe.moe.experts import mosaic_gemm as mz  # noqa: E402  # pylint: disable=wrong-import-position


def test_bf16_sweep_matches_float32_in_every_gemm(monkeypatch):
  monkeypatch.setattr(mz, "num_sms", lambda: 2)
  monkeypatch.setattr(bench, "timed", lambda fn, *args: (jax.block_until_ready(fn(*args)), 1.0)[1])  # no timing here
  p = bench.make_problem("smoke")
  specs = bench.gemm_specs(p, bench.operands(p, jax.random.key(1)), "none")
  assert set(specs) == {"gateup_fwd", "down_fwd", "gateup_dgrad", "down_dgrad", "gateup_wgrad", "down_wgrad"}
  pool = concurrent.futures.ThreadPoolExecutor(1)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    for name, spec in specs.items():
      res, best = bench.sweep_gemm(name, spec, p, bench.BF16_CONFIGS[:1], pool)
      (rec,) = res["configs"]
      assert best is not None and rec["ok"], (name, rec)
      assert rec["rel_err_same_operands"] < 1e-2  # bf16 output rounding only
      assert res["best"]["recipe_rel_err_vs_bf16"] == pytest.approx(rec["rel_err_same_operands"])
