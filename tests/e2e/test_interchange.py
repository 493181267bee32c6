"""Interchange: a checkpoint written with te_moe_block=true restores with te_moe_block=false, and the
other way round, and the next steps' losses are those of the writer's uninterrupted run.

temoe's block computes on the parameters MaxText's RoutedMoE creates, so both settings save and
restore the same state tree. The writers are the session's uninterrupted 16-step runs (conftest's
temoe_reference and native_reference), which checkpoint every 5 steps; the other setting then resumes a copy
of that run directory cut back to step 10 (runs.copy_run) with the same flags: MaxText restores step 10
(state, optimizer, Grain iterator) and computes steps 11 to 15 with the other block.
"""

from __future__ import annotations

import pathlib

import pytest

import runs
from conftest import REFERENCE_FLAGS, REFERENCE_STEPS

RESUMED = 10
"""The writer's checkpoint the reader resumes from (the reference saves steps 0, 5, 10 and 15)."""


@pytest.mark.parametrize("writer,reader", [("true", "false"), ("false", "true")])
def test_checkpoint_restores_with_the_other_block(tmp_path, smoke_data, request, writer, reader):
  written = request.getfixturevalue({"true": "temoe_reference", "false": "native_reference"}[writer])
  runs.copy_run(pathlib.Path(written["base"]) / "ref", tmp_path / "ref", RESUMED)  # the session's run stays as it was
  assert runs.finalized_steps(tmp_path / "ref" / "checkpoints") == [0, 5, RESUMED]

  read, log = runs.train(tmp_path, smoke_data, "ref", "reader.jsonl", f"te_moe_block={reader}", *REFERENCE_FLAGS)
  assert f"restoring from this run's directory step {RESUMED}" in log
  assert ("temoe MoE block" in log) == (reader == "true")
  assert sorted(read) == list(range(RESUMED + 1, REFERENCE_STEPS))
  losses = {int(r["step"]): r["learning/loss"] for r in written["rows"]}
  for step, loss in read.items():
    assert loss == pytest.approx(losses[step], rel=1e-5), step
