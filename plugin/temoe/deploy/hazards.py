"""Known scale hazards of expert-parallel runs on NVIDIA GPUs in the stack temoe runs on (JAX 0.11, XLA's
ragged all-to-all, NCCL), each with where it was reported and the setting that avoids it.

`temoe plan` asks about a layout (EP ranks, how many share one NVLink domain, the XLA flags the job runs
with); `temoe doctor` asks about this machine (its GPU's NVLink domain, XLA_FLAGS, NCCL). Only stdlib
and the env profile here: the doctor imports it before anything starts JAX.
"""

from __future__ import annotations

import dataclasses

from temoe.deploy import env

RAGGED_MODE = "xla_gpu_ragged_all_to_all_mode"
"""XLA's memory mode for ragged all-to-all: private (XLA's default in JAX 0.11.2), symmetric, peer."""

ONE_SHOT_PEERS = 32
"""Ranks in one NVLink domain above which XLA's one-shot symmetric-memory ragged all-to-all crashes."""

PEER_KERNEL_RANKS = 8
"""Output pointers XLA's one-shot peer-pointer ragged all-to-all kernel takes (kMaxNumRaggedAllToAllOutputPtrs)."""

BROKEN_NCCL = (2, 30, 7)
"""The NCCL release reported to break ragged all-to-all at EP 64 across NVL72 nodes."""


@dataclasses.dataclass(frozen=True)
class Hazard:
  what: str  # what happens, and to which layout
  fix: str  # the setting that avoids it
  source: str
  blocking: bool  # True: the run will fail as configured; False: it risks failing or slowing


def _symmetric(xla_flags: str) -> bool:
  return env.parse_xla_flags(xla_flags).get(RAGGED_MODE, "private").lower() == "symmetric"


def one_shot_crash(ranks_in_domain: int, xla_flags: str) -> Hazard | None:
  """XLA's one-shot (symmetric-memory) ragged all-to-all fails above 32 ranks in one NVLink domain."""
  if ranks_in_domain <= ONE_SHOT_PEERS:
    return None
  setting = f"--{RAGGED_MODE}=symmetric"
  state = (f"this job's XLA_FLAGS set {setting}: it will fail at the first step" if _symmetric(xla_flags)
           else f"not selected here ({RAGGED_MODE} is private, XLA's default and temoe's profile)")
  return Hazard(
      what=(f"{ranks_in_domain} expert-parallel ranks in one NVLink domain: XLA's one-shot ragged all-to-all "
            f"({setting}) crashes with CUDA_ERROR_ILLEGAL_ADDRESS above {ONE_SHOT_PEERS} ranks; {state}"),
      fix=(f"leave {RAGGED_MODE} at private (do not pass {setting}), or keep at most {ONE_SHOT_PEERS} EP ranks "
           "per NVLink domain"),
      source="openxla/xla#47283 (open; GB200 NVL72, 64 ranks crash, 16 run)",
      blocking=_symmetric(xla_flags),
  )


def peer_kernel_limit(ep: int) -> Hazard | None:
  """EP groups wider than XLA's peer-pointer kernel take its slower ragged all-to-all paths."""
  if ep <= PEER_KERNEL_RANKS:
    return None
  return Hazard(
      what=(f"EP {ep}: XLA's one-shot peer-pointer ragged all-to-all kernel takes at most {PEER_KERNEL_RANKS} "
            "ranks, so this exchange runs on XLA's other ragged all-to-all paths, reported as NCCL send/recv "
            "after a device-to-host copy of the offsets and a host synchronisation; the predicted step time "
            "does not price that latency"),
      fix=f"EP <= {PEER_KERNEL_RANKS} keeps the one-shot kernel; else measure the exchange on the cluster first",
      source=("XLA's ragged_all_to_all kernel (kMaxNumRaggedAllToAllOutputPtrs = 8); marin-community/marin#7891 "
              "(XLA source read at jaxlib 0.11.0's pin)"),
      blocking=False,
  )


def nccl_regression(nccl: tuple[int, int, int] | None, multi_node_nvlink: bool) -> Hazard | None:
  """NCCL 2.30.7 broke ragged all-to-all at EP 64 across NVL72 nodes."""
  if not multi_node_nvlink or nccl is None or tuple(nccl) != BROKEN_NCCL:
    return None
  return Hazard(
      what=("NCCL 2.30.7 with expert parallelism across the nodes of one NVLink domain: ragged all-to-all "
            "failed with CUDA_ERROR_ILLEGAL_ADDRESS at EP 64 on GB200 NVL72 (EP within one tray ran)"),
      fix="use another NCCL (2.28.9 was the last reported to pass), or keep EP within one node",
      source="marin-community/marin#8313 (open)",
      blocking=False,
  )


def for_layout(ep: int, ranks_in_domain: int, xla_flags: str) -> list[Hazard]:
  """What `temoe plan` reports for an expert-parallel layout."""
  found = [one_shot_crash(ranks_in_domain, xla_flags), peer_kernel_limit(ep)] if ep > 1 else []
  return [h for h in found if h]


def for_machine(nvlink_domain: int | None, gpus_per_node: int | None, xla_flags: str,
                nccl: tuple[int, int, int] | None) -> list[Hazard]:
  """What `temoe doctor` reports for this machine: a GPU whose NVLink domain exceeds the one-shot bound
  with the symmetric mode set, and NCCL 2.30.7 on a multi-node NVLink system."""
  found = []
  if nvlink_domain and nvlink_domain > ONE_SHOT_PEERS and _symmetric(xla_flags):
    found.append(one_shot_crash(nvlink_domain, xla_flags))
  found.append(nccl_regression(nccl, bool(nvlink_domain and gpus_per_node and nvlink_domain > gpus_per_node)))
  return [h for h in found if h]
