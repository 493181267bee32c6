"""Interchange: a checkpoint written with te_moe_block=true restores with te_moe_block=false, and the
other way round, and the next steps' losses are those of the writer's uninterrupted run.

temoe's block computes on the parameters MaxText's RoutedMoE creates, so both settings save and
restore the same state tree. Each writer trains 8 steps and checkpoints at step 5 only (no save on
completion); the other setting then resumes that run directory with steps=8: MaxText restores
step 5 (state, optimizer, Grain iterator) and computes steps 6 and 7 with the other block.
"""

from __future__ import annotations

import pytest

import runs

STEPS = 8
SAVED = 5
FLAGS = (f"steps={STEPS}", "enable_checkpointing=true", f"checkpoint_period={SAVED}",
         "save_checkpoint_on_completion=false")


@pytest.mark.parametrize("writer,reader", [("true", "false"), ("false", "true")])
def test_checkpoint_restores_with_the_other_block(tmp_path, smoke_data, writer, reader):
  written, _ = runs.train(tmp_path, smoke_data, "run", "writer.jsonl", f"te_moe_block={writer}", *FLAGS)
  assert runs.finalized_steps(tmp_path / "run" / "checkpoints") == [0, SAVED]

  read, log = runs.train(tmp_path, smoke_data, "run", "reader.jsonl", f"te_moe_block={reader}", *FLAGS)
  assert f"restoring from this run's directory step {SAVED}" in log
  assert ("temoe MoE block" in log) == (reader == "true")
  assert sorted(read) == list(range(SAVED + 1, STEPS))
  for step, loss in read.items():
    assert loss == pytest.approx(written[step], rel=1e-5), step
