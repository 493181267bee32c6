"""A real one-node Slurm cluster runs the CPU smoke job with 2 tasks through `temoe launch slurm --submit`.

tests/slurm/cluster.sh installs Debian's slurmctld, slurmd, slurm-client and munge (once), starts
them as root without systemd and stops them by PID afterwards. The job (virtualenv mode) must form
one jax.distributed group of 2 processes, train with temoe's block, lower the loss, and get its
overrides verbatim: its output directory's name holds spaces, quotes, $(...) and backticks, which
must name a directory and never run. Halfway the batch script gets a SIGTERM (`scancel --signal=TERM
--batch`): it passes it to the tasks through Slurm, both checkpoint one step and exit 75, the script
requeues the job, and the second attempt resumes there and completes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import HANG_S, ROOT, SMOKE

STEPS = 12
"""A step of this two-process program costs ~1.5 CPU-s here (both processes, program loaded: 63.3 CPU-s for a
12-step run, 92.7 for a 32-step one), so the job runs 12 steps, not the schedule's 32: the 2-process run's loss
falls 5.94 -> 3.78 between the means of its first and last 4 of 12 steps (2.16 > the 1.5 asserted). The schedule
stays the 32-step one (SCHEDULE): the program is test_preemption's pair's, compiled once per session, and a run of
fewer steps computes that run's first steps exactly."""
STOP_AFTER = 4  # the signal goes out once this step is logged, 7 steps (>= 7 s here) before the end
SCHEDULE = "learning_rate_schedule_steps=32"
TRICKY = "out dir $(touch PWNED) `touch PWNED` 'q\""


def why_no_cluster() -> str | None:
  if os.geteuid() != 0:
    return "starting slurmctld/slurmd needs root (CI runs as root)"
  if not shutil.which("slurmctld") and not shutil.which("apt-get"):
    return "no Slurm installed and no apt-get to install Debian's"
  return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
  reason = why_no_cluster()
  if reason:
    pytest.skip(reason)
  state = tmp_path_factory.mktemp("slurm-state")
  start = subprocess.run(["bash", str(ROOT / "tests/slurm/cluster.sh"), "start", str(state)],
                         capture_output=True, text=True, timeout=600, check=False)
  assert start.returncode == 0, start.stdout + start.stderr
  try:
    yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
  finally:
    subprocess.run(["bash", str(ROOT / "tests/slurm/cluster.sh"), "stop", str(state)], timeout=60, check=False)


def wait(job_id: str, env: dict, timeout: float = HANG_S) -> str:
  """Waits until the job leaves the queue; returns `scontrol show job` (kept for MinJobAge)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env, check=False).stdout
    if re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)", info):
      return info
    time.sleep(2)
  subprocess.run(["scancel", job_id], env=env, check=False)
  pytest.fail(f"Slurm job {job_id} still queued or running after {timeout}s")


def signal_when_logged(job_id: str, log_path, text: str, env: dict, timeout: float = HANG_S) -> None:
  """`scancel --signal=TERM --batch` (the batch script only; the job runs on) once `text` is in the log."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if log_path.exists() and text in log_path.read_text(errors="replace"):
      subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], env=env, check=True, timeout=30)
      return
    time.sleep(0.05)
  pytest.fail(f"Slurm job {job_id} never logged {text!r}")


def test_two_task_cpu_job_forms_one_jax_group_learns_and_a_sigterm_requeues_it(slurm, tmp_path, smoke_data):
  workdir, out = tmp_path / "job", tmp_path / TRICKY
  submit = subprocess.run(
      [sys.executable, "-m", "temoe.cli", "launch", "slurm", "--submit", "--name", "smoke", "--gpus-per-node", "0",
       "--tasks-per-node", "2", "--workdir", str(workdir), "--max-restarts", "1", SMOKE,
       f"base_output_directory={out}", "run_name=smoke", f"grain_train_files={smoke_data}", f"steps={STEPS}",
       SCHEDULE, "log_period=5", f"metrics_file={out}/metrics.jsonl", "enable_checkpointing=true",
       "checkpoint_period=10"],
      capture_output=True, text=True, env=slurm, cwd=ROOT, timeout=60, check=False)
  assert submit.returncode == 0, submit.stderr
  job_id = submit.stdout.strip()
  log_path = workdir / f"smoke-{job_id}.out"
  signal_when_logged(job_id, log_path, f"completed step: {STOP_AFTER},", slurm)
  info = wait(job_id, slurm)
  log = log_path.read_text()
  assert "JobState=COMPLETED" in info and "Restarts=1" in info, info + log[-3000:]

  for rank in (0, 1):  # both tasks joined one group of two, in both attempts
    assert log.count(f"temoe: jax.distributed process {rank} of 2 (Slurm job {job_id}, 2 device(s)") == 2
  assert log.count("te_moe_block=true -> temoe MoE block") == 4 and "recipe te_no_quant, 2 device(s)" in log
  stops = re.findall(rf"temoe: training stopped after step (\d+) of {STEPS}: .*; checkpoint step \1 saved\. Exit 75", log)
  assert len(stops) == 2 and len(set(stops)) == 1, log[-4000:]  # both tasks saved the same step, then exit 75
  assert log.count(f"restoring from this run's directory step {stops[0]}") == 2  # the requeued attempt resumed there

  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in rows]
  assert all(steps.count(s) == 2 for s in range(1, STEPS)), steps  # each process logged every step
  assert {r["learning/total_weights"] for r in rows} == {2 * 8 * 63}  # the global batch spans both
  losses = [r["learning/loss"] for r in sorted(rows, key=lambda r: r["step"])]
  assert all(math.isfinite(x) for x in losses)
  assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.5, losses

  assert not list(tmp_path.rglob("PWNED")) and not (ROOT / "PWNED").exists()  # nothing ran
