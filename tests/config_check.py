"""Validates one config the way MaxText would on its target cluster, in a fresh process; prints JSON.

    python tests/config_check.py CONFIG --nodes N --gpus-per-node G [--slices S] [--gpu KIND] [key=value ...]

The process simulates the cluster's device count (XLA's host-platform devices), and, with --gpu,
the GPU temoe's recipe checks see; then MaxText's pyconfig validates the config and MaxText's
create_device_mesh lays its mesh over stand-ins for the cluster's GPUs: one process each, grouped
in `--slices` slices (XLA gives GPUs one slice per node), which is how MaxText splits ICI and DCN.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from temoe import hardware  # no JAX import: XLA_FLAGS below still apply

STAND_IN_CUBLAS = (13, 4, 0)  # what a current NGC image ships; only the recipe checks read it


@dataclasses.dataclass(frozen=True)
class GpuStandIn:
  """What mesh building reads from a jax.Device, for a GPU of a cluster this process is not on."""

  id: int
  process_index: int
  slice_index: int
  device_kind: str
  platform: str = "gpu"


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("config")
  parser.add_argument("--nodes", type=int, default=1)
  parser.add_argument("--gpus-per-node", type=int, default=1)
  parser.add_argument("--slices", type=int)
  parser.add_argument("--gpu", choices=sorted(hardware.GPUS))
  args, overrides = parser.parse_known_args()
  devices = args.nodes * args.gpus_per_node
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  sys.path.insert(0, os.path.dirname(__file__))
  from conftest import maxtext_config  # pylint: disable=import-outside-toplevel
  from temoe.tools import model_size  # pylint: disable=import-outside-toplevel

  if args.gpu:
    gpu = hardware.GPUS[args.gpu]
    kind, cc, cublas = gpu.device_kind, gpu.compute_capability, STAND_IN_CUBLAS
    target = hardware.Platform("gpu", kind, cc, "2.20.2", None, cublas)
    hardware.detect = lambda: target
  slices = args.slices or args.nodes
  try:
    config = maxtext_config(*([f"num_slices={slices}"] if args.gpu else []), *overrides, config=args.config)
  except Exception as exc:  # pylint: disable=broad-exception-caught
    print("CONFIG_CHECK " + json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    return
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  stand_ins = None
  if args.gpu:
    per_slice = devices // slices
    stand_ins = [GpuStandIn(i, i, i // per_slice, hardware.GPUS[args.gpu].device_kind) for i in range(devices)]
  try:
    mesh = maxtext_utils.create_device_mesh(config, stand_ins)
  except (ValueError, AssertionError) as exc:
    print("CONFIG_CHECK " + json.dumps({"error": f"mesh: {exc}"}))
    return
  size = model_size.count(config)
  print("CONFIG_CHECK " + json.dumps({
      "mesh": dict(zip(config.mesh_axes, mesh.shape)),
      "mesh_devices": int(mesh.size),
      "distinct_devices": len({d.id for d in mesh.flat}),
      "num_target_devices": config.num_target_devices,
      "num_slices": config.num_slices,
      "global_batch": config.global_batch_size_to_train_on,
      "total_params": size.total,
      "active_params": size.active,
      "offloaded": list(config.tensors_to_offload or []),
      "keys": {k: v for k, v in config.get_keys().items() if isinstance(v, (str, int, float, bool))},
  }))


if __name__ == "__main__":
  main()
