"""`temoe train` runs in processes of their own for the tests that stop, resume and compare them, forked from
tests/forkserver.py (FORK), which imported MaxText once for this pytest process.

Each run writes MaxText's JSONL metrics (`metrics_file=`) and its log to files (a pipe nobody
reads would stall a long log); checkpoints are MaxText's own, under <base>/<run>/checkpoints.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from conftest import HANG_S, ROOT, SCHEDULE_STEPS, SMOKE
from temoe.run import checksums, preflight

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


FORK = os.environ.get("TEMOE_TEST_FORK", "1") != "0"
"""Runs are forked from tests/forkserver.py (MaxText imported once per pytest process, not once per run: ~9 CPU-s
a run); TEMOE_TEST_FORK=0 starts each with `python -m temoe.cli` instead."""


_FORKED_CPU_S = [0.0]


def forked_cpu_s() -> float:
  """User+system CPU seconds of the forked runs that have ended so far in this process's session (the fork server
  reports each child's at its end) and of the server's imports: conftest's cpu_s hook adds them to the test they
  ended in."""
  return _FORKED_CPU_S[0]


class Forked:
  """A run forked by the fork server, with the parts of Popen the tests use: pid, poll, wait, returncode, kill."""

  def __init__(self, server: "ForkServer", pid: int):
    self.server, self.pid, self.returncode = server, pid, None
    self.args = f"forked temoe train (pid {pid})"

  def poll(self) -> int | None:
    self.returncode = self.server.exit_code(self.pid, 0)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    self.returncode = self.server.exit_code(self.pid, timeout)
    if self.returncode is None:
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def kill(self) -> None:
    if self.poll() is None:
      os.kill(self.pid, signal.SIGKILL)


class ForkServer:
  """tests/forkserver.py, started on first use by this process; its replies read by a thread."""

  def __init__(self):
    self.proc = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).with_name("forkserver.py"))], cwd=ROOT,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 env=dict(os.environ), text=True)
    self.lock, self.changed = threading.Lock(), threading.Condition(threading.Lock())
    self.pids, self.codes, self.next_id = {}, {}, 0
    while True:  # what MaxText's imports print comes first
      ready = self.proc.stdout.readline()
      assert ready, "the fork server ended before it was ready"
      if ready.startswith('{"ready"'):
        _FORKED_CPU_S[0] += json.loads(ready).get("cpu_s", 0.0)
        break
    threading.Thread(target=self.read, daemon=True).start()
    atexit.register(self.stop)

  def stop(self) -> None:
    """Ends the server (EOF) and waits for it, so its runs' CPU time counts as this process's children's."""
    self.proc.stdin.close()
    try:
      self.proc.wait(60)
    except subprocess.TimeoutExpired:
      self.proc.kill()

  def read(self) -> None:
    for line in self.proc.stdout:
      if not line.startswith("{"):
        continue
      reply = json.loads(line)
      with self.changed:
        if "id" in reply:  # a pid comes back only after its earlier child's exit was reported: not this run's
          self.pids[reply["id"]] = reply["pid"]
          self.codes.pop(reply["pid"], None)
        else:
          self.codes[reply["pid"]] = reply["code"]
          _FORKED_CPU_S[0] += reply.get("cpu_s", 0.0)
        self.changed.notify_all()
    with self.changed:  # the server ended: whoever waits on an answer learns it now
      self.changed.notify_all()

  def start(self, args: list[str], env: dict, log: pathlib.Path, code: str | None = None,
            err: pathlib.Path | None = None) -> Forked:
    request = {"args": args, "env": env, "cwd": str(ROOT), "log": str(log), **({"code": code} if code else {}),
               **({"err": str(err)} if err else {})}
    with self.lock:
      self.next_id += 1
      ask = self.next_id
      self.proc.stdin.write(json.dumps({"id": ask, **request}) + "\n")
      self.proc.stdin.flush()
    with self.changed:
      answered = self.changed.wait_for(lambda: ask in self.pids or self.proc.poll() is not None, HANG_S)
      assert answered and ask in self.pids, f"the fork server did not answer (exit {self.proc.poll()})"
      return Forked(self, self.pids.pop(ask))

  def exit_code(self, pid: int, timeout: float | None) -> int | None:
    with self.changed:
      self.changed.wait_for(lambda: pid in self.codes, timeout)
      return self.codes.get(pid)


_SERVER: list[ForkServer] = []


def launch(argv: list[str], log: pathlib.Path, env: dict | None = None,
           err: pathlib.Path | None = None) -> subprocess.Popen | Forked:
  """Starts `argv` (`python -m temoe.cli ...`, as `command()` gives it, or `python -c code ...`) with its stdout and
  stderr to `log` (its stderr to `err` if given): forked by the fork server (FORK), else a process of its own."""
  full_env = {**os.environ, **(env or {})}
  for path in (log, err) if err else (log,):
    path.write_text("", encoding="utf-8")
  if FORK:
    if not _SERVER:
      _SERVER.append(ForkServer())
    return _SERVER[0].start(argv[3:], full_env, log, code=argv[2] if argv[1] == "-c" else None, err=err)
  out = open(log, "a", encoding="utf-8")  # pylint: disable=consider-using-with
  errors = open(err, "a", encoding="utf-8") if err else subprocess.STDOUT  # pylint: disable=consider-using-with
  return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=errors, env=full_env)


def start(base: pathlib.Path, data: str, run: str, metrics: str, *overrides: str, env: dict | None = None,
          log_name: str | None = None) -> subprocess.Popen | Forked:
  """Starts a run; its stdout and stderr go to <base>/<metrics>.log (or <base>/<log_name>)."""
  return launch(command(base, data, run, metrics, *overrides), base / (log_name or f"{metrics}.log"), env)


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


class LogTail:
  """The lines a growing log has gained since the last look: each look reads only the bytes written since the one
  before (a poll every 2 ms that read and split the whole log cost a fifth of a core while a run compiled)."""

  def __init__(self, path: pathlib.Path):
    self.path, self.offset, self.partial = path, 0, b""

  def new_lines(self) -> list[str]:
    """The complete lines written since the last call (a line still being written waits for its newline)."""
    try:
      with open(self.path, "rb") as log:
        log.seek(self.offset)
        data = log.read()
    except FileNotFoundError:
      return []
    self.offset += len(data)
    done, _, self.partial = (self.partial + data).rpartition(b"\n")
    return done.decode("utf-8", errors="replace").splitlines() if done else []


def signal_at(proc: subprocess.Popen, log: pathlib.Path, pattern: str, nth: int = 1, sig: int = signal.SIGTERM,
              timeout: float = HANG_S) -> str | None:
  """Sends `sig` to `proc` as soon as `log` holds the `nth` line matching `pattern`; returns that line
  (None if the run ended first); raises if the run neither got there nor ended within `timeout` (hung)."""
  deadline, found, tail, hits = time.monotonic() + timeout, re.compile(pattern), LogTail(log), []
  while time.monotonic() < deadline:
    hits += [line for line in tail.new_lines() if found.search(line)]
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


def copy_run(run: pathlib.Path, to: pathlib.Path, latest: int) -> pathlib.Path:
  """A copy of the run directory `run` at `to` whose checkpoints end at step `latest`: the later steps and their
  checksum records are left out, as if the run had stopped after saving `latest` (the session's reference runs,
  copied for a test that resumes or damages them). Returns `to`."""
  shutil.copytree(run, to)
  for step in finalized_steps(to / "checkpoints"):
    if step > latest:
      shutil.rmtree(to / "checkpoints" / str(step))
      for record in (to / checksums.RECORDS).glob(f"{step}.process_*.json"):
        record.unlink()
  assert finalized_steps(to / "checkpoints")[-1] == latest, f"{run} holds no checkpoint of step {latest}"
  return to


def wait_for_checkpoint(proc: subprocess.Popen, checkpoints: pathlib.Path, after: int = 0,
                        timeout: float = HANG_S) -> int | None:
  """The first committed checkpoint step >= `after` as soon as Orbax lists one, or None once `proc` has ended
  without one. Orbax commits a step by renaming its temporary directory, so the directory's names are looked at
  every 2 ms and Orbax's listing (~30 ms a call) is asked when they change, and every 50 ms besides."""
  deadline, names, asked = time.monotonic() + timeout, None, 0.0
  while proc.poll() is None:
    now = time.monotonic()
    assert now < deadline, f"{checkpoints}: no checkpoint of a step >= {after} after {timeout} s (hung?)"
    try:
      listed = sorted(os.listdir(checkpoints))
    except FileNotFoundError:
      listed = []
    if listed != names or now - asked > 0.05:
      names, asked = listed, now
      steps = [step for step in finalized_steps(checkpoints) if step >= after]
      if steps:
        return steps[0]
    time.sleep(0.002)
  return None


def kill_after_checkpoint(proc: subprocess.Popen, checkpoints: pathlib.Path, after: int, timeout: float = HANG_S) -> None:
  """SIGKILLs `proc` as soon as a checkpoint of a step >= `after` is committed."""
  if wait_for_checkpoint(proc, checkpoints, after, timeout) is not None and proc.poll() is None:
    os.kill(proc.pid, signal.SIGKILL)
  proc.wait(timeout)
