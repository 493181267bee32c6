"""Resume: a `temoe train` run SIGKILLed after a checkpoint, restarted with the same run, continues
the uninterrupted run's loss trajectory bit for bit (CPU, float32), async checkpointing on and off.

MaxText restores the latest committed checkpoint itself, with the Grain iterator's position
(saved beside the state as `<step>/iter`), so the resumed steps see the batches the uninterrupted
run saw: the smoke stream is unshuffled and every batch differs, so a restart from the stream's
start, a lost optimizer state or a wrong step would change the losses.

One run directory, three processes: the first saves asynchronously and is killed after its checkpoint of step 4;
the second resumes it, saves synchronously and is killed after its next checkpoint; the third resumes that and
finishes. Each resumed process restores what a killed one committed in one of the two modes, and every loss logged
is the uninterrupted run's: three processes where a first and a resumed run for each mode took four (a process
costs ~19 CPU-s here before and after its steps, a step ~0.3).
"""

from __future__ import annotations

import signal

import runs
from conftest import REFERENCE_STEPS

STEPS = REFERENCE_STEPS  # the session's 16-step reference (conftest's smoke_reference)
PERIOD = 4


def flags(async_checkpointing: str) -> tuple[str, ...]:
  return (f"steps={STEPS}", "enable_checkpointing=true", f"checkpoint_period={PERIOD}",
          f"async_checkpointing={async_checkpointing}")


def test_killed_runs_resume_on_the_exact_loss_trajectory(tmp_path, smoke_data, smoke_reference):
  uninterrupted = smoke_reference
  checkpoints = tmp_path / "run" / "checkpoints"
  latest = None
  for async_checkpointing in ("true", "false"):
    metrics = f"killed-async-{async_checkpointing}.jsonl"
    proc = runs.start(tmp_path, smoke_data, "run", metrics, *flags(async_checkpointing))
    runs.kill_after_checkpoint(proc, checkpoints, after=PERIOD if latest is None else latest + 1)
    log = (tmp_path / f"{metrics}.log").read_text(encoding="utf-8")
    assert proc.returncode == -signal.SIGKILL, log[-3000:]
    if latest is not None:
      assert f"restoring from this run's directory step {latest}" in log
    logged = runs.losses(tmp_path / metrics)
    assert logged == {step: uninterrupted[step] for step in logged}, async_checkpointing  # exact floats
    saved = runs.finalized_steps(checkpoints)[-1]
    assert (latest or PERIOD - 1) < saved < STEPS - 1, f"async={async_checkpointing}: killed after checkpoint {saved}"
    assert (checkpoints / str(saved) / "iter").is_dir()  # MaxText saved the Grain iterator with the state
    latest = saved

  resumed, log = runs.train(tmp_path, smoke_data, "run", "resumed.jsonl", *flags("true"))
  assert f"restoring from this run's directory step {latest}" in log
  assert sorted(resumed) == list(range(latest + 1, STEPS))
  assert resumed == {step: uninterrupted[step] for step in resumed}  # exact floats, not approx
