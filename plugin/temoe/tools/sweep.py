"""`temoe plan --sweep`: the expert / FSDP / data-parallel layouts of a config over N devices in S slices,
each planned for memory (temoe.tools.hbm) and step time (temoe.tools.step_model), the ones that fit ranked
by predicted tokens/s per GPU.

Layouts: every power-of-two expert-parallel size that divides the expert count, placed inside a slice
first (ICI) and then across slices (DCN); the rest of a slice is FSDP, the rest of the slices every split
between FSDP and data parallelism. Tensor, pipeline and context parallelism stay as the config has them
(not swept), and so does the batch.
"""

from __future__ import annotations

import dataclasses
import math
import sys

AXES = ("expert", "fsdp", "data")


@dataclasses.dataclass(frozen=True)
class Layout:
  ici: dict  # axis -> size inside a slice
  dcn: dict  # axis -> size across slices

  def overrides(self) -> list[str]:
    return [f"ici_{a}_parallelism={self.ici[a]}" for a in AXES] + [f"dcn_{a}_parallelism={self.dcn[a]}" for a in AXES]

  def describe(self) -> str:
    return " ".join(f"{a} {self.ici[a] * self.dcn[a]} ({self.ici[a]}x{self.dcn[a]})" for a in AXES
                    if self.ici[a] * self.dcn[a] > 1) or "one device"


def powers_of_two(n: int) -> list[int]:
  return [2**i for i in range(int(math.log2(n)) + 1) if n % 2**i == 0]


def layouts(num_experts: int, devices: int, slices: int) -> list[Layout]:
  per_slice = devices // slices
  out = []
  for ep in powers_of_two(min(devices, max(num_experts, 1))):
    if num_experts % ep:
      continue
    ep_ici = math.gcd(ep, per_slice)
    ep_dcn = ep // ep_ici
    if slices % ep_dcn:
      continue
    rest = slices // ep_dcn
    for fsdp_dcn in powers_of_two(rest):
      out.append(Layout({"expert": ep_ici, "fsdp": per_slice // ep_ici, "data": 1},
                        {"expert": ep_dcn, "fsdp": fsdp_dcn, "data": rest // fsdp_dcn}))
  return out


@dataclasses.dataclass(frozen=True)
class Row:
  layout: Layout
  peak_gib: float
  fits: bool
  prediction: object | None  # step_model.Prediction
  why: str = ""  # why it was not planned


def run(path: str, overrides: list[str], devices: int, slices: int, gpu: str, hbm_gib: float | None,
        environ: dict[str, str], progress=sys.stderr) -> list[Row]:
  """Plans every layout; rows in the order planned."""
  from temoe.tools import calibration, planner, step_model  # pylint: disable=import-outside-toplevel

  import temoe  # pylint: disable=import-outside-toplevel

  temoe.register()
  rows, calib = [], None
  seen, _, _ = planner.target(gpu, hbm_gib)
  with planner.platform_seen_as(seen):  # the expert count only: no estimate of the config as it stands
    experts = planner.build_config(path, overrides, devices).num_experts
  candidates = layouts(experts, devices, slices)
  for i, layout in enumerate(candidates):
    print(f"temoe plan --sweep: {i + 1}/{len(candidates)} {layout.describe()}", file=progress, flush=True)
    try:
      p = planner.make_plan(path, [*overrides, *layout.overrides()], devices, gpu, hbm_gib)
    except Exception as exc:  # pylint: disable=broad-exception-caught
      rows.append(Row(layout, 0.0, False, None, str(exc).splitlines()[0][:200]))
      continue
    peak = p.estimate.peak / 2**30
    fits = bool(p.hbm_gib) and peak <= p.hbm_gib
    prediction = None
    if fits:
      calib = calib or calibration.calibration_for(p.gpu)
      ici, dcn = planner.mesh_split(p.config, devices)
      job = step_model.job_of(p.config, ici, dcn, slices, p.backend, p.quantization, p.estimate)
      prediction = step_model.predict(job, calib, step_model.xla_flags_for(calib.gpu, environ)[1])
    rows.append(Row(layout, peak, fits, prediction))
  return rows


def table(rows: list[Row], devices: int, slices: int) -> list[str]:
  ranked = sorted((r for r in rows if r.prediction), key=lambda r: -r.prediction.tokens_per_s)
  lines = [f"temoe plan --sweep: {len(rows)} layouts of {devices} devices in {slices} slices (expert, FSDP, data "
           f"as ICI x DCN), {len(ranked)} fit; ranked by predicted tokens/s/GPU:",
           f"  {'rank':>4}  {'layout':<46} {'peak GiB':>9} {'step ms':>9} {'tokens/s/GPU':>13} {'TFLOP/s/GPU':>12} {'MFU':>6}"]
  for i, r in enumerate(ranked, 1):
    p = r.prediction
    lines.append(f"  {i:>4}  {r.layout.describe():<46} {r.peak_gib:9.1f} {p.step_seconds * 1e3:9.1f} "
                 f"{p.tokens_per_s:13,.0f} {p.tflops:12,.0f} {p.mfu:6.1%}")
  for r in rows:
    if not r.prediction:
      lines.append(f"  {'-':>4}  {r.layout.describe():<46} "
                   + (f"{r.peak_gib:9.1f}  does not fit" if not r.why else f"{'':>9}  not planned: {r.why}"))
  if ranked:
    lines.append(f"best: {ranked[0].layout.describe()}: {ranked[0].prediction.tflops:,.0f} TFLOP/s/GPU, "
                 f"{ranked[0].prediction.tokens_per_s:,.0f} tokens/s/GPU (settings: {' '.join(ranked[0].layout.overrides())})")
  return lines
