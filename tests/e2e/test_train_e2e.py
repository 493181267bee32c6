"""End to end: `temoe train` on the smoke config trains, and matches MaxText's native MoE run.

The two 16-step runs are the session's (conftest's temoe_reference and native_reference, which the
resume, preemption and interchange tests read too); the expert-parallel run is this file's own."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

import runs
from conftest import REFERENCE_STEPS, xla_flags
from temoe.run import data

EP_STEPS = 8
"""The expert-parallel run's steps: one takes ~0.6 s on 8 host devices here (32 of them were 20 s of an 82 s run), so
it trains 8 on the reference's learning-rate schedule (runs.SCHEDULE) and matches the reference's first 8 losses."""


def test_temoe_train_learns_with_the_reference_backend(temoe_reference):
  rows, log = temoe_reference["rows"], temoe_reference["log"]
  assert [r["step"] for r in rows] == list(range(REFERENCE_STEPS))
  assert "backend xla: reference backend, no GPU" in log
  losses = [r["learning/loss"] for r in rows]
  assert all(math.isfinite(x) for x in losses)
  first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
  assert first > 0.9 * math.log(256)  # starts near chance
  assert last < first - 2.0, losses  # and learns the chain's bigrams
  assert last > data.entropy_floor(256) - 0.05  # cannot beat the stream's entropy
  assert all(r["learning/te_moe_capacity_overflow"] == 0 for r in rows)
  assert any((pathlib.Path(temoe_reference["base"]) / "ref" / "tensorboard").rglob("events.out.tfevents*"))


def test_temoe_loss_curve_matches_native_moe(temoe_reference, native_reference):
  ours, native = temoe_reference["rows"], native_reference["rows"]
  assert [r["step"] for r in native] == list(range(REFERENCE_STEPS))
  assert "temoe MoE block" not in native_reference["log"] and "temoe MoE block" in temoe_reference["log"]
  for a, b in zip(ours, native):
    assert a["learning/loss"] == pytest.approx(b["learning/loss"], rel=1e-4, abs=1e-4), a["step"]
    assert a["learning/moe_lb_loss"] == pytest.approx(b["learning/moe_lb_loss"], rel=1e-4, abs=1e-7)


def test_expert_parallel_training_on_8_host_devices_matches(temoe_reference, tmp_path, smoke_data):
  """8 CPU devices, experts over an expert axis of 4 (x FSDP 2), same global batch of 8 sequences:
  the loss curve of the 1-device run (its first EP_STEPS steps), through the expert-parallel exchange."""
  metrics = tmp_path / "ep.jsonl"
  proc = runs.start(tmp_path, smoke_data, "ep", "ep.jsonl", f"steps={EP_STEPS}", "ici_expert_parallelism=4",
                    "ici_fsdp_parallelism=2", "per_device_batch_size=1", env={"XLA_FLAGS": xla_flags(8)})
  code, log = runs.finish(proc, tmp_path, "ep.jsonl")
  assert code == 0, log[-4000:]
  assert "8 device(s)" in log
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(EP_STEPS))
  for a, b in zip(rows, temoe_reference["rows"]):
    assert a["learning/loss"] == pytest.approx(b["learning/loss"], rel=1e-4, abs=1e-4), a["step"]
  assert all(r["learning/te_moe_capacity_overflow"] == 0 for r in rows)
