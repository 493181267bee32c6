"""What this process can run: its accelerator, Transformer Engine, and the cuBLAS under it.

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

def grouped_gemm_min_cublas(compute_capability: tuple[int, int] | None) -> tuple[int, int]:
  """The run-time cuBLAS(Lt) TE 2.20's bf16 grouped GEMM kernel (nvte_grouped_gemm) needs.

  TE's own check (check_grouped_gemm_requirements) asks 13.4 on Hopper (sm_90), 13.3 on Blackwell.
  """
  return (13, 4) if (compute_capability or (9, 0)) < (10, 0) else (13, 3)


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

  def why_not(self, recipe: str) -> str | None:
    """None if `recipe` runs here with the te backend, else the reason it does not."""
    from temoe.recipes import MIN_COMPUTE_CAPABILITY  # pylint: disable=import-outside-toplevel

    if not self.te_usable:
      return "the te backend needs a GPU with Transformer Engine."
    need = MIN_COMPUTE_CAPABILITY.get(recipe)
    if need and (self.compute_capability or (0, 0)) < need:
      arch = "Blackwell (sm_100+)" if need >= (10, 0) else "Ada/Hopper (sm_89+)"
      return f"{recipe} needs {arch}."
    need_cublas = grouped_gemm_min_cublas(self.compute_capability)
    if recipe == "te_no_quant" and (self.cublas_version or (0, 0, 0))[:2] < need_cublas:
      have = ".".join(map(str, self.cublas_version)) if self.cublas_version else "an unknown version"
      return (
          f"TE's bf16 grouped GEMM needs cuBLAS >= {'.'.join(map(str, need_cublas))} here, this process "
          f"loads {have}; use an image with a newer CUDA (NGC JAX images), or te_moe_backend=xla for bf16."
      )
    return None

  def runnable_recipes(self) -> tuple[str, ...]:
    from temoe.recipes import RECIPES  # pylint: disable=import-outside-toplevel

    return tuple(r for r in RECIPES if self.why_not(r) is None)


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
