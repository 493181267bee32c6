"""End to end: `temoe train` on the smoke config trains, and matches MaxText's native MoE run."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from conftest import SMOKE, run_temoe
from temoe import data

STEPS = 24


def train(tmp_path: pathlib.Path, smoke_data: str, name: str, *overrides: str) -> list[dict]:
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
