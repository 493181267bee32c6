"""The rates `temoe plan`'s step model runs on: one JSON per GPU kind (`tools/calibrations/<gpu>.json`, package
data written by bench/calibrate.py), and their scaling to a GPU that has none.

A calibration holds what one GPU measured (one MoE layer per expert path and shape class, dense GEMM rates
per dtype, attention core rates per kernel, elementwise bandwidth) and, under `fitted`, the few
constants fitted to one profiled training step (each naming the profile and the benchmark rows it was
fitted to, so those rows are never counted as checks of it). A GPU without its own file gets the
reference one scaled: compute by the ratio of dense peaks of the dtype, memory-bound parts by the ratio
of HBM bandwidths, fitted efficiencies unchanged; every use of a scaled or substituted number says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from temoe import hardware

DIRECTORY = pathlib.Path(__file__).resolve().parent / "calibrations"
"""Package data, in the package itself: a wheel, a non-editable install and the image carry it (a link out of the
package would not reach them: the image's build context holds no bench/)."""

REFERENCE = "h200"
"""The GPU kind a GPU without its own calibration is scaled from."""

PATH_DTYPE = {"temoe_fp8": "fp8", "te_fp8": "fp8", "temoe_bf16": "bf16", "tokamax_bf16": "bf16"}
"""Grouped-MLP paths of a calibration and the tensor-core dtype their GEMMs run in."""


class CalibrationError(ValueError):
  """A calibration file that is missing, unreadable or lacks what the step model needs."""


def load(path: pathlib.Path) -> dict:
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as exc:
    raise CalibrationError(f"calibration {path} cannot be read: {exc}") from exc
  missing = [k for k in ("gpu", "origin", "grouped_mlp", "dense_gemm_tflops", "elementwise_tbps", "fitted") if k not in data]
  if missing:
    raise CalibrationError(f"calibration {path} lacks {', '.join(missing)}")
  return data


def available(directory: pathlib.Path = DIRECTORY) -> list[str]:
  return sorted(p.stem for p in directory.glob("*.json"))


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Rates for GPU `gpu`, from `data` (the calibration of GPU `source`), scaled when `source` != `gpu`."""

  gpu: hardware.GPU
  source: hardware.GPU
  data: dict
  path: str

  @property
  def scaled(self) -> bool:
    return self.gpu.name != self.source.name

  def describe(self) -> str:
    origin = self.data["origin"]
    where = f"{self.path} ({origin}"
    where += ": built from committed one-GPU results, not a calibrate.py run)" if origin == "derived" else ")"
    if self.scaled:
      return (f"{self.gpu.name}: no calibration measured; {self.source.name}'s {where} scaled by dense peaks "
              f"(bf16 x{self.compute_scale('bf16'):.2f}, fp8 x{self.compute_scale('fp8'):.2f}) and HBM bandwidth "
              f"(x{self.bandwidth_scale():.2f})")
    return f"{self.gpu.name}: {where}"

  def compute_scale(self, dtype: str) -> float:
    attr = "fp8_tflops" if dtype == "fp8" else "bf16_tflops"
    return getattr(self.gpu, attr) / getattr(self.source, attr)

  def bandwidth_scale(self) -> float:
    return self.gpu.hbm_tbps / self.source.hbm_tbps

  def fitted(self, key: str, sub: str | None = None) -> float:
    entry = self.data["fitted"].get(key, {})
    entry = entry.get(sub, {}) if sub else entry
    if "value" not in entry:
      raise CalibrationError(f"calibration {self.path} has no fitted {key}{'.' + sub if sub else ''}")
    return float(entry["value"])

  def dense_tflops(self, dtype: str) -> float:
    """Dense GEMM rate, fwd+bwd, as it runs inside a training step (the micro-benchmark rate times the
    fitted in-step efficiency)."""
    entry = self.data["dense_gemm_tflops"].get(dtype, {})
    if "value" not in entry:
      raise CalibrationError(f"calibration {self.path} has no {dtype} dense GEMM rate ({entry.get('error', 'missing')})")
    return float(entry["value"]) * self.fitted("dense_efficiency") * self.compute_scale(dtype)

  def attention_core_tflops(self, kernel: str) -> tuple[float, str]:
    """(fwd+bwd TFLOP/s of the attention core of `kernel`, what the number is). Measured kernels first,
    then fitted ones; a kernel with neither is priced as the nearest one, said in the note."""
    measured = self.data.get("attention_core_tflops", {})
    fitted = self.data["fitted"].get("attention_core_tflops", {})
    name = kernel if kernel in measured or kernel in fitted else NEAREST_ATTENTION.get(kernel, "autoselected")
    note = "" if name == kernel else f"attention={kernel} not calibrated: priced as {name}"
    entry = measured.get(name) or fitted.get(name)
    if not entry:
      raise CalibrationError(f"calibration {self.path} has no attention core rate for {name}")
    return float(entry["value"]) * self.compute_scale("bf16"), note

  def measured_tbps(self) -> float:
    """HBM bandwidth of elementwise kernels as the micro-benchmark measured it (gathers and scatters run at it)."""
    return float(self.data["elementwise_tbps"]["value"]) * self.bandwidth_scale()

  def elementwise_tbps(self) -> float:
    """Effective bandwidth of the step's elementwise and weight-moving ops (the measured bandwidth times the
    fitted in-step efficiency)."""
    return self.measured_tbps() * self.fitted("elementwise_efficiency")

  def optimizer_tbps(self) -> float:
    """The optimizer's effective bandwidth: its measured rate (else the elementwise one) times the fitted
    in-step efficiency (XLA fuses part of the update into the backward)."""
    base = self.data.get("optimizer_tbps", self.data["elementwise_tbps"])
    return float(base["value"]) * self.bandwidth_scale() * self.fitted("optimizer_efficiency")

  def grouped_class(self, path: str, hidden: int, ffn: int, experts: int) -> tuple[dict, str]:
    """The measured MoE-layer class of grouped-MLP path `path` for `experts` local experts of shape
    (hidden, ffn): of the classes with that shape, the one whose expert count is nearest (in ratio);
    without one, the class nearest in weight elements per expert (said in the note)."""
    classes = {n: c for n, c in self.data["grouped_mlp"].get(path, {}).items() if isinstance(c, dict) and "layer_ms" in c}
    if not classes:
      raise CalibrationError(f"calibration {self.path} has no grouped-MLP path {path}")
    exact = {n: c for n, c in classes.items() if (c["hidden"], c["expert_ffn"]) == (hidden, ffn)}
    if exact:
      name = min(exact, key=lambda n: (abs(math.log(exact[n]["experts"] / max(experts, 1))), -exact[n]["experts"]))
      return exact[name], ""
    name, entry = min(classes.items(), key=lambda nc: abs(nc[1]["hidden"] * nc[1]["expert_ffn"] - hidden * ffn))
    return entry, f"expert shape {hidden}x{ffn} not calibrated: scaled from class {name} ({entry['hidden']}x{entry['expert_ffn']})"


NEAREST_ATTENTION = {"flash": "autoselected", "cudnn_flash_jax": "cudnn_flash_te", "dot_product": "autoselected"}
"""Attention kernels a calibration may not hold, and the calibrated kernel that prices them."""


def calibration_for(gpu_name: str, directory: pathlib.Path = DIRECTORY) -> Calibration:
  """The calibration of `gpu_name`: its own file, else the reference GPU's scaled to it."""
  if gpu_name not in hardware.GPUS:
    raise CalibrationError(f"unknown GPU {gpu_name!r}; valid choices: {', '.join(sorted(hardware.GPUS))}")
  own = directory / f"{gpu_name}.json"
  path = own if own.is_file() else directory / f"{REFERENCE}.json"
  if not path.is_file():
    raise CalibrationError(f"no calibration for {gpu_name} nor {REFERENCE} in {directory}; "
                           "run bench/calibrate.py on a GPU (docs/guides/planning.md)")
  data = load(path)
  if data["gpu"] not in hardware.GPUS:
    raise CalibrationError(f"calibration {path} is for {data['gpu']!r}, not a GPU of temoe.hardware.GPUS")
  display = path if path.parent != DIRECTORY else pathlib.Path("temoe/tools/calibrations") / path.name
  return Calibration(hardware.GPUS[gpu_name], hardware.GPUS[data["gpu"]], data, str(display))
