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
