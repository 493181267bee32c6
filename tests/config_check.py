"""Validates configs the way MaxText would on their target clusters, each in a fresh process; prints JSON.

    python tests/config_check.py CONFIG --nodes N --gpus-per-node G [--slices S] [--gpu KIND] [key=value ...]
    python tests/config_check.py --batch < checks.json     (a JSON list of such argument lists)

Each check's process simulates the cluster's device count (XLA's host-platform devices), and, with --gpu,
the GPU temoe's recipe checks see; then MaxText's pyconfig validates the config and MaxText's
create_device_mesh lays its mesh over stand-ins for the cluster's GPUs: one process each, grouped
in `--slices` slices (XLA gives GPUs one slice per node), which is how MaxText splits ICI and DCN.
--batch imports MaxText and reads each config's YAML chain once, then forks a child per check before any JAX backend
exists, so each check still starts with no devices, no config and no recipe-check target of another: the same as a
fresh process, without importing MaxText or reading the YAML files again (most of a check's time). It prints `CONFIG_CHECK <i> <json>` for the i-th check.
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


def parse(argv: list[str]):
  parser = argparse.ArgumentParser()
  parser.add_argument("config")
  parser.add_argument("--nodes", type=int, default=1)
  parser.add_argument("--gpus-per-node", type=int, default=1)
  parser.add_argument("--slices", type=int)
  parser.add_argument("--gpu", choices=sorted(hardware.GPUS))
  return parser.parse_known_args(argv)


def check(argv: list[str]) -> dict:
  """One check, in a process whose JAX backend does not exist yet (it sets the device count)."""
  args, overrides = parse(argv)
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
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  try:
    with introspect.yaml_read_once():  # the chain --batch read before the fork
      config = maxtext_config(*([f"num_slices={slices}"] if args.gpu else []), *overrides, config=args.config)
  except Exception as exc:  # pylint: disable=broad-exception-caught
    return {"error": f"{type(exc).__name__}: {exc}"}
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  stand_ins = None
  if args.gpu:
    per_slice = devices // slices
    stand_ins = [GpuStandIn(i, i, i // per_slice, hardware.GPUS[args.gpu].device_kind) for i in range(devices)]
  try:
    mesh = maxtext_utils.create_device_mesh(config, stand_ins)
  except (ValueError, AssertionError) as exc:
    return {"error": f"mesh: {exc}"}
  size = model_size.count(config)
  return {
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
  }


def batch(checks: list[list[str]]) -> None:
  """Each check in a child forked from this process once MaxText is imported (tests/forked_cases.py: no JAX backend,
  no thread yet)."""
  import importlib  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, os.path.dirname(__file__))
  import conftest  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  import forked_cases  # pylint: disable=import-outside-toplevel
  import temoe.maxtext  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import  (before MaxText)
  from temoe.maxtext import introspect, seams  # pylint: disable=import-outside-toplevel

  # what a check imports: MaxText's modules temoe.register() checks (imported, not hooked), temoe's own
  for name in [*seams.TOUCHPOINTS, *(m for m, _ in seams.CLASS_ATTRIBUTES), "maxtext.configs.pyconfig",
               "maxtext.utils.maxtext_utils", "temoe.maxtext.adapter", "temoe.maxtext.checkpointing",
               "temoe.maxtext.batches", "temoe.maxtext.metrics", "temoe.maxtext.router", "temoe.tools.model_size"]:
    importlib.import_module(name)
  for config in {parse(argv)[0].config for argv in checks}:  # each YAML chain read once, not once a check
    introspect.read_config_chain(config)
  for i, argv in enumerate(checks):
    def one(out, argv=argv) -> int:  # the child: one check, its line through the pipe
      try:
        out.write(json.dumps(check(argv)))
        return 0
      except BaseException as exc:  # pylint: disable=broad-exception-caught
        out.write(json.dumps({"crash": f"{type(exc).__name__}: {exc}"}))
        return 1

    line, status = forked_cases.collect(*forked_cases.fork(one))
    if not line:
      line = json.dumps({"crash": f"check process ended with status {status} and no result"})
    print(f"CONFIG_CHECK {i} {line}", flush=True)


def main() -> None:
  if sys.argv[1:] == ["--batch"]:
    batch(json.load(sys.stdin))
  else:
    print("CONFIG_CHECK " + json.dumps(check(sys.argv[1:])))


if __name__ == "__main__":
  main()
