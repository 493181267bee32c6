"""End to end: `temoe train` on the smoke config trains, and matches MaxText's native MoE run."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from conftest import SMOKE, run_temoe
from temoe.run import data

STEPS = 24


def train(tmp_path: pathlib.Path, smoke_data: str, name: str, *overrides: str, env: dict | None = None):
  metrics = tmp_path / f"{name}.jsonl"
  result = run_temoe(
      "train",
      SMOKE,
      f"base_output_directory={tmp_path}",
      f"run_name={name}",
      f"grain_train_files={smoke_data}",
      f"steps={STEPS}",
      f"metrics_file={metrics}",
      *overrides,
      env=env,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(STEPS))
  return rows, result.stderr + result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smoke_data):
  tmp = tmp_path_factory.mktemp("train")
  return tmp, train(tmp, smoke_data, "temoe", "te_moe_block=true"), train(tmp, smoke_data, "native", "te_moe_block=false")


def test_temoe_train_learns_with_the_reference_backend(runs):
  tmp, (rows, log), _ = runs
  assert "backend xla: reference backend, no GPU" in log
  losses = [r["learning/loss"] for r in rows]
  assert all(math.isfinite(x) for x in losses)
  first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
  assert first > 0.9 * math.log(256)  # starts near chance
  assert last < first - 2.0, losses  # and learns the chain's bigrams
  assert last > data.entropy_floor(256) - 0.05  # cannot beat the stream's entropy
  assert all(r["learning/te_moe_capacity_overflow"] == 0 for r in rows)
  assert any((tmp / "temoe" / "tensorboard").rglob("events.out.tfevents*"))


def test_temoe_loss_curve_matches_native_moe(runs):
  _, (ours, _), (native, _) = runs
  for a, b in zip(ours, native):
    assert a["learning/loss"] == pytest.approx(b["learning/loss"], rel=1e-4, abs=1e-4), a["step"]
    assert a["learning/moe_lb_loss"] == pytest.approx(b["learning/moe_lb_loss"], rel=1e-4, abs=1e-7)


def test_expert_parallel_training_on_8_host_devices_matches(runs, tmp_path, smoke_data):
  """8 CPU devices, experts over an expert axis of 4 (x FSDP 2), same global batch of 8 sequences:
  the loss curve of the 1-device run, through the expert-parallel exchange."""
  _, (ours, _), _ = runs
  rows, log = train(
      tmp_path, smoke_data, "ep", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "per_device_batch_size=1",
      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
  )
  assert "8 device(s)" in log
  for a, b in zip(rows, ours):
    assert a["learning/loss"] == pytest.approx(b["learning/loss"], rel=1e-4, abs=1e-4), a["step"]
  assert all(r["learning/te_moe_capacity_overflow"] == 0 for r in rows)
