"""One `temoe train` per run directory: a lock file beside MaxText's checkpoints.

Two runs with the same base_output_directory and run_name would write the same checkpoint steps,
and MaxText lets the second replace the first's. The lock (`<run dir>/temoe.lock`) records who
holds it: host, pid, start time, Slurm job. A holder refreshes its mtime every `HEARTBEAT_S`; a
lock is stale when its holder is gone: a dead pid on this host, a lock not refreshed for
`STALE_S` on another, or an earlier attempt of this same Slurm job (a requeue). The job's first
process takes it; its other processes write into the same run by design.

Taking it is atomic: the whole decision (create it with O_EXCL, or read it, judge it stale and
replace it) happens under an exclusive flock of `temoe.lock.guard`, so two processes that find
the same stale lock cannot both take it over. The kernel drops a flock when its process dies, so
the guard is never stale itself; a filesystem without flock falls back to the decision alone.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import threading
import time

from temoe import recipes

LOCK_NAME = "temoe.lock"
HEARTBEAT_S = 30.0
STALE_S = 4 * HEARTBEAT_S


class RunLocked(recipes.TemoeConfigError):
  """Another live `temoe train` holds this run directory."""


def process_rank(environ=os.environ) -> int:
  """This process's index in its job: jax.distributed's, else the launcher's (Slurm, JobSet), else 0."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.distributed.is_initialized():
    return jax.process_index()
  for var in ("SLURM_PROCID", "NODE_RANK", "JAX_PROCESS_ID"):
    if environ.get(var, "").isdigit():
      return int(environ[var])
  return 0


def _start_ticks(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (tells a reused pid from its holder), or None."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(pid: int, ticks: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return ticks is None or _start_ticks(pid) in (None, ticks)


def holder_info(environ=os.environ) -> dict:
  return {
      "host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
      "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "slurm_job": environ.get("SLURM_JOB_ID"), "argv": sys.argv[1:4],
  }


def stale_reason(holder: dict, age_s: float, me: dict) -> str | None:
  """Why the lock's holder no longer runs, or None if it may."""
  if holder.get("slurm_job") and holder.get("slurm_job") == me.get("slurm_job"):
    return f"an earlier attempt of Slurm job {holder['slurm_job']}"
  if holder.get("host") == me["host"]:
    if not isinstance(holder.get("pid"), int):
      return "it names no process"
    return None if _alive(holder["pid"], holder.get("start_ticks")) else f"pid {holder['pid']} has exited"
  return f"not refreshed for {age_s:.0f} s" if age_s > STALE_S else None


def describe(holder: dict) -> str:
  job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
  return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}"


class RunLock:
  """A held lock; `release()` (idempotent) removes it if it is still this process's."""

  def __init__(self, path: str, info: dict):
    self.path, self.info = path, info
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="temoe-run-lock", daemon=True)
    self._thread.start()

  def _beat(self):
    while not self._stop.wait(HEARTBEAT_S):
      try:
        os.utime(self.path)
      except OSError:
        return

  def release(self) -> None:
    self._stop.set()
    with guard(self.path):
      if read(self.path)[0] == self.info:
        os.unlink(self.path)


@contextlib.contextmanager
def guard(path: str):
  """Holds an exclusive flock of `<path>.guard` (a file never removed) for one lock decision."""
  try:
    fd = os.open(f"{path}.guard", os.O_RDWR | os.O_CREAT, 0o644)
  except OSError:
    yield
    return
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # no flock on this filesystem: the decision alone
      pass
    yield
  finally:
    os.close(fd)  # drops the flock


def read(path: str) -> tuple[dict | None, float]:
  """(the holder recorded in the lock file or {} if unreadable, its age in s); (None, 0) if there is none."""
  try:
    age = time.time() - os.stat(path).st_mtime
    with open(path, encoding="utf-8") as f:
      holder = json.load(f)
    return (holder if isinstance(holder, dict) else {}), age
  except FileNotFoundError:
    return None, 0.0
  except (OSError, ValueError):
    return {}, age


def write(path: str, info: dict) -> None:
  """Replaces the lock file with `info` in one rename (a reader never sees it half-written)."""
  tmp = f"{path}.tmp-{info['pid']}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(info, f)
  os.replace(tmp, path)


def acquire(run_dir: str, environ=os.environ) -> RunLock | None:
  """Takes the run directory's lock (None for a job's non-first process); raises RunLocked if held."""
  if process_rank(environ) != 0:
    return None
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, LOCK_NAME)
  me = holder_info(environ)
  with guard(path):
    holder, age = read(path)
    if holder is not None:
      reason = stale_reason(holder, age, me) if holder else "it is unreadable"  # written whole, by rename
      if reason is None:
        raise RunLocked(
            f"run directory {run_dir} is in use by another temoe train ({describe(holder)}); wait for it to "
            f"end, pass another run_name, or, if that run is gone, delete {path}."
        )
      print(f"temoe: taking over the stale run lock {path} ({reason})", file=sys.stderr, flush=True)
    write(path, me)
  return RunLock(path, me)
