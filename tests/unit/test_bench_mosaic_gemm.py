"""bench/mosaic_gemm.py's sweep on CPU in Pallas' GPU interpret mode: each of the six GEMMs, in each scaling
(bf16, FP8 current, FP8 blockwise), runs the kernel in grouped_matmul's layouts and its float32 reference in
the reference's layouts, so a layout the bench maps wrongly shows up as a large error here. Logic only, on a
tiny problem: the kernels' own edge cases are tests/unit/test_mosaic_schedule.py's and test_fp8_block.py's,
and the full sweeps (every shape class and config, timed) run on the GPU (bench/run_gpu.sh's gemm stage)."""

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

TINY = dict(hidden=192, ffn=128, experts=2, tokens=32, top_k=1)
"""hidden of whole 64s (not 128s), ffn (and gate|up's 256) of whole 128s, so each scaling meets both kinds of
dim; 2 experts of 24 and 8 routed rows padded to one 128-row tile each, and a spare tile (384 rows)."""


@pytest.mark.parametrize("scaling, configs", [("none", 1), ("current", 0), ("blockwise", 0)])
def test_sweep_matches_float32_in_every_gemm(scaling, configs, monkeypatch):
  """Each GEMM's default config is swept first (bf16: the list's first beside it where that differs); every config's output matches float32 on the same operands, the best's matches float32 on the
  bf16 originals within the recipe's rounding, and the FP8 copies of the 192-deep contraction are padded to
  256 (128-element k-blocks) while the 128-deep one is used as it is."""
  monkeypatch.setattr(mz, "num_sms", lambda: 2)
  monkeypatch.setattr(bench, "timed_in_rounds", lambda calls, **_: [1.0] * len(calls))  # ran once when checked
  monkeypatch.setitem(bench.SHAPES, "tiny", TINY)
  p = bench.make_problem("tiny")
  assert p.rows == 384 and p.counts.tolist() == [24, 8], (p.rows, p.counts)
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
  if scaling != "none":  # the 192-deep contraction runs on a copy padded to 256, the 128-deep one as it is
    assert specs["gateup_fwd"][1].shape[1] == 256 and specs["down_fwd"][1].shape[1] == 128


def test_variant_configs_pass_the_kernels_checks_on_dsv3():
  """--variants' configs (today's block-scaled kernel and its options) against the kernels' static checks on
  DeepSeek-V3's six GEMMs as the sweep passes them, so none is lost to a config error on the GPU; each
  config once, the default first as the sweep puts it."""
  s = bench.SHAPES["dsv3"]
  h, f2 = s["hidden"], 2 * s["ffn"]
  rows = 69632  # the dsv3 dispatch buffer (tokens x top-8 + experts x 127, in 128-row tiles)
  gemms = [("rows", rows, f2, h), ("rows", rows, h, f2 // 2), ("rows", rows, h, f2), ("rows", rows, f2 // 2, h),
           ("contract", h, f2, rows), ("contract", f2 // 2, h, rows)]  # (form, out rows, out cols, contraction)
  names = [c.name() for c in bench.BLOCKWISE_VARIANTS]
  assert len(set(names)) == len(names) and bench.BLOCKWISE_VARIANTS[0] == mz.default_config("rows", "blockwise", f2)
  assert {c.fresh for c in bench.BLOCKWISE_VARIANTS} == {False, True}
  assert {c.block_n for c in bench.BLOCKWISE_VARIANTS if c.col_scales} >= {128, 160, 192}
  for cfg in bench.BLOCKWISE_VARIANTS:
    for form, m, n, k in gemms:
      mz._check_config(cfg, mz.E4M3, mz.E4M3, jax.numpy.bfloat16, m, n, k, form, True)  # pylint: disable=protected-access


def test_variants_need_the_block_scaled_sweep(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["mosaic_gemm.py", "--variants", "--scaling", "current"])
  with pytest.raises(SystemExit):
    bench.main()
  assert "--variants sweeps the block-scaled kernels' options: add --scaling blockwise" in capsys.readouterr().err
