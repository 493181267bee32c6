"""Resume: a `temoe train` run SIGKILLed after a checkpoint, restarted with the same run, continues
the uninterrupted run's loss trajectory bit for bit (CPU, float32), async checkpointing on and off.

MaxText restores the latest committed checkpoint itself, with the Grain iterator's position
(saved beside the state as `<step>/iter`), so the resumed steps see the batches the uninterrupted
run saw: the smoke stream is unshuffled and every batch differs, so a restart from the stream's
start, a lost optimizer state or a wrong step would change the losses.
"""

from __future__ import annotations

import signal

import pytest

import runs
from conftest import REFERENCE_STEPS

STEPS = REFERENCE_STEPS  # the session's 16-step reference (conftest's smoke_reference): the kill after the
# checkpoint of step 4 lands with 11 steps to spare
PERIOD = 4


@pytest.mark.parametrize("async_checkpointing", ["true", "false"])
def test_killed_run_resumes_on_the_exact_loss_trajectory(tmp_path, smoke_data, smoke_reference, async_checkpointing):
  uninterrupted = smoke_reference
  flags = (f"steps={STEPS}", "enable_checkpointing=true", f"checkpoint_period={PERIOD}",
           f"async_checkpointing={async_checkpointing}")
  checkpoints = tmp_path / "run" / "checkpoints"
  proc = runs.start(tmp_path, smoke_data, "run", "first.jsonl", *flags)
  runs.kill_after_checkpoint(proc, checkpoints, after=PERIOD)
  assert proc.returncode == -signal.SIGKILL, (tmp_path / "first.jsonl.log").read_text()[-3000:]
  latest = runs.finalized_steps(checkpoints)[-1]
  assert PERIOD <= latest < STEPS - 1, f"killed too late to test a resume: checkpoint {latest}"
  assert (checkpoints / str(latest) / "iter").is_dir()  # MaxText saved the Grain iterator with the state

  resumed, log = runs.train(tmp_path, smoke_data, "run", "resumed.jsonl", *flags)
  assert f"restoring from this run's directory step {latest}" in log
  assert sorted(resumed) == list(range(latest + 1, STEPS))
  assert resumed == {step: uninterrupted[step] for step in resumed}  # exact floats, not approx
