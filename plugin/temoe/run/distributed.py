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


AGREE_TIMEOUT_S = 1200
"""How long a process waits for its peers' preflights (each reads the data and the latest checkpoint)."""
OK, FINISHED, FAILED = "ok", "finished", "failed"


class PeerStopped(Exception):
  """Another process of the job stopped before training; the message is the one line to print."""

  def __init__(self, message: str, kind: str):
    super().__init__(message)
    self.kind = kind


class PeerLost(PeerStopped):
  """A peer never reported its preflight (it died, or hangs): a requeue may find it back."""


def agree_before_training(kind: str, line: str = "") -> None:
  """Every process of a jax.distributed job says how its preflight ended (`kind`: OK, FINISHED or FAILED,
  with its one line) and waits for all the others. A process whose own preflight passed raises
  PeerStopped naming the first peer that failed (or, none failing, that found the run finished), so
  the whole job stops before training with one line per process; without this, the peers of a
  failed process start MaxText and wait in its first collective until the heartbeat timeout aborts
  them all. Raises PeerLost if a peer does not report within AGREE_TIMEOUT_S. No-op in one process."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import distributed  # pylint: disable=import-outside-toplevel  # the coordination service's key-value store

  client = distributed.global_state.client
  if client is None or jax.process_count() < 2:
    return
  me, count = jax.process_index(), jax.process_count()
  client.key_value_set(f"temoe/preflight/{me}", f"{kind}\n{line}")
  try:
    client.wait_at_barrier("temoe_preflight", AGREE_TIMEOUT_S * 1000)
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    reported = {int(key.rsplit("/", 1)[-1]) for key, _ in _try_dir(client)}
    missing = [str(p) for p in range(count) if p not in reported] or ["?"]
    raise PeerLost(f"process(es) {', '.join(missing)} of {count} did not finish the preflight within "
                   f"{AGREE_TIMEOUT_S} s ({type(exc).__name__}); a requeue starts the job again", FAILED) from exc
  if kind != OK:
    return  # this process says its own line
  outcomes = sorted((int(key.rsplit("/", 1)[-1]), *value.split("\n", 1)) for key, value in _try_dir(client))
  for wanted in (FAILED, FINISHED):
    for process, their_kind, their_line in outcomes:
      if their_kind == wanted and process != me:
        raise PeerStopped(f"process {process} of {count} stopped before training: {their_line}", wanted)


def _try_dir(client) -> list[tuple[str, str]]:
  try:
    return client.key_value_dir_get("temoe/preflight/")
  except Exception:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    return []
