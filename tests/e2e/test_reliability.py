"""Bad run state, caught by `temoe.run.preflight` before MaxText starts: an output directory this process
cannot write, and a latest checkpoint Orbax cannot read (MaxText's own restore error for a
truncated chunk is Orbax's "incompatible handler" plus a dump of the whole state tree).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest

import faults
import runs
from conftest import HANG_S, SMOKE
from temoe import cli
from temoe.run import checksums, preflight

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
def checkpointed(tmp_path_factory, temoe_reference):
  """A run directory holding MaxText checkpoints at steps 0 and 5, as a run of steps=6 with CHECKPOINTING leaves
  it: the session's reference run of temoe's block (conftest's temoe_reference, which saves every 5 steps of the
  same program) copied and cut back to step 5 (runs.copy_run), not a training run of this file's own."""
  run = runs.copy_run(pathlib.Path(temoe_reference["base"]) / "ref", tmp_path_factory.mktemp("checkpointed") / "run",
                      SAVED)
  assert runs.finalized_steps(run / "checkpoints") == [0, SAVED]
  return run


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


def flip(path: pathlib.Path, count: int, at: float = 0.5) -> None:
  """Inverts `count` bytes centred at fraction `at` of the file (its middle by default); its size stays the same."""
  with open(path, "r+b") as f:
    f.seek(max(int(path.stat().st_size * at) - count // 2, 0))
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
  assert expected in message and "the newest earlier step that verifies is 0: pass te_resume_step=0" in message


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
  """The preflight flags a checkpoint MaxText really cannot restore; MaxText's own error hides why. MaxText's
  train alone (no `temoe train`, no preflight), forked like the session's runs (tests/runs.py's launch)."""
  run = damaged_copy(checkpointed, "maxtext-alone", CORRUPTIONS["truncated data chunk"][0])
  base = checkpointed.parent
  argv = runs.command(base, smoke_data, run, "alone.jsonl", *RESUME)[4:]  # MaxText's own arguments
  code, log = runs.finish(runs.launch([sys.executable, "-c", MAXTEXT_ALONE, *argv], base / "alone.log"), base, "alone")
  assert code != 0 and "completed step" not in log
  assert "incompatible handler" in log


def test_temoe_train_stops_before_maxtext_with_one_line(checkpointed, smoke_data, capsys):
  """`temoe train`'s main in this process: the preflight stops it before MaxText starts (a `temoe train` process
  that stops in its preflight prints that one line and nothing else: test_preflight_agreement.py, test_failures.py)."""
  run = damaged_copy(checkpointed, "cli-stops", CORRUPTIONS["truncated data chunk"][0])
  base = checkpointed.parent
  code, log = train_in_process(runs.command(base, smoke_data, run, "cli.jsonl", *RESUME), capsys)
  lines = [line for line in log.splitlines() if line.startswith("temoe: ")]
  assert code == 2 and len(lines) == 1, log[-3000:]
  assert f"the latest checkpoint {base / run}/checkpoints/{SAVED}" in lines[0] and "Traceback" not in log
  assert not (base / "cli.jsonl").exists()  # MaxText never started


def train_copy(checkpointed: pathlib.Path, smoke_data: str, name: str, damage, *overrides: str):
  """(exit code, whole output) of `temoe train` resuming a damaged copy of the run (steps=8)."""
  run = damaged_copy(checkpointed, name, damage)
  proc = runs.start(checkpointed.parent, smoke_data, run, f"{run}.jsonl", *RESUME, *overrides)
  code, log = runs.finish(proc, checkpointed.parent, f"{run}.jsonl")
  return code, log, checkpointed.parent / run


def without_records(damage):
  """The damage, on a checkpoint whose checksum records are gone (saved by MaxText alone, or older)."""
  def apply(step: pathlib.Path):
    shutil.rmtree(step.parent.parent / checksums.RECORDS)
    damage(step)
  return apply


def restores_nonfinite(step: pathlib.Path) -> bool:
  """Whether Orbax alone restores a NaN/Inf from the step's train state (its raw tree, no target)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  try:
    with warnings.catch_warnings():  # the raw tree on this one device, on purpose: Orbax reads the saved sharding
      warnings.filterwarnings("ignore", "Sharding info not provided when restoring", UserWarning)
      tree = ocp.PyTreeCheckpointer().restore(step / "items")
  except Exception:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    return False  # damage Orbax itself reports: another test's case
  leaves = jax.tree_util.tree_leaves(tree)
  return any(np.issubdtype(leaf.dtype, np.floating) and not np.isfinite(np.asarray(leaf)).all()
             for leaf in leaves if hasattr(leaf, "dtype") and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def flip_to_nonfinite(step: pathlib.Path) -> None:
  """Inverts 4 KiB of a zstd-compressed chunk where the garbage it decodes to holds a NaN/Inf: the largest
  data files, then their quarters, first one that does (garbage that decodes finite is the checksum records'
  case, and a negative second moment is checked in tests/unit/test_restore_check.py)."""
  files = sorted((p for p in (step / "items").rglob("d/*") if p.is_file()), key=lambda p: -p.stat().st_size)[:3]
  for path in files:
    original = path.read_bytes()
    for at in (0.5, 0.25, 0.75):
      flip(path, 4096, at)
      if restores_nonfinite(step):
        return
      path.write_bytes(original)
  raise AssertionError(f"no 4 KiB inversion in the 3 largest files of {step} restores a NaN/Inf")


def overwrite_with_ff(path: pathlib.Path) -> None:
  size = path.stat().st_size
  with open(path, "r+b") as f:
    f.seek(size // 4)
    f.write(b"\xff" * (size // 2))


def train_in_process(command: list[str], capsys) -> tuple[int, str]:
  """(exit code, output) of `temoe train` run by `temoe.cli.main` in this process: for runs that stop in the
  preflight, before MaxText starts (no new process to start and import)."""
  code = cli.main(command[3:])  # after `python -m temoe.cli`
  out, err = capsys.readouterr()
  return code, out + err


def test_a_finished_run_started_again_says_so_and_exits_0(checkpointed, smoke_data, capsys):
  code, log = train_in_process(runs.command(checkpointed.parent, smoke_data, checkpointed.name, "again.jsonl",
                                            "steps=6", *CHECKPOINTING), capsys)
  faults.check("finished run started again", code, log)
  assert "completed step" not in log


def test_flipped_bytes_without_records_stop_before_the_first_step_and_te_resume_step_resumes(checkpointed, smoke_data,
                                                                                              capsys):
  """Without checksum records the flipped chunk restores as NaN/Inf; the run stops before its first step,
  names the newest step that restores intact, and te_resume_step resumes from it, once."""
  code, log, run = train_copy(checkpointed, smoke_data, "flipped-no-records", without_records(flip_to_nonfinite))
  line = faults.check("flipped bytes, no checksum records", code, log)
  assert f"the checkpoint of step {SAVED} at {run}/checkpoints/{SAVED}, which this run would resume from" in line
  assert "completed step" not in log and runs.finalized_steps(run / "checkpoints") == [0, SAVED]  # nothing saved

  code, log = runs.finish(runs.start(run.parent, smoke_data, run.name, "resumed.jsonl", *RESUME, "te_resume_step=0"),
                          run.parent, "resumed.jsonl")
  assert code == 0, log[-3000:]
  assert f"te_resume_step: moved checkpoint step(s) {SAVED} to {run}/{preflight.SET_ASIDE}/" in log
  assert "restoring from this run's directory step 0" in log
  assert sorted(runs.losses(run.parent / "resumed.jsonl")) == list(range(1, 8))
  assert [p.name for p in (run / preflight.SET_ASIDE).glob("*/*")] == [str(SAVED)]  # kept, not deleted
  capsys.readouterr()
  import temoe  # pylint: disable=import-outside-toplevel

  temoe.register()
  try:  # a requeue with the same arguments: the preflight `temoe train` runs, with the run lock
    preflight.check(runs.command(run.parent, smoke_data, run.name, "again.jsonl", *RESUME, "te_resume_step=0")[4:],
                    lock_run=True)
  finally:
    preflight.release()
  assert "moved checkpoint" not in capsys.readouterr().out  # applied once only: the new step 5 stays the latest
  assert runs.finalized_steps(run / "checkpoints") == [0, SAVED] and len(list((run / preflight.SET_ASIDE).glob("2*"))) == 1


def test_a_chunk_overwritten_without_records_is_a_digest_mismatch_in_one_line(checkpointed, smoke_data):
  code, log, _ = train_copy(checkpointed, smoke_data, "ff-no-records",
                            without_records(lambda s: overwrite_with_ff(largest_chunk_file(s))))
  faults.check("chunk overwritten with 0xFF, no checksum records", code, log)


def test_another_model_shape_names_the_parameter_and_both_shapes(checkpointed, smoke_data):
  code, log, _ = train_copy(checkpointed, smoke_data, "other-shape", lambda s: None, "override_model_config=true",
                            "base_moe_mlp_dim=48")
  faults.check("another model shape", code, log)


@pytest.fixture
def bind_mounted_checkpoints(tmp_path):
  """A run directory whose checkpoints/ is a bind mount of itself, writable until the test remounts it
  read-only (a revoked mount, a storage turned read-only). Needs root (CI runs as root)."""
  checkpoints = tmp_path / "run" / "checkpoints"
  checkpoints.mkdir(parents=True)
  made = subprocess.run(["mount", "--bind", str(checkpoints), str(checkpoints)], capture_output=True, text=True,
                        check=False) if shutil.which("mount") else None
  if made is None or made.returncode:
    pytest.skip(f"cannot bind-mount here: {made.stderr.strip() if made else 'no mount command'}")
  yield checkpoints
  subprocess.run(["umount", str(checkpoints)], check=False)


LINGER_S = 60
"""How long the test waits for the process after its last line: the contract is a few seconds
(temoe.oneline.EXIT_GRACE_S); without the bound it stayed about 290 s."""


def test_a_checkpoint_directory_turning_read_only_mid_run_stops_it_and_the_process_exits(tmp_path, smoke_data,
                                                                                         bind_mounted_checkpoints, capsys):
  """Once step 0 is committed the run is paused (SIGSTOP), its checkpoint directory remounted read-only, and
  resumed: the next save fails with one line, exit 2, and the process is gone soon after that line. Started
  again on the read-only directory, the run is refused before compiling."""
  proc = runs.start(tmp_path, smoke_data, "run", "ro-mid.jsonl", "steps=32", "enable_checkpointing=true",
                    "checkpoint_period=4", "save_checkpoint_on_start=true", "async_checkpointing=true",
                    "enable_tensorboard=false")
  log = tmp_path / "ro-mid.jsonl.log"
  try:
    deadline = time.monotonic() + HANG_S
    runs.wait_for_checkpoint(proc, bind_mounted_checkpoints)
    assert proc.poll() is None, log.read_text(encoding="utf-8")[-3000:]
    os.kill(proc.pid, signal.SIGSTOP)
    subprocess.run(["mount", "-o", "remount,ro,bind", str(bind_mounted_checkpoints)], check=True)
    os.kill(proc.pid, signal.SIGCONT)
    while proc.poll() is None and "could not be written" not in log.read_text(encoding="utf-8") \
        and time.monotonic() < deadline:
      time.sleep(0.05)
    try:
      proc.wait(LINGER_S)
    except subprocess.TimeoutExpired:
      pytest.fail(f"still running {LINGER_S} s after its last line:\n{log.read_text(encoding='utf-8')[-2000:]}")
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  text = log.read_text(encoding="utf-8")
  faults.check("checkpoint directory turned read-only mid-run", proc.returncode, text)
  assert runs.finalized_steps(bind_mounted_checkpoints)[0] == 0
  assert not (tmp_path / "run" / "temoe.lock").exists()

  code, again = train_in_process(runs.command(tmp_path, smoke_data, "run", "again.jsonl", *RESUME), capsys)
  faults.check("read-only checkpoint directory", code, again, dir=f"{bind_mounted_checkpoints}/")
