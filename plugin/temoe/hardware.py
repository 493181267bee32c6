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
  """One GPU temoe plans for: how JAX names it, its architecture, nominal HBM and dense peaks."""

  name: str  # --gpu value
  device_kind: str  # jax.Device.device_kind
  compute_capability: tuple[int, int]
  hbm_gib: float
  bf16_tflops: float  # dense (no 2:4 sparsity) tensor-core peak
  fp8_tflops: float  # FP8 and MXFP8 run at the same rate


# H100 SXM5: bf16 989.4, fp8 1978.9 (NVIDIA H100 datasheet, as tabulated at
# glennklockwood.com/garden/processors/h100); H200 SXM is the same GH100 compute with more HBM.
# B200 (HGX, 1000 W): bf16 2250, fp8 4500; GB200 (NVL72, 1200 W): bf16 2500, fp8 5000 (NVIDIA's
# GB200 NVL72 / HGX B200 spec tables: 10 and 9 PFLOPS sparse FP8 per GPU).
GPUS = {
    gpu.name: gpu
    for gpu in (
        GPU("h100", "NVIDIA H100 80GB HBM3", (9, 0), 80.0, 989.4, 1978.9),
        GPU("h200", "NVIDIA H200", (9, 0), 141.0, 989.4, 1978.9),
        GPU("b200", "NVIDIA B200", (10, 0), 180.0, 2250.0, 4500.0),
        GPU("gb200", "NVIDIA GB200", (10, 0), 186.0, 2500.0, 5000.0),
    )
}
"""--gpu name -> GPU: the one table `temoe plan`, the FLOP/MFU count and the config checks read."""


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
