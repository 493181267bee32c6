"""`temoe report` on a profiled CPU run of the smoke config: the files, and numbers equal to the run's logs."""

from __future__ import annotations

import json
import re
import shutil
import statistics

import pytest

from conftest import SMOKE, run_temoe
from temoe.tools import report

PNGS = ("loss", "throughput", "tflops_mfu", "expert_load", "step_breakdown")
LOG_LINE = re.compile(r"completed step: (\d+), seconds: [\d.]+, TFLOP/s/device: [\d.]+, "
                      r"Tokens/s/device: ([\d.]+), .*?loss: ([\d.]+)")


@pytest.fixture(scope="module")
def reported(profiled_smoke):
  run, trained = profiled_smoke
  result = run_temoe("report", str(run), "--gpu", "h200")
  assert result.returncode == 0, result.stderr[-4000:]
  log = {int(m[0]): (float(m[1]), float(m[2])) for m in LOG_LINE.findall(trained.stderr + trained.stdout)}
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  return run, json.loads((run / "report" / "summary.json").read_text()), rows, log, result.stderr


def test_report_files_are_self_contained(reported):
  run, _, _, _, stderr = reported
  page = (run / "report" / "report.html").read_text()
  for name in PNGS:
    assert (run / "report" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
  assert page.count('src="data:image/png;base64,') == len(PNGS) and "http" not in page
  assert any((run / "report" / "tensorboard").glob("events.out.tfevents*"))
  assert "temoe report: 100%" in stderr  # the progress bar ran to the end


def test_summary_numbers_are_the_runs_logs(reported):
  run, summary, rows, log, _ = reported
  assert summary["steps"] == len(rows) == len(log) == 5
  assert summary["final_loss"] == rows[-1]["learning/loss"]
  assert summary["final_loss"] == pytest.approx(log[4][1], abs=5e-4)  # MaxText prints 3 decimals
  steady = rows[report.STEADY_FROM:]
  tokens = summary["median_tokens_per_s_per_device"]
  assert tokens == statistics.median(r["perf/per_device_tokens_per_sec"] for r in steady)
  assert tokens == pytest.approx(statistics.median(log[s][0] for s in range(2, 5)), rel=1e-6)  # printed: 3 decimals
  assert summary["final_load_max_over_mean"] == rows[-1]["temoe/load_max_over_mean"]
  profiled = json.loads((run / "profile.json").read_text())
  assert summary["breakdown_ms_per_step"] == profiled["ms_per_step"]
  model = 486_752_256 / 1e12  # tests/unit/test_flops.py's hand count
  mfu = statistics.median(model / r["perf/step_time_seconds"] / 989.4 for r in steady)  # H200 bf16 peak
  assert summary["median_mfu"] == pytest.approx(mfu, rel=1e-9)


def test_expert_load_heatmap_and_a_run_with_tensorboard_events_and_a_config_only(reported, tmp_path):
  run, summary, rows, _, _ = reported
  load = report.expert_load(rows)
  assert load.shape == (2, 16) and load.mean(axis=1) == pytest.approx([1.0, 1.0])
  for r in rows:  # every routed row is in the heatmap's input: 8 x 64 tokens x top-4 per MoE layer
    for layer in (0, 1):
      assert sum(r[f"temoe/expert_load/moe_layer_{layer:03d}/expert_{e:03d}"] for e in range(16)) == 8 * 64 * 4
  copy = tmp_path / "run"
  shutil.copytree(run / "tensorboard", copy / "tensorboard")  # no metrics.jsonl: MaxText's events only
  assert report.main([str(copy), "--config", SMOKE, "--gpu", "h200", "--out", str(tmp_path / "out")]) == 0
  again = json.loads((tmp_path / "out" / "summary.json").read_text())
  assert again["source"] == "tensorboard" and again["steps"] == summary["steps"]
  assert again["flops"]["model_tflops_per_step_per_device"] == summary["flops"]["model_tflops_per_step_per_device"]
  assert again["median_mfu"] == pytest.approx(summary["median_mfu"], rel=1e-6)
  assert again["final_loss"] == pytest.approx(summary["final_loss"], rel=1e-6)  # float32 in the events
  assert again["median_tokens_per_s_per_device"] == pytest.approx(summary["median_tokens_per_s_per_device"], rel=1e-6)
