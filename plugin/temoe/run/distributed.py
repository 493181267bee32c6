"""Joins a Slurm job's tasks into one jax.distributed group before MaxText runs, on any platform.

MaxText forms the group itself only in its GPU modes (`hardware=gpu_multiprocess` calls
`jax.distributed.initialize()`, which reads Slurm's environment, but also loads Transformer
Engine); its CPU mode reads XPK's variables alone. So `srun -n 2 temoe train <cpu config>` would
train two unrelated one-process jobs. Under a Slurm step of more than one task, temoe calls
`jax.distributed.initialize()` itself (JAX's Slurm detection: coordinator on the step's first
node, process id SLURM_PROCID, count SLURM_NTASKS; CPU collectives through gloo), before anything
touches a device; MaxText then finds the group formed and skips its own initialisation.
"""

from __future__ import annotations

import os
import sys

SLURM_STEP_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
"""What JAX's Slurm detection reads; SLURM_STEP_NODELIST exists only inside an srun step."""


def slurm_tasks(environ=os.environ) -> int:
  """Tasks of the Slurm step this process runs in; 0 outside one."""
  if not all(var in environ for var in SLURM_STEP_VARS):
    return 0
  return int(environ["SLURM_NTASKS"])


def maybe_initialize(environ=os.environ) -> bool:
  """Forms the job's jax.distributed group if this is one task of several under srun; says so.

  Returns True if this call formed it. Call before MaxText (or anything else) initialises JAX.
  """
  import jax  # pylint: disable=import-outside-toplevel

  if slurm_tasks(environ) < 2 or jax.distributed.is_initialized():
    return False
  jax.distributed.initialize()
  print(
      f"temoe: jax.distributed process {jax.process_index()} of {jax.process_count()} "
      f"(Slurm job {environ['SLURM_JOB_ID']}, {jax.device_count()} device(s) in the group)",
      file=sys.stderr,
      flush=True,
  )
  return True


OK, FINISHED, FAILED = "ok", "finished", "failed"
KINDS = (OK, FINISHED, FAILED)
LINE_BYTES = 4096
"""How much of a process's one line its peers get (UTF-8, cut with '...' past that)."""


class PeerStopped(Exception):
  """Another process of the job stopped before training; the message is the one line to print."""

  def __init__(self, message: str, kind: str):
    super().__init__(message)
    self.kind = kind


def agree_before_training(kind: str, line: str = "") -> None:
  """Every process of a jax.distributed job says how its preflight ended (`kind`: OK, FINISHED or FAILED,
  with its one line) and hears the others': one all-gather of a fixed-size record per process
  (`multihost_utils.process_allgather`). A process whose own preflight passed raises PeerStopped
  naming the first peer that failed (or, none failing, that found the run finished), so the whole
  job stops before training with one line per process; without this, the peers of a failed process
  start MaxText and wait in its first collective until JAX's heartbeat timeout aborts them all (which
  is still what happens when a peer dies before it reports). No-op in one process."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  if not jax.distributed.is_initialized() or jax.process_count() < 2:
    return
  records = np.asarray(multihost_utils.process_allgather(encode(kind, line)))
  if kind != OK:
    return  # this process says its own line
  me, count = jax.process_index(), jax.process_count()
  outcomes = [decode(record) for record in records]
  for wanted in (FAILED, FINISHED):
    for process, (their_kind, their_line) in enumerate(outcomes):
      if their_kind == wanted and process != me:
        raise PeerStopped(f"process {process} of {count} stopped before training: {their_line}", wanted)


def encode(kind: str, line: str):
  """(LINE_BYTES + 1,) uint8: the kind's index, then the line in UTF-8, zero-padded."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  data = line.encode("utf-8")
  if len(data) > LINE_BYTES:
    data = data[:LINE_BYTES - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."
  record = np.zeros(LINE_BYTES + 1, np.uint8)
  record[0] = KINDS.index(kind)
  record[1:1 + len(data)] = np.frombuffer(data, np.uint8)
  return record


def decode(record) -> tuple[str, str]:
  return KINDS[int(record[0])], bytes(record[1:]).rstrip(b"\0").decode("utf-8", "replace")
