"""What this process can run (its accelerator, Transformer Engine, the cuBLAS under it), and the one
catalog of the GPUs temoe plans for (peaks, HBM, architecture).

Read once per process (`detect()` is cached) so config validation, the block and `temoe doctor`
agree. Nothing here compiles or allocates on a device.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import importlib.util
import os

@dataclasses.dataclass(frozen=True)
class GPU:
  """One GPU temoe plans for: how JAX names it, its architecture, nominal HBM, dense peaks, and the
  links of the systems it ships in (what `temoe plan`'s step model prices collectives with)."""

  name: str  # --gpu value
  device_kind: str  # jax.Device.device_kind
  compute_capability: tuple[int, int]
  hbm_gib: float
  bf16_tflops: float  # dense (no 2:4 sparsity) tensor-core peak
  fp8_tflops: float  # FP8 and MXFP8 run at the same rate
  hbm_tbps: float  # HBM bandwidth, TB/s
  nvlink_gbps: float  # NVLink bandwidth per GPU and direction, GB/s
  nvlink_domain: int  # GPUs one NVLink (NVSwitch) domain joins
  gpus_per_node: int  # GPUs per node (compute tray): a MaxText slice when each node is one
  scale_out_gbps: float  # scale-out NIC bandwidth per GPU and direction, GB/s (InfiniBand / RoCE)
  host_gbps: float  # GPU <-> host memory per GPU and direction, GB/s (what host offload moves over)
  sources: tuple[str, ...] = ()  # where each figure comes from


_KLOCKWOOD_H100 = "glennklockwood.com/garden/processors/h100 (NVIDIA H100 datasheet): bf16 989.4, fp8 1978.9 dense"
_H100_H200 = ("lzwjava.github.io/nvidia-h200-gpu-specs-en: H100 SXM 80 GB HBM3 3.35 TB/s, H200 SXM 141 GB HBM3e "
              "4.8 TB/s, same compute (FP8 3,958 TFLOPS with sparsity), NVLink 4 900 GB/s bidirectional per GPU")
_HGX_NIC = ("docs.nvidia.com/reference-architectures/hgx-ai-factory-h100-h200-b200: HGX H100/H200/B200 nodes of 8 "
            "GPUs, one 400 Gb/s SuperNIC per GPU (2-8-9-400)")
_HGX_PCIE = ("mlcommons inference_results_v4.1 H200-SXM-141GBx8 system: host interconnect PCIe Gen5 x16 "
             "(64 GB/s per direction)")
_B200 = ("glennklockwood.com/garden/processors/B200: HGX B200 (1,000 W) bf16 2,250, fp8 4,500 dense; GB200's B200 "
         "(1,200 W) bf16 2,500, fp8 5,000 dense; 8 TB/s HBM")
_NVL5 = "verda.com/blog/gb300-nvl72-architecture: fifth-generation NVLink 1.8 TB/s per GPU (900 GB/s unidirectional)"
_NVL72 = ("docs.nvidia.com/multi-node-nvlink-systems/multi-node-tuning-guide/system.html: GB200 NVL72 = 18 compute "
          "trays of 4 GPUs in one NVLink domain")
_GB200_NIC = ("mlcommons inference_results_v6.1 GB200-NVL72_GB200-186GB system: 186 GB HBM3e per GPU, 4 ConnectX-7 "
              "(400 Gb/s) per 4-GPU tray, host over NVLink-C2C")
_C2C = ("setloop.io/blog/gb200-nvl72-architecture: NVLink-C2C 900 GB/s between a Grace and its two Blackwell GPUs "
        "(225 GB/s per GPU and direction)")
_GB300 = ("verda.com/blog/gb300-nvl72-architecture: GB300 fp8 5 PFLOPS, bf16 2.5 PFLOPS dense, 279 GB HBM3e, "
          "8 TB/s")
_GB300_NIC = ("docs.nvidia.com/enterprise-reference-architectures/nvl72-ai-factory (GB300 NVL72: 4 ConnectX-8 per "
              "4-GPU tray); NVIDIA's GB300 record article (seeds): ConnectX-8 at 800 Gb/s per GPU")

GPUS = {
    gpu.name: gpu
    for gpu in (
        GPU("h100", "NVIDIA H100 80GB HBM3", (9, 0), 80.0, 989.4, 1978.9, 3.35, 450.0, 8, 8, 50.0, 64.0,
            (_KLOCKWOOD_H100, _H100_H200, _HGX_NIC, _HGX_PCIE)),
        GPU("h200", "NVIDIA H200", (9, 0), 141.0, 989.4, 1978.9, 4.8, 450.0, 8, 8, 50.0, 64.0,
            (_KLOCKWOOD_H100, _H100_H200, _HGX_NIC, _HGX_PCIE)),
        GPU("b200", "NVIDIA B200", (10, 0), 180.0, 2250.0, 4500.0, 8.0, 900.0, 8, 8, 50.0, 64.0,
            (_B200, _NVL5, _HGX_NIC, "HGX B200: host over PCIe Gen5 x16 (64 GB/s per direction)")),
        GPU("gb200", "NVIDIA GB200", (10, 0), 186.0, 2500.0, 5000.0, 8.0, 900.0, 72, 4, 50.0, 225.0,
            (_B200, _NVL5, _NVL72, _GB200_NIC, _C2C)),
        GPU("gb300", "NVIDIA GB300", (10, 3), 279.0, 2500.0, 5000.0, 8.0, 900.0, 72, 4, 100.0, 225.0,
            (_GB300, _NVL5, _NVL72, _GB300_NIC, _C2C)),
    )
}
"""--gpu name -> GPU: the one table `temoe plan` (memory and step time), the FLOP/MFU count and the config
checks read. Link figures are per GPU and direction; none of them was measured by this project."""


def gpu_of_kind(device_kind: str) -> GPU | None:
  """The catalog GPU a JAX device_kind such as 'NVIDIA H200' names, or None (PCIe/NVL cards run at
  lower clocks and are not in the table)."""
  tokens = device_kind.upper().split()
  if "PCIE" in tokens or tokens[-1:] == ["NVL"]:
    return None
  return next((g for g in GPUS.values() if g.name.upper() in tokens), None)


@dataclasses.dataclass(frozen=True)
class Platform:
  """The devices of this process and the Transformer Engine that can drive them."""

  device_platform: str  # "cpu", "gpu", "tpu"
  device_kind: str
  compute_capability: tuple[int, int] | None
  te_version: str | None
  te_error: str | None  # why TE's JAX extension did not load, if it did not
  cublas_version: tuple[int, int, int] | None

  @property
  def te_usable(self) -> bool:
    return self.device_platform == "gpu" and self.te_version is not None and self.te_error is None

  def describe(self) -> str:
    if self.device_platform != "gpu":
      return f"no GPU ({self.device_platform} devices)"
    cc = ".".join(map(str, self.compute_capability)) if self.compute_capability else "?"
    te = f"Transformer Engine {self.te_version}" if self.te_usable else f"no usable Transformer Engine ({self.te_error})"
    cublas = ".".join(map(str, self.cublas_version)) if self.cublas_version else "unknown"
    return f"{self.device_kind} (sm_{cc.replace('.', '')}), {te}, cuBLAS {cublas}"

  def why_not(self, recipe: str, kernel: str = "te") -> str | None:
    """None if `kernel` computes `recipe` here, else why not (the recipe registry decides)."""
    from temoe import recipes  # pylint: disable=import-outside-toplevel

    return recipes.why_not(recipe, kernel, self)

  def runnable_recipes(self) -> tuple[str, ...]:
    """The recipes some GPU kernel computes here."""
    from temoe import recipes  # pylint: disable=import-outside-toplevel

    return recipes.runnable(self)


def _te_status() -> tuple[str | None, str | None]:
  if importlib.util.find_spec("transformer_engine") is None:
    return None, "transformer_engine is not installed"
  try:
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    version = None
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_jax"):
      try:
        version = metadata.version(dist)
        break
      except metadata.PackageNotFoundError:
        continue
    import transformer_engine.jax  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

    return version or "unknown", None
  except Exception as exc:  # pylint: disable=broad-exception-caught
    return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


def _cublas_library_candidates() -> list[str]:
  """cuBLAS as this process would load it: already-mapped first, then pip's nvidia wheels."""
  found = []
  try:
    with open("/proc/self/maps", encoding="utf-8") as maps:
      found += sorted({line.split()[-1] for line in maps if "libcublas.so" in line and "Lt" not in line})
  except OSError:
    pass
  spec = importlib.util.find_spec("nvidia")
  for root in list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []:
    found += sorted(glob.glob(os.path.join(root, "**", "libcublas.so*"), recursive=True), reverse=True)
  return found + ["libcublas.so"]


def cublas_version() -> tuple[int, int, int] | None:
  """The run-time cuBLASLt version TE calls (TE's own reader), else libcublas's via cublasGetProperty."""
  try:
    import transformer_engine_jax  # pylint: disable=import-outside-toplevel

    raw = int(transformer_engine_jax.get_cublasLt_version())  # e.g. 130100
    return raw // 10000, raw // 100 % 100, raw % 100
  except Exception:  # pylint: disable=broad-exception-caught
    pass
  for path in _cublas_library_candidates():
    if "Lt" in os.path.basename(path):
      continue
    try:
      lib = ctypes.CDLL(path)
    except OSError:
      continue
    parts = []
    for prop in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
      value = ctypes.c_int()
      if lib.cublasGetProperty(prop, ctypes.byref(value)) != 0:
        break
      parts.append(value.value)
    if len(parts) == 3:
      return tuple(parts)
  return None


@functools.cache
def detect() -> Platform:
  """Reads this process's platform once. Initialises the JAX backend (after jax.distributed)."""
  import jax  # pylint: disable=import-outside-toplevel

  device = jax.devices()[0]
  cc = None
  if device.platform == "gpu":
    raw = getattr(device, "compute_capability", None)
    if raw:
      major, minor = str(raw).split(".")[:2]
      cc = (int(major), int(minor))
  te_version, te_error = _te_status() if device.platform == "gpu" else (None, "no GPU")
  return Platform(
      device_platform=device.platform,
      device_kind=getattr(device, "device_kind", device.platform),
      compute_capability=cc,
      te_version=te_version,
      te_error=te_error,
      cublas_version=cublas_version() if device.platform == "gpu" else None,
  )
