"""One-rank measurements as the step model reads them: bench/one_rank.py ran one rank of a many-GPU job on one
GPU with the network mocked, so each run holds that rank's compute per stage at the job's real shapes and what
the compiled schedule puts between each collective's start and done. Where a run of the planned layout exists
(same model, devices, mesh, batch and sequence: a calibration of that layout family on the GPU kind it ran on),
`temoe plan` prices the step's compute from it instead of the one-GPU rates, and each collective's exposed time
as its modelled time less the compute the schedule holds beside it (instead of the overlap the XLA flags are
assumed to allow). Network times stay modelled: a mocked collective moves nothing.

Another GPU than the one measured gets the run scaled as the calibration is: GEMM-bound stages by the dense
peak ratio, memory-bound ones by the HBM bandwidth ratio (H100 from the H200: 1.0 and 4.8 / 3.35); the table
says so.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from temoe import hardware
from temoe.tools import step_model

RESULTS = pathlib.Path(__file__).resolve().parents[3] / "bench" / "results" / "one_rank.json"
"""The committed runs (bench/one_rank.py writes them; absent outside a source checkout: nothing is read)."""

GEMM_STAGES = ("attention", "dense", "experts")
MEMORY_STAGES = ("router", "dispatch", "combine", "optimizer", "other")
COMPUTE_STAGES = GEMM_STAGES + MEMORY_STAGES
"""temoe.tools.profiling's categories that are this rank's compute (collectives and idle are not)."""

KINDS = {"expert all-to-all": ("all-to-all", "ragged-all-to-all"), "FSDP all-gather": ("all-gather",),
         "FSDP reduce-scatter": ("reduce-scatter",), "data-parallel all-reduce": ("all-reduce",),
         "tensor-parallel": ("all-gather", "reduce-scatter", "all-reduce"),
         "pipeline send/receive": ("collective-permute",)}
"""The step model's collectives (by name prefix) and the HLO collectives that carry them."""


class OneRankError(ValueError):
  """A one-rank result file that cannot be read."""


@dataclasses.dataclass(frozen=True)
class Measurement:
  config: str
  model: str
  devices: int
  layout: str  # "expert=64 (8x8) fsdp=16 (1x16)": per axis, total (ICI x DCN)
  batch: float  # per_device_batch_size
  seq: int
  gpu: str  # catalog name of the GPU it ran on
  stages_ms: dict  # full depth (extrapolated), profiling's categories
  step_ms: float
  collectives: tuple  # rows of hlo_schedule.summary, full depth
  depth_note: str
  command: str

  def compute_ms(self) -> float:
    return sum(self.stages_ms[s] for s in COMPUTE_STAGES)


def layout_of(mesh_axes, ici, dcn) -> str:
  """The layout as bench/one_rank.py writes it (axes over one device, in MaxText's mesh order)."""
  return " ".join(f"{a}={i * d} ({i}x{d})" for a, i, d in zip(mesh_axes, ici, dcn) if i * d > 1) or "one device"


def load(path: pathlib.Path | None = None) -> list[Measurement]:
  """The GPU runs of a one_rank.json (RESULTS unless told) that were measured (errors and host-device runs left out)."""
  path = path or RESULTS
  if not path.is_file():
    return []
  try:
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
  except (ValueError, KeyError) as exc:
    raise OneRankError(f"{path} is not a one_rank.json ({exc})") from exc
  out = []
  for r in runs:
    if "error" in r or not str(r.get("platform", "")).startswith("gpu"):
      continue
    last = r["measured"][-1]
    gpu = hardware.gpu_of_kind(last["device_kind"])
    if gpu is None:
      continue
    out.append(Measurement(r["config"], last["model_name"], int(r["devices"]), r["layout"],
                           float(last["per_device_batch_size"]), int(last["max_target_length"]), gpu.name,
                           dict(r["stages_ms"]), float(r["step_ms"]), tuple(r["collectives"]), r["depth"]["note"],
                           r["command"]))
  return out


def find(job, measurements: list[Measurement]) -> Measurement | None:
  """The run of `job`'s layout family (model, devices, mesh, batch, sequence), if one was measured."""
  c = job.config
  layout = layout_of(c.mesh_axes, job.ici, job.dcn)
  for m in measurements:
    if (m.model, m.devices, m.layout, m.batch, m.seq) == (str(c.model_name), job.devices, layout,
                                                          float(c.per_device_batch_size), int(c.max_target_length)):
      return m
  return None


def scales(m: Measurement, target: hardware.GPU) -> tuple[float, float]:
  """(GEMM-bound, memory-bound) time factors from the measured GPU to `target`: peak and HBM ratios."""
  source = hardware.GPUS[m.gpu]
  return source.fp8_tflops / target.fp8_tflops, source.hbm_tbps / target.hbm_tbps


def kinds_of(name: str) -> tuple[str, ...]:
  return next((k for prefix, k in KINDS.items() if name.startswith(prefix)), ())


def apply(prediction, m: Measurement):
  """`prediction` with its compute from `m` and its collectives' overlap from `m`'s compiled schedule."""
  gemm, memory = scales(m, prediction.gpu)
  how = "" if m.gpu == prediction.gpu.name else f"; {m.gpu}'s run scaled: GEMMs x{gemm:.2f}, memory-bound x{memory:.2f}"
  stages = [step_model.Stage(s, m.stages_ms[s] / 1e3 * (gemm if s in GEMM_STAGES else memory),
                             f"measured on one rank ({m.gpu}){how}") for s in COMPUTE_STAGES]
  stages.append(step_model.Stage("idle", m.stages_ms["idle"] / 1e3, "measured: the rank's GPU waiting on the host"))
  budget = {}
  for row in m.collectives:
    if row["async"] and row["overlapped_ms"] is not None:
      budget[row["kind"]] = budget.get(row["kind"], 0.0) + row["overlapped_ms"] / 1e3 * gemm
  present = {row["kind"] for row in m.collectives}
  collectives = []
  groups = {}
  for x in prediction.collectives:
    groups.setdefault(kinds_of(x.name), []).append(x)
  for kinds, members in groups.items():
    total = sum(x.seconds for x in members) or 1.0
    hide = sum(budget.get(k, 0.0) for k in kinds)
    for x in members:
      if not kinds:
        collectives.append(x)
      elif not present & set(kinds):
        collectives.append(dataclasses.replace(x, note=x.note + "; not in the compiled schedule: modelled overlap"))
      else:
        take = min(x.seconds, hide * x.seconds / total)
        collectives.append(dataclasses.replace(
            x, exposed=x.seconds - take,
            note=f"{x.note.split(';')[0]}; the schedule holds {hide * 1e3:.1f} ms of compute beside "
                 f"{'/'.join(kinds)}: hides {take * 1e3:.1f} ms"))
  note = (f"compute and overlap from the one-rank run of this layout ({m.layout}; {m.depth_note}); "
          f"network modelled; {m.command}")
  return dataclasses.replace(prediction, stages=tuple(stages), collectives=tuple(collectives),
                             notes=(*prediction.notes, note))
