"""`temoe train` runs in subprocesses for the tests that stop, resume and compare them.

Each run writes MaxText's JSONL metrics (`metrics_file=`) and its log to files (a pipe nobody
reads would stall a long log); checkpoints are MaxText's own, under <base>/<run>/checkpoints.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

from conftest import HANG_S, ROOT, SCHEDULE_STEPS, SMOKE
from temoe.run import preflight

SCHEDULE = f"learning_rate_schedule_steps={SCHEDULE_STEPS}"
"""Every run here follows one 32-step learning-rate schedule, whatever its `steps`: the schedule is the only
thing `steps` changes in the compiled train step, so the runs of one model, mesh and learning rate are one
program, compiled once per session (conftest's JAX_CACHE) and loaded by the others. Runs of the same steps
compute the same losses (the session's reference runs 16 steps of it; a run of fewer steps computes its first
steps exactly); one of more than 32 steps would add a zero-rate tail to the schedule (another program); an
override still wins."""


def command(base: pathlib.Path, data: str, run: str, metrics: str, *overrides: str) -> list[str]:
  return [
      sys.executable, "-m", "temoe.cli", "train", SMOKE, f"base_output_directory={base}", f"run_name={run}",
      f"grain_train_files={data}", f"metrics_file={base / metrics}", SCHEDULE, *overrides,
  ]


def start(base: pathlib.Path, data: str, run: str, metrics: str, *overrides: str, env: dict | None = None,
          log_name: str | None = None) -> subprocess.Popen:
  """Starts a run; its stdout and stderr go to <base>/<metrics>.log (or <base>/<log_name>)."""
  log = open(base / (log_name or f"{metrics}.log"), "w", encoding="utf-8")  # pylint: disable=consider-using-with
  return subprocess.Popen(command(base, data, run, metrics, *overrides), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                          env={**os.environ, **(env or {})})


def start_group(base: pathlib.Path, data: str, run: str, metrics: str, *overrides: str,
                processes: int = 2) -> list[subprocess.Popen]:
  """Starts one run as `processes` processes joined by jax.distributed, with the variables srun gives each
  task (JAX's Slurm detection: process id and count), the coordinator on a port no process listens on now
  (JAX_COORDINATOR_ADDRESS; Slurm's own port, from the job id, could be another group's); logs
  <metrics>.<i>.log."""
  port = free_port()
  return [start(base, data, run, metrics, *overrides, log_name=f"{metrics}.{rank}.log", env={
      "SLURM_JOB_ID": str(port), "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": str(processes),
      "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "JAX_COORDINATOR_ADDRESS": f"localhost:{port}"})
      for rank in range(processes)]


def free_port() -> int:
  """A TCP port the system hands out as unused (bound to port 0, then closed): not a draw of ours from a
  fixed range, where two groups running at once (two pytest workers, two sessions) could meet."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def signal_at(proc: subprocess.Popen, log: pathlib.Path, pattern: str, nth: int = 1, sig: int = signal.SIGTERM,
              timeout: float = HANG_S) -> str | None:
  """Sends `sig` to `proc` as soon as `log` holds the `nth` line matching `pattern`; returns that line
  (None if the run ended first); raises if the run neither got there nor ended within `timeout` (hung)."""
  deadline, found = time.monotonic() + timeout, re.compile(pattern)
  while time.monotonic() < deadline:
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    hits = [line for line in text.splitlines() if found.search(line)]
    if len(hits) >= nth:
      if proc.poll() is None:
        os.kill(proc.pid, sig)
      return hits[nth - 1]
    if proc.poll() is not None:
      return None
    time.sleep(0.002)
  raise AssertionError(f"{log}: no line matching {pattern!r} and the run still going after {timeout} s (hung?)")


def train(base: pathlib.Path, data: str, run: str, metrics: str, *overrides: str, timeout: int = HANG_S):
  """Runs to completion; returns ({step: loss}, log)."""
  proc = start(base, data, run, metrics, *overrides)
  proc.wait(timeout)
  log = (base / f"{metrics}.log").read_text(encoding="utf-8")
  assert proc.returncode == 0, log[-4000:]
  return losses(base / metrics), log


def finish(proc: subprocess.Popen, base: pathlib.Path, metrics: str, timeout: int = HANG_S) -> tuple[int, str]:
  """Waits for a started run; returns (exit code, log)."""
  proc.wait(timeout)
  return proc.returncode, (base / f"{metrics}.log").read_text(encoding="utf-8")


def temoe_lines(log: str) -> list[str]:
  """The lines `temoe train` itself printed (`temoe: ...`)."""
  return [line for line in log.splitlines() if line.startswith("temoe: ")]


def losses(path: pathlib.Path) -> dict[int, float]:
  """{step: learning/loss} of a metrics JSONL file, as the exact floats MaxText wrote."""
  rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
  return {int(r["step"]): r["learning/loss"] for r in rows}


def finalized_steps(checkpoints: pathlib.Path) -> list[int]:
  """Committed checkpoint steps, as Orbax lists them (an in-flight save is a tmp dir, not listed)."""
  return preflight.finalized_steps(str(checkpoints))


def kill_after_checkpoint(proc: subprocess.Popen, checkpoints: pathlib.Path, after: int, timeout: float = HANG_S) -> None:
  """SIGKILLs `proc` as soon as a checkpoint of a step >= `after` is committed."""
  deadline = time.monotonic() + timeout
  while proc.poll() is None and time.monotonic() < deadline:
    if any(step >= after for step in finalized_steps(checkpoints)):
      os.kill(proc.pid, signal.SIGKILL)
      break
    time.sleep(0.002)
  proc.wait(timeout)
