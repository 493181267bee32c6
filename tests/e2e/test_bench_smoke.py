"""The GPU benchmarks' code paths on this CPU at tiny widths (--smoke): each bench forked from the session's fork
server (tests/scripts.py: MaxText imported already), each path trains in its own process (forked from the bench's:
bench/bench_common_smoke.py), the proxy at two
depths with its per-layer time, the small model on the learnable stream
with its loss ratio and a profiled path. The numbers mean nothing here; the structure and the
arithmetic between runs are what is checked."""

from __future__ import annotations

import json

import pytest

import scripts
from conftest import HANG_S, ROOT


RUN_TIMEOUT = ("--timeout", str(HANG_S))
"""Each bench's limit per training run (150-240 s by default, for a GPU) is the suite's hang guard: a loaded 2-core
machine took longer than 150 s for a smoke run, and a run cut short is an error row, not a measurement."""


def bench(script: str, out, *args: str) -> dict:
  done = scripts.run(ROOT / "bench" / script, "--smoke", "--out", str(out), *RUN_TIMEOUT, *args)
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  return json.loads((out / script.replace(".py", ".json")).read_text())


def test_proxy_runs_a_path_at_two_depths_and_reports_its_marginal_layer(tmp_path):
  result = bench("proxy_1gpu.py", tmp_path, "--paths", "temoe_fp8", "--layers", "2,3", "--steps", "5")
  shallow, deep = result["paths"]["temoe_fp8@2"], result["paths"]["temoe_fp8"]
  for row in (shallow, deep):
    assert "error" not in row, row
    assert row["tokens_per_s"] > 0 and row["steps_measured"] == 2 and row["wall_s"] > 0, row
  per_layer = result["marginal"]["temoe_fp8"]
  assert per_layer["layers"] == [2, 3]
  assert per_layer["ms"] == pytest.approx(1e3 * (deep["step_time_s"] - shallow["step_time_s"]))
  assert per_layer["fixed_ms"] == pytest.approx(1e3 * shallow["step_time_s"] - per_layer["ms"])
  assert "marginal_moe_layer" not in result  # stock_best did not run
  assert result["command"].startswith("python bench/proxy_1gpu.py --smoke")


def test_small_model_trains_each_path_on_the_learnable_stream_and_profiles(tmp_path):
  result = bench("small_model.py", tmp_path, "--paths", "temoe_bf16,tokamax", "--steps", "8", "--data", "learnable",
                 "--loss-window", "4", "--profile", "--profile-paths", "temoe_bf16")
  ours, stock = result["paths"]["temoe_bf16"], result["paths"]["tokamax"]
  assert "error" not in ours and "error" not in stock, result["paths"]
  assert ours["loss_steps"] == stock["loss_steps"] == [4, 7]
  assert stock["loss_ratio_to_temoe_bf16"] == pytest.approx(stock["loss_mean_last_4"] / ours["loss_mean_last_4"])
  assert abs(stock["loss_ratio_to_temoe_bf16"] - 1) < 0.02  # the same model and data: the two MoEs agree
  assert result["ratios"]["temoe_bf16_over_tokamax_tokens"] == pytest.approx(ours["tokens_per_s"] / stock["tokens_per_s"])
  profiled = result["profile"]["temoe_bf16"]
  assert "error" not in profiled, profiled
  assert profiled["ms_per_step"]["experts"] > 0 and sum(profiled["ms_per_step"].values()) == pytest.approx(profiled["step_ms"])
  assert (tmp_path / profiled["trace"]).stat().st_size > 0
  assert result["profile_difference"] is None  # one path profiled


def test_plan_check_measures_and_plans_each_run(tmp_path):
  """On CPU the run trains but reports no peak (no memory_stats): planned, and said so (exit 2). The run is the
  proxy test's shallow one (same flags and steps): its program comes from the session's compilation cache."""
  out = tmp_path / "rows.json"
  done = scripts.run(ROOT / "bench" / "plan_check.py", "--measure", "--smoke", "--paths", "temoe_fp8@2", "--steps", "5",
                     "--out", str(out), *RUN_TIMEOUT)
  assert done.returncode == 2, (done.stdout + done.stderr)[-4000:]
  assert "temoe_fp8@2: no peak measured: this device reports no memory_stats" in done.stdout
  (row,) = json.loads(out.read_text())["rows"]
  assert row["path"] == "temoe_fp8@2" and row["estimate_gib"] > 0 and row["measured_gib"] is None
