"""The plan of one training run before launch: MaxText's config built for the target GPU and device count
(as `temoe train` builds it; MaxText's internal_compile_num_devices sets the count without the devices), its
mesh, and the per-device HBM estimate of `temoe.tools.hbm` on an abstract mesh. Read by `temoe plan`
(temoe.tools.plan) and its layout sweep (temoe.tools.sweep); nothing is compiled or allocated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
from typing import Any

from temoe import hardware

STAND_IN_CUBLAS = (13, 4, 0)  # what a current NGC JAX image loads; only temoe's recipe checks read it


class PlanInputError(ValueError):
  """Arguments `temoe plan` cannot plan for; exit code 2."""


STATELESS_TE_QUANTIZATION = ("te_fp8_currentscaling", "te_mxfp8")
"""MaxText's TE dense-layer recipes that add no parameters or state (no amax history)."""

TOLERANCE = 0.15
"""How far an estimate may be from a measured peak (tests, bench/plan_check.py)."""

MAX_HBM_GIB, MAX_DEVICES = 1e6, 1 << 20
"""Bounds of a sane --hbm-gib and --devices/--slices (inf or 10^12 devices are typos, not plans)."""


def build_config(path: str, overrides: list[str], devices: int | None = None):
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  fixed = ["skip_jax_distributed_system=true", "log_config=false", "enable_checkpointing=false"]
  if devices:
    fixed += ["internal_compile=true", f"internal_compile_num_devices={devices}"]
  return introspect.initialize_config(["temoe plan", path, *overrides, *fixed])


def explicit_devices(config) -> int:
  """Devices the config's mesh names explicitly (each -1 axis counts 1)."""
  return math.prod(max(int(p), 1) for p in [*config.ici_parallelism, *config.dcn_parallelism])


def mesh_split(config, devices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(ICI, DCN) size of each mesh axis over `devices` devices, filled as MaxText fills them."""
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  slices = max(config.num_slices, 1)
  ici = introspect.fill_mesh_axes(list(config.ici_parallelism), devices // slices, "ICI")
  dcn = introspect.fill_mesh_axes(list(config.dcn_parallelism), slices, "DCN")
  return tuple(int(a) for a in ici), tuple(int(b) for b in dcn)


def abstract_mesh(config, devices: int):
  """The config's mesh over `devices` devices, filled as MaxText fills it, without devices."""
  import jax  # pylint: disable=import-outside-toplevel

  ici, dcn = mesh_split(config, devices)
  return jax.sharding.AbstractMesh(tuple(a * b for a, b in zip(ici, dcn)), tuple(config.mesh_axes))


def target(gpu: str, hbm_gib: float | None):
  """(platform temoe's checks see, HBM GiB to fit in, where that number comes from)."""
  import jax  # pylint: disable=import-outside-toplevel

  local = hardware.detect()
  if local.device_platform == "gpu":
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    where = "--hbm-gib" if hbm_gib else f"{local.device_kind}: XLA's allocator limit in this environment"
    return local, hbm_gib or (limit / 2**30 if limit else None), where
  spec = hardware.GPUS[gpu]
  kind, gib = spec.device_kind, spec.hbm_gib
  stand_in = hardware.Platform("gpu", kind, spec.compute_capability, "stand-in", None, STAND_IN_CUBLAS)
  where = "--hbm-gib" if hbm_gib else f"no GPU here: {kind}'s nominal {gib:g} GiB (--gpu, --hbm-gib)"
  return stand_in, hbm_gib or gib, where


@contextlib.contextmanager
def platform_seen_as(seen):
  """temoe's recipe checks judge `seen` (the target GPU) while the config is built."""
  detect = hardware.detect
  hardware.detect = lambda: seen
  try:
    yield
  finally:
    hardware.detect = detect


@dataclasses.dataclass(frozen=True)
class Plan:
  config: Any
  mesh: Any
  backend: str
  estimate: Any  # temoe.tools.hbm.Estimate
  hbm_gib: float | None
  hbm_source: str
  notes: tuple[str, ...] = ()
  quantization: str = ""  # MaxText's `quantization` as asked (the config may be planned without it)
  gpu: str = "h200"  # the catalog GPU the run is planned for


def requested(path: str, overrides: list[str], key: str) -> str | None:
  """`key` as the command line or the config's own YAML chain sets it (MaxText's base.yml and model configs left
  out: they do not override an explicit value), or None where neither sets it or the chain cannot be read."""
  import yaml  # pylint: disable=import-outside-toplevel

  from temoe.run import inputs  # pylint: disable=import-outside-toplevel

  for item in reversed(overrides):
    name, _, value = item.partition("=")
    if name.strip() == key:
      return value.strip().strip("'\"")
  maxtext = os.path.realpath(inputs.maxtext_configs_dir())
  seen = set()
  while path and os.path.isfile(path) and os.path.realpath(path) not in seen:
    if os.path.realpath(os.path.dirname(path)).startswith(maxtext):
      return None
    seen.add(os.path.realpath(path))
    try:
      with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
      return None
    if not isinstance(data, dict):
      return None
    if key in data:
      return str(data[key] or "")
    base = str(data.get("base_config") or "")
    beside = os.path.join(os.path.dirname(path), base)
    path = base if os.path.isabs(base) else beside if base and os.path.isfile(beside) else ""
  return None


def make_plan(path: str, overrides: list[str], devices: int | None = None, gpu: str = "h200",
              hbm_gib: float | None = None) -> Plan:
  """Builds the config for the target (this host's GPU, else `gpu`) and estimates it."""
  import jax  # pylint: disable=import-outside-toplevel

  import temoe  # pylint: disable=import-outside-toplevel
  from temoe.tools import hbm  # pylint: disable=import-outside-toplevel
  from temoe import recipes  # pylint: disable=import-outside-toplevel
  temoe.register()
  here = hardware.detect()
  seen, hbm_gib, where = target(gpu, hbm_gib)
  without_te = importlib.util.find_spec("transformer_engine") is None
  asked = requested(path, overrides, "quantization")
  ahead = ["quantization=''"] if without_te and asked in STATELESS_TE_QUANTIZATION else []
  built_for = devices or jax.device_count()  # the count MaxText would take from this host
  with platform_seen_as(seen):  # built as planned where that is known ahead (else built again below)
    config = build_config(path, [*overrides, *ahead], built_for)
  first = seen
  if not str(config.hardware).startswith("gpu"):  # a CPU run is planned for this host
    seen = here
  count = devices or max(explicit_devices(config), jax.device_count() if seen is here else 1)
  notes, unquantized = (), []
  quantization = asked if ahead else str(getattr(config.quantization, "value", config.quantization) or "")
  if quantization in STATELESS_TE_QUANTIZATION and without_te:
    # MaxText imports TE to build its quantized dense layers; these recipes keep no state, so the
    # parameters and optimizer state are the unquantized layers'. Planned as those, and said so.
    notes = (f"quantization={quantization} planned without Transformer Engine (not installed here): "
             "its dense layers hold the same parameters, FP8 copies are transient",)
    unquantized = ["quantization=''"]
  if count != built_for or seen is not first or unquantized != ahead:  # else the first build is this one
    with platform_seen_as(seen):
      config = build_config(path, [*overrides, *unquantized], count)
  if config.te_moe_block:
    backend = recipes.resolve_backend(config.te_moe_backend, str(config.te_gmm_quantization), seen,
                                      recipes.model_shape(config))
  else:  # MaxText's own MoE: a grouped-GEMM kernel, or ragged_dot as temoe's xla backend
    backend = "gmm" if config.megablox or config.use_tokamax_gmm else "xla"
  slices = max(int(config.num_slices), 1)
  if count % slices:
    raise PlanInputError(f"num_slices={slices} does not divide the {count} device(s) planned (a slice, a GPU node, "
                         "holds as many devices as each other): pass --devices N, the job's device count")
  try:
    mesh = abstract_mesh(config, count)
  except AssertionError as exc:  # MaxText's own check of the mesh against the device count
    raise PlanInputError(f"the config's mesh cannot span {count} device(s): {exc}") from exc
  local = hardware.gpu_of_kind(here.device_kind) if here.device_platform == "gpu" else None
  return Plan(config, mesh, backend, hbm.estimate(config, mesh, backend, seen.device_platform), hbm_gib, where, notes,
              quantization, local.name if local else gpu)
