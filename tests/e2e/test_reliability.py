"""Bad run state, caught by `temoe.run.preflight` before MaxText starts: an output directory this process
cannot write, and a latest checkpoint Orbax cannot read (MaxText's own restore error for a
truncated chunk is Orbax's "incompatible handler" plus a dump of the whole state tree).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

import runs
from conftest import SMOKE
from temoe import cli

from temoe.run import preflight

SAVED = 5
CHECKPOINTING = ("enable_checkpointing=true", f"checkpoint_period={SAVED}", "save_checkpoint_on_completion=false")
RESUME = ("steps=8", *CHECKPOINTING)  # what a resume of the 6-step run below passes


def preflight_error(*args: str) -> str:
  """The one line `temoe train` prints for these arguments (preflight's error, through the CLI's handler)."""
  import temoe  # pylint: disable=import-outside-toplevel

  temoe.register()
  with pytest.raises(preflight.PreflightError) as info:
    preflight.check([SMOKE, *args])
  message = cli.config_error_message(info.value)
  assert message and "\n" not in message
  return message


def test_unwritable_output_dir(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  message = preflight_error(f"base_output_directory={blocker}/out", "run_name=r")
  assert f"base_output_directory={blocker}/out is not writable" in message and "Not a directory" in message


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, smoke_data):
  """A run directory holding MaxText checkpoints at steps 0 and 5."""
  base = tmp_path_factory.mktemp("checkpointed")
  runs.train(base, smoke_data, "run", "run.jsonl", "steps=6", *CHECKPOINTING)
  assert runs.finalized_steps(base / "run" / "checkpoints") == [0, SAVED]
  return base / "run"


def largest_chunk_file(step: pathlib.Path) -> pathlib.Path:
  return max((p for p in (step / "items").rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)


CORRUPTIONS = {  # name -> (damage to the latest step directory, text of the error)
    "truncated data chunk": (lambda s: truncate(largest_chunk_file(s), 1000), "OUT_OF_RANGE"),
    "truncated tree metadata": (lambda s: truncate(s / "items" / "_METADATA", 100), "JSONDecodeError"),
    "missing OCDBT manifest": (lambda s: (s / "items" / "manifest.ocdbt").unlink(), "manifest.ocdbt) is missing"),
    "truncated Grain iterator state": (lambda s: truncate(next((s / "iter").glob("*.json")), 10), "iter/process_0"),
    "missing train state": (lambda s: shutil.rmtree(s / "items"), "no items/"),
    "flipped bytes in a data chunk": (lambda s: flip(largest_chunk_file(s), 4096), "CRC-32 mismatch"),
    "deleted OCDBT data file": (lambda s: largest_chunk_file(s).unlink(), "items/"),
    "deleted Grain iterator state": (lambda s: [p.unlink() for p in (s / "iter").glob("*")], "Grain iterator state"),
}


def flip(path: pathlib.Path, count: int) -> None:
  """Inverts `count` bytes in the middle of the file; its size stays the same."""
  with open(path, "r+b") as f:
    f.seek(max(path.stat().st_size // 2 - count // 2, 0))
    chunk = f.read(count)
    f.seek(-len(chunk), 1)
    f.write(bytes(b ^ 0xFF for b in chunk))


def truncate(path: pathlib.Path, size: int) -> None:
  with open(path, "r+b") as f:
    f.truncate(size)


def damaged_copy(checkpointed: pathlib.Path, name: str, damage) -> str:
  """A copy of the run with its latest checkpoint damaged; returns the copy's run_name."""
  run = checkpointed.parent / name.replace(" ", "-")
  shutil.copytree(checkpointed, run)
  damage(run / "checkpoints" / str(SAVED))
  return run.name


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_latest_checkpoint(checkpointed, case, smoke_data):
  damage, expected = CORRUPTIONS[case]
  run = damaged_copy(checkpointed, case, damage)
  message = preflight_error(f"base_output_directory={checkpointed.parent}", f"run_name={run}",
                            f"grain_train_files={smoke_data}", *RESUME)
  assert f"the latest checkpoint {checkpointed.parent / run}/checkpoints/{SAVED}" in message
  assert expected in message and "the one before it is step 0" in message


def test_intact_checkpoint_passes_and_the_earlier_step_is_the_way_out(checkpointed, smoke_data):
  import temoe  # pylint: disable=import-outside-toplevel

  temoe.register()
  args = [SMOKE, f"base_output_directory={checkpointed.parent}", f"grain_train_files={smoke_data}", *RESUME]
  assert preflight.check([*args, f"run_name={checkpointed.name}"]).enable_checkpointing
  run = damaged_copy(checkpointed, "moved-away", lambda s: shutil.move(s, s.parent.parent / "corrupt-5"))
  assert preflight.check_latest_checkpoint(str(checkpointed.parent / run / "checkpoints")) == 0


MAXTEXT_ALONE = (
    "import sys, temoe; temoe.register(); from absl import app; "
    "from maxtext.trainers.pre_train import train; app.run(train.main, argv=['train', *sys.argv[1:]])"
)


def test_maxtext_alone_fails_on_the_truncated_chunk(checkpointed, smoke_data):
  """The preflight flags a checkpoint MaxText really cannot restore; MaxText's own error hides why."""
  run = damaged_copy(checkpointed, "maxtext-alone", CORRUPTIONS["truncated data chunk"][0])
  base = checkpointed.parent
  argv = runs.command(base, smoke_data, run, "alone.jsonl", *RESUME)[4:]  # MaxText's own arguments
  proc = subprocess.run([sys.executable, "-c", MAXTEXT_ALONE, *argv], cwd=runs.ROOT, capture_output=True, text=True,
                        timeout=600)
  log = proc.stdout + proc.stderr
  assert proc.returncode != 0 and "completed step" not in log
  assert "incompatible handler" in log


def test_temoe_train_stops_before_maxtext_with_one_line(checkpointed, smoke_data):
  run = damaged_copy(checkpointed, "cli-stops", CORRUPTIONS["truncated data chunk"][0])
  base = checkpointed.parent
  proc = subprocess.run(runs.command(base, smoke_data, run, "cli.jsonl", *RESUME), cwd=runs.ROOT,
                        capture_output=True, text=True, timeout=600)
  lines = [line for line in proc.stderr.splitlines() if line.startswith("temoe: ")]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert f"the latest checkpoint {base / run}/checkpoints/{SAVED}" in lines[0] and "Traceback" not in proc.stderr
