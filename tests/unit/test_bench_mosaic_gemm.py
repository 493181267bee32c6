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


@pytest.mark.parametrize("scaling, shape, configs", [("none", "smoke", 1), ("none", "smoke64", 0),
                                                     ("current", "smoke64", 0), ("blockwise", "smoke64", 0)])
def test_sweep_matches_float32_in_every_gemm(scaling, shape, configs, monkeypatch):
  """Each GEMM's default config (swept first; on smoke also the list's first), on whole-128 dims and on
  dims of whole 64s (both FP8 scalings' copies padded to 128s; bf16's tiles past the end of N and K)."""
  monkeypatch.setattr(mz, "num_sms", lambda: 2)
  monkeypatch.setattr(bench, "timed", lambda fn, *args: (jax.block_until_ready(fn(*args)), 1.0)[1])  # no timing here
  p = bench.make_problem(shape)
  specs = bench.gemm_specs(p, bench.operands(p, jax.random.key(1)), scaling)
  assert set(specs) == {"gateup_fwd", "down_fwd", "gateup_dgrad", "down_dgrad", "gateup_wgrad", "down_wgrad"}
  first = {"none": bench.BF16_CONFIGS, "current": bench.ROWS_CONFIGS, "blockwise": bench.BLOCKWISE_CONFIGS}[scaling][:configs]
  pool = concurrent.futures.ThreadPoolExecutor(1)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    for name, spec in specs.items():
      res, best = bench.sweep_gemm(name, spec, p, first, pool, scaling)
      assert res["configs"][0]["config"] == res["default"]
      for rec in res["configs"]:
        assert rec.get("ok"), (name, rec)
        assert rec["rel_err_same_operands"] < 1e-2  # fp32 accumulation and bf16 output rounding only
      assert best is not None
      bound = 1e-2 if scaling == "none" else 0.1  # against float32 on the bf16 originals: the recipe's rounding
      assert res["best"]["recipe_rel_err_vs_bf16"] < bound, (name, res["best"])
  if scaling != "none":  # the 192-deep contractions ran on copies padded to 256, in 128-element k-blocks
    assert specs["gateup_fwd"][1].shape[1] == 256 and specs["down_fwd"][1].shape[1] == 256
