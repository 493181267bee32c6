"""Training that fails says so, and keeps what is good: data that runs out, two runs with one
run_name at once, a filesystem that fills up, a state that goes NaN. Each run is the smoke model
for a few steps; the line checked is the last one `temoe train` prints.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import time

import pytest

import faults
import runs
from temoe import cli
from temoe.run import data, lock

BATCHES = 5  # the short stream: 5 whole batches of the smoke config's 8 sequences, then a partial one of 4
STEPS = 8


@pytest.fixture(scope="module")
def short_data(tmp_path_factory) -> str:
  return data.write_parquet(str(tmp_path_factory.mktemp("short") / "short.parquet"), rows=8 * BATCHES + 4)


def test_data_running_out_fails_after_a_final_checkpoint_and_a_second_run_is_refused(tmp_path, short_data):
  flags = (f"steps={STEPS}", "enable_checkpointing=true", "checkpoint_period=100", "enable_tensorboard=false")
  first = runs.start(tmp_path, short_data, "run", "first.jsonl", *flags)
  time.sleep(1.0)  # the case: the same run started again moments later
  second = runs.start(tmp_path, short_data, "run", "second.jsonl", *flags)
  (rc1, log1), (rc2, log2) = runs.finish(first, tmp_path, "first.jsonl"), runs.finish(second, tmp_path, "second.jsonl")
  (ran, ran_log, ran_metrics), (refused, refused_log) = (
      ((rc1, log1, "first.jsonl"), (rc2, log2)) if "in use by another" in log2 else ((rc2, log2, "second.jsonl"), (rc1, log1)))
  line = runs.temoe_lines(refused_log)
  assert refused == 2 and len(line) == 1, refused_log[-3000:]
  assert f"run directory {tmp_path / 'run'} is in use by another temoe train (pid" in line[0]
  assert "pass another run_name" in line[0] and "completed step" not in refused_log

  faults.check("data runs out", ran, ran_log)  # exit 2: more data or fewer steps; a requeue would stop again
  assert "holds token id -1" not in ran_log  # the partial batch's padding (MaxText's pad id) is no token id
  assert runs.finalized_steps(tmp_path / "run" / "checkpoints") == [0, BATCHES]  # on start, and the final one
  assert sorted(runs.losses(tmp_path / ran_metrics)) == list(range(BATCHES + 1))  # the partial batch trained
  assert not (tmp_path / "run" / lock.LOCK_NAME).exists()  # released at the end


def test_a_nan_state_is_never_checkpointed(tmp_path, smoke_data):
  """A learning rate that overflows the weights: the step-0 checkpoint stays the latest, the run stops."""
  rc, log = runs.finish(runs.start(tmp_path, smoke_data, "run", "nan.jsonl", "steps=6", "enable_checkpointing=true",
                                   "checkpoint_period=2", "save_checkpoint_on_start=true", "learning_rate=1e30",
                                   "warmup_steps_fraction=0", "enable_tensorboard=false"), tmp_path, "nan.jsonl")
  good = runs.finalized_steps(tmp_path / "run" / "checkpoints")
  last = faults.check("NaN state", rc, log, good=good[-1] if good else "?")
  assert f"after step {good[-1]} " not in last


def test_a_nan_loss_is_a_stop_that_needs_a_person_not_a_bug(tmp_path, smoke_data):
  """MaxText's abort_on_nan_loss exits 1 (a bug, by temoe's codes) with an INFO line; temoe says which step."""
  rc, log = runs.finish(runs.start(tmp_path, smoke_data, "run", "nanloss.jsonl", "steps=6", "enable_checkpointing=false",
                                   "learning_rate=1e30", "warmup_steps_fraction=0", "enable_tensorboard=false"),
                        tmp_path, "nanloss.jsonl")
  faults.check("NaN loss", rc, log)
  assert "Aborting training due to NaN loss" in log  # MaxText's own abort, not some other path


@pytest.fixture
def small_filesystem(tmp_path):
  """A 6 MiB tmpfs: room for one smoke checkpoint (3.5 MiB) and not two. Needs root (CI runs as root)."""
  mount = tmp_path / "small"
  mount.mkdir()
  made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True, text=True,
                        check=False) if shutil.which("mount") else None
  if made is None or made.returncode:
    pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip() if made else 'no mount command'}")
  yield mount
  subprocess.run(["umount", str(mount)], check=False)


def test_a_full_filesystem_stops_the_run_with_one_line_and_resume_is_refused(tmp_path, smoke_data, small_filesystem,
                                                                            capsys):
  flags = ("steps=6", "enable_checkpointing=true", "checkpoint_period=2", "save_checkpoint_on_start=true",
           "enable_tensorboard=false")
  command = [*runs.command(small_filesystem, smoke_data, "run", "x", *flags)]
  command[command.index(f"metrics_file={small_filesystem / 'x'}")] = f"metrics_file={tmp_path / 'full.jsonl'}"
  code, log = runs.finish(runs.launch(command, tmp_path / "full.log"), tmp_path, "full")  # forked, as runs.start's
  faults.check("full disk", code, log)  # exit 2: a full disk needs a person
  assert runs.finalized_steps(small_filesystem / "run" / "checkpoints") == [0]

  code = cli.main(command[3:])  # resumed, in this process: the preflight refuses it before MaxText starts
  err = capsys.readouterr().err
  lines = runs.temoe_lines(err)
  assert code == 2 and len(lines) == 1, err[-3000:]
  assert "MiB free, less than one checkpoint of this run" in lines[0]
  assert pathlib.Path(small_filesystem / "run" / lock.LOCK_NAME).exists() is False
