"""`temoe plan --sweep`: the layouts of a config over N devices in S slices, each planned for memory
(temoe.tools.hbm) and step time (temoe.tools.step_model), the ones that fit ranked by predicted tokens/s per GPU.

Dimensions: tensor parallelism (inside a slice), pipeline stages (across slices: MaxText's pipeline, one repeat,
its microbatches), expert parallelism (every power of two dividing the expert count, inside a slice first, then
across slices), FSDP (the rest of a slice, and any share of the rest of the slices) and data parallelism (the
remainder), and where experts are split: the exchange (ragged, dedup, hier with its node size) and te_moe_chunks.
Context and sequence parallelism and the batch stay as the config has them.

MaxText's config and its abstract train state are built once per family of layouts (one per pipeline shape: the
parameter tree changes with it); each layout reads that config with its own mesh settings (`Varied`) and that state
resharded over its mesh (`hbm.retarget`: MaxText's logical axis rules do not depend on the axes' sizes). A family
MaxText or temoe refuses (routed_bias under a pipeline, circular repeats, a train state the mesh does not shard evenly:
temoe.tools.shardings) is listed with the reason, never ranked.
"""

from __future__ import annotations

import dataclasses
import math
import sys

AXES = ("data", "stage", "fsdp", "tensor", "expert")
"""The mesh axes the sweep sets; every other axis of the config must be 1."""
KEY = {"stage": "pipeline"}
"""MaxText's setting of a mesh axis: ici_<name>_parallelism, dcn_<name>_parallelism."""


def key(kind: str, axis: str) -> str:
  return f"{kind}_{KEY.get(axis, axis)}_parallelism"
EXCHANGES = ("ragged", "dedup", "hier")
CHUNKS = (1, 2, 4)
MAX_TENSOR = 8
"""Tensor parallelism stays inside one node's NVLink (8 GPUs on the catalog's nodes)."""
MAX_STAGES = 16
TOP = 25
"""Ranked layouts the table prints (the best first); the others are counted."""
REPEATS_REFUSED = ("num_pipeline_repeats > 1: MaxText 0.2.5's circular pipeline failed to build on the smoke model "
                   "with temoe's block and with MaxText's own MoE alike (a pytree structure error inside MaxText; "
                   "docs/guides/expert-parallelism.md)")


@dataclasses.dataclass(frozen=True)
class Layout:
  ici: dict  # axis -> size inside a slice
  dcn: dict  # axis -> size across slices
  exchange: str = "auto"
  node: int = 8  # te_moe_ep_node_size (hier)
  chunks: int = 1
  microbatches: int = 0  # pipeline microbatches (0: no pipeline)
  pipeline_layers: int = 0  # MaxText's pipeline_parallel_layers (0: the config's)
  repeats: int = 1  # MaxText's num_pipeline_repeats (circular pipeline)

  def size(self, axis: str) -> int:
    return self.ici[axis] * self.dcn[axis]

  def family(self) -> tuple[int, int]:
    return self.size("stage"), self.pipeline_layers

  def overrides(self) -> list[str]:
    out = [f"{key('ici', a)}={self.ici[a]}" for a in AXES] + [f"{key('dcn', a)}={self.dcn[a]}" for a in AXES]
    if self.size("stage") > 1:
      stages = self.size("stage")
      out += [f"num_pipeline_microbatches={self.microbatches}", f"pipeline_parallel_layers={self.pipeline_layers}",
              f"num_layers_per_pipeline_stage={self.pipeline_layers // (stages * self.repeats)}",
              f"num_pipeline_repeats={self.repeats}"]
    out += [f"te_moe_exchange={self.exchange}", f"te_moe_chunks={self.chunks}"]
    if self.exchange == "hier" or self.node != 8:
      out.append(f"te_moe_ep_node_size={self.node}")
    return out

  def mesh_text(self) -> str:
    names = {"data": "DP", "stage": "PP", "fsdp": "FSDP", "tensor": "TP", "expert": "EP"}
    return " ".join(f"{names[a]}{self.size(a)}" for a in ("tensor", "stage", "expert", "fsdp", "data")
                    if self.size(a) > 1) or "one device"

  def describe(self) -> str:
    parts = [self.mesh_text()]
    if self.size("stage") > 1:
      parts.append(f"mb{self.microbatches}" + (f" r{self.repeats}" if self.repeats > 1 else ""))
    if self.size("expert") > 1:
      parts.append(self.exchange + (f"/{self.node}" if self.exchange == "hier" else ""))
      if self.chunks > 1:
        parts.append(f"x{self.chunks} chunks")
    return " ".join(parts)


def powers_of_two(n: int) -> list[int]:
  return [2**i for i in range(int(math.log2(max(n, 1))) + 1) if n % 2**i == 0]


def exchange_choices(ep: int, ep_ici: int, ep_dcn: int) -> list[tuple[str, int]]:
  """(exchange, node size) for an expert axis of `ep` ranks, `ep_ici` of them in a slice: hier only where the axis
  spans nodes, its node the slice's ranks where it spans slices (temoe's check), else each divisor of the slice."""
  if ep <= 1:
    return [("auto", 8)]
  out = [("ragged", 8), ("dedup", 8)]
  if ep_dcn > 1 and ep_ici > 1:
    out.append(("hier", ep_ici))
  elif ep_dcn == 1:
    out += [("hier", n) for n in powers_of_two(ep_ici) if 2 <= n < ep_ici]
  return out


def layouts(num_experts: int, devices: int, slices: int, heads: int = 0, batch: int = 1,
            pipeline_layers: int = 0) -> list[Layout]:
  """Every layout of the dimensions above over `devices` in `slices` (`batch`: sequences per device, which bound
  the pipeline's microbatches; `pipeline_layers`: MaxText's pipeline_parallel_layers, cut to a multiple of the
  stages)."""
  per_slice = devices // slices
  out = []
  for tp in powers_of_two(per_slice):
    if tp > MAX_TENSOR or (heads and heads % tp):
      continue
    for stages in powers_of_two(slices):
      if stages > MAX_STAGES or (stages > 1 and pipeline_layers < stages):
        continue
      layers = pipeline_layers // stages * stages if stages > 1 else 0
      micros = [stages * 2**k for k in range(int(math.log2(max(batch, 1))) + 1)] if stages > 1 else [0]
      for ep in powers_of_two(min(devices // (tp * stages), max(num_experts, 1))):
        if num_experts % ep:
          continue
        ep_ici = math.gcd(ep, per_slice // tp)
        ep_dcn = ep // ep_ici
        if (slices // stages) % ep_dcn:
          continue
        rest = slices // (stages * ep_dcn)
        for fsdp_dcn in powers_of_two(rest):
          ici = {"data": 1, "stage": 1, "fsdp": per_slice // (tp * ep_ici), "tensor": tp, "expert": ep_ici}
          dcn = {"data": rest // fsdp_dcn, "stage": stages, "fsdp": fsdp_dcn, "tensor": 1, "expert": ep_dcn}
          for exchange, node in exchange_choices(ep, ep_ici, ep_dcn):
            for chunks in CHUNKS if ep > 1 else (1,):
              for micro in micros:
                out.append(Layout(ici, dcn, exchange, node, chunks, micro, layers))
  return out


class Varied:
  """A built MaxText config read with a layout's settings in place of its own (`fields`); every other value is the
  built config's. What the plan reads of a config's mesh is these fields (tests/unit/test_sweep.py compares the
  plans against configs built for each layout)."""

  def __init__(self, base, fields: dict):
    object.__setattr__(self, "_base", base)
    object.__setattr__(self, "_fields", fields)

  def __getattr__(self, name):
    fields = object.__getattribute__(self, "_fields")
    return fields[name] if name in fields else getattr(object.__getattribute__(self, "_base"), name)

  def __setattr__(self, name, value):
    raise AttributeError(f"a varied config is read-only ({name})")


def varied(config, layout: Layout) -> Varied:
  fields = {}
  for a in AXES:
    fields[key("ici", a)], fields[key("dcn", a)] = layout.ici[a], layout.dcn[a]
  axes = list(config.mesh_axes)
  fields["ici_parallelism"] = [layout.ici.get(a, v) for a, v in zip(axes, config.ici_parallelism)]
  fields["dcn_parallelism"] = [layout.dcn.get(a, v) for a, v in zip(axes, config.dcn_parallelism)]
  fields.update(te_moe_exchange=layout.exchange, te_moe_chunks=layout.chunks, te_moe_ep_node_size=layout.node)
  if layout.size("stage") > 1:
    fields["num_pipeline_microbatches"] = layout.microbatches
  return Varied(config, fields)


def family_base(layout: Layout, devices: int, slices: int) -> Layout:
  """The layout a family's config and state are built for: `layout`'s pipeline, and every other swept axis of size
  2 or more where the devices allow (tensor, expert, FSDP, then data; inside a slice first). MaxText drops the mesh
  axes of size 1 from each parameter's PartitionSpec (maxtext.utils.sharding.remove_size_one_mesh_axis), so a state
  built with every axis present reshards to any layout of the family; one built with an axis of size 1 would not."""
  per_slice, rest = devices // slices, slices // layout.size("stage")
  ici = {a: 1 for a in AXES}
  dcn = {**{a: 1 for a in AXES}, "stage": layout.size("stage")}
  for axis in ("tensor", "expert", "fsdp", "data"):
    if per_slice >= 2:
      ici[axis], per_slice = 2, per_slice // 2
    elif rest >= 2:
      dcn[axis], rest = 2, rest // 2
  ici["fsdp"] *= per_slice
  dcn["fsdp"] *= rest
  ep = ici["expert"] * dcn["expert"]
  return dataclasses.replace(layout, ici=ici, dcn=dcn, exchange="dedup" if ep > 1 else "auto", node=8, chunks=1)


@dataclasses.dataclass(frozen=True)
class Row:
  layout: Layout
  peak_gib: float
  fits: bool
  prediction: object | None  # step_model.Prediction
  why: str = ""  # why it was not planned (refused)
  margin: bool = False  # fits with the plan's tolerance to spare (planner.TOLERANCE)


def check_axes(config) -> None:
  """The sweep sets AXES and leaves the others at 1: a config that sets another one is not swept."""
  from temoe.tools import planner  # pylint: disable=import-outside-toplevel

  others = [f"{key(kind, a)}={v}" for kind, values in (("ici", config.ici_parallelism), ("dcn", config.dcn_parallelism))
            for a, v in zip(config.mesh_axes, values) if a not in AXES and int(v) not in (1, -1)]
  if others:
    raise planner.PlanInputError(f"--sweep sets {', '.join(AXES)} parallelism and keeps the others at 1; the config "
                                 f"sets {' '.join(others)}")


def layout_refusal(config, layout: Layout, tokens: int) -> str:
  """Why temoe refuses `layout` of a built family config (its config checks, with the layout's settings), or ''."""
  from temoe.maxtext import config as schema  # pylint: disable=import-outside-toplevel
  from temoe.moe import exchange  # pylint: disable=import-outside-toplevel

  try:
    schema.check_node_boundary(config)
    if layout.size("expert") > 1:
      exchange.resolve(layout.exchange, layout.size("expert"), "gpu", node_size=layout.node)
  except ValueError as exc:
    return str(exc).splitlines()[0]
  if layout.chunks > 1 and tokens % layout.chunks:
    return f"te_moe_chunks={layout.chunks} does not divide the {tokens} tokens a device's MoE block holds"
  if layout.microbatches and (config.micro_batch_size_to_train_on % layout.microbatches):
    return (f"num_pipeline_microbatches={layout.microbatches} does not divide the batch of "
            f"{config.micro_batch_size_to_train_on} sequences")
  return ""


def run(path: str, overrides: list[str], devices: int, slices: int, gpu: str, hbm_gib: float | None,
        environ: dict[str, str], progress=sys.stderr) -> list[Row]:
  """Plans every layout; rows in the order planned."""
  import jax  # pylint: disable=import-outside-toplevel

  from temoe.tools import calibration, hbm, planner, shardings, step_model  # pylint: disable=import-outside-toplevel
  from temoe.tools import hbm_activations as act  # pylint: disable=import-outside-toplevel

  import temoe  # pylint: disable=import-outside-toplevel
  from temoe import cli  # pylint: disable=import-outside-toplevel

  temoe.register()
  seen, _, _ = planner.target(gpu, hbm_gib)
  with planner.platform_seen_as(seen):  # the model's sizes only: no estimate of the config as it stands
    first = planner.build_config(path, overrides, devices)
  check_axes(first)
  candidates = layouts(first.num_experts, devices, slices, first.num_query_heads, int(first.per_device_batch_size),
                       int(first.pipeline_parallel_layers))
  if not first.te_moe_block:  # MaxText's own MoE layer: its ragged exchange, unchunked
    candidates = [c for c in candidates if c.chunks == 1 and c.exchange in ("auto", "ragged")]
  families: dict = {}
  for layout in candidates:
    families.setdefault(layout.family(), []).append(layout)
  rows, calib, flags = [], None, None
  for i, (family, members) in enumerate(families.items()):
    stages, layers = family
    what = f"pipeline {stages} stages of {layers // stages} layers" if stages > 1 else "no pipeline"
    print(f"temoe plan --sweep: family {i + 1}/{len(families)} ({what}): {len(members)} layouts", file=progress,
          flush=True)
    try:
      base = planner.make_plan(path, [*overrides, *family_base(members[0], devices, slices).overrides()], devices,
                               gpu, hbm_gib)
    except Exception as exc:  # pylint: disable=broad-exception-caught
      why = cli.config_error_message(exc) or f"{type(exc).__name__}: {exc}"
      rows += [Row(m, 0.0, False, None, why.splitlines()[0][:300]) for m in members]
      continue
    if stages > 1:
      rows.append(Row(dataclasses.replace(members[0], repeats=2), 0.0, False, None, REPEATS_REFUSED))
    calib = calib or calibration.calibration_for(base.gpu)
    flags = flags or step_model.xla_flags_for(calib.gpu, environ)[1]
    dims = shardings.dimensions(base.estimate.state)
    for layout in members:
      config = varied(base.config, layout)
      ici, dcn = planner.mesh_split(config, devices)
      mesh = jax.sharding.AbstractMesh(tuple(a * b for a, b in zip(ici, dcn)), tuple(config.mesh_axes))
      why = (layout_refusal(config, layout, act.shapes(config, mesh).tokens)
             or shardings.sweep_refusal(shardings.indivisible_on(dims, dict(mesh.shape))))
      if why:
        rows.append(Row(layout, 0.0, False, None, why))
        continue
      estimate = hbm.estimate(config, mesh, base.backend, seen.device_platform, hbm.retarget(base.estimate.state, mesh))
      peak = estimate.peak / 2**30
      fits = bool(base.hbm_gib) and peak <= base.hbm_gib
      prediction = None
      if fits:
        job = step_model.job_of(config, ici, dcn, slices, base.backend, base.quantization, estimate)
        try:
          prediction = step_model.predict(job, calib, flags)
        except step_model.StepModelError as exc:
          rows.append(Row(layout, peak, fits, None, f"not priced: {exc}"))
          continue
      rows.append(Row(layout, peak, fits, prediction, margin=fits and peak * (1 + planner.TOLERANCE) <= base.hbm_gib))
  return rows


def exposed_exchange(prediction) -> float:
  """Seconds of the step the expert exchange leaves exposed (step_model.exchange_exposed)."""
  from temoe.tools import step_model  # pylint: disable=import-outside-toplevel

  return step_model.exchange_exposed(prediction)


def ranked(rows: list[Row]) -> list[Row]:
  """The rows that fit, fastest first; of equal steps (a step the shared NIC bounds is the same whatever hides
  behind it), the one that leaves less of the exchange exposed (to the percent), then the lower peak, then the less
  exposed exchange."""
  def key(r: Row):
    p = r.prediction
    share = exposed_exchange(p) / p.step_seconds
    return (-round(p.tokens_per_s, 6), round(share, 2), round(r.peak_gib, 1), share)

  return sorted((r for r in rows if r.prediction), key=key)


def table(rows: list[Row], devices: int, slices: int, top: int = TOP) -> list[str]:
  best = ranked(rows)
  misses = [r for r in rows if not r.prediction and not r.why]
  refused: dict[str, list[Row]] = {}
  for r in rows:
    if r.why:
      refused.setdefault(r.why, []).append(r)
  lines = [f"temoe plan --sweep: {len(rows)} layouts of {devices} devices in {slices} slices (tensor, pipeline, expert, "
           f"FSDP, data; exchange, chunks), {len(best)} fit, {len(misses)} do not, {sum(map(len, refused.values()))} "
           "refused; ranked by predicted tokens/s/GPU:",
           f"  {'rank':>4}  {'layout':<44} {'peak GiB':>9} {'step ms':>9} {'tokens/s/GPU':>13} {'TFLOP/s/GPU':>12} "
           f"{'MFU':>6} {'exchange':>9}"]
  for i, r in enumerate(best[:top], 1):
    p = r.prediction
    lines.append(f"  {i:>4}  {r.layout.describe():<44} {r.peak_gib:8.1f}{' ' if r.margin else '*'} {p.step_seconds * 1e3:9.1f} "
                 f"{p.tokens_per_s:13,.0f} {p.tflops:12,.0f} {p.mfu:6.1%} {exposed_exchange(p) / p.step_seconds:9.1%}")
  if len(best) > top:
    lines.append(f"  ... {len(best) - top} more that fit")
  if misses:
    lightest = min(misses, key=lambda r: r.peak_gib)
    lines.append(f"  does not fit: {len(misses)} layouts (the lightest: {lightest.layout.describe()}, "
                 f"{lightest.peak_gib:.1f} GiB)")
  for why, group in refused.items():
    lines.append(f"  refused: {len(group)} layouts (e.g. {group[0].layout.describe()}): {why}")
  if any(not r.margin for r in best[:top]):
    lines.append("  * peak within the plan's 15% tolerance of the device's memory: may not fit")
  spare = [r for r in best if r.margin]
  for label, b in (("best", best[0] if best else None), ("best with memory to spare", spare[0] if spare else None)):
    if b is None or (label != "best" and b is best[0]):
      continue
    lines.append(f"{label}: {b.layout.describe()}: {b.prediction.tflops:,.0f} TFLOP/s/GPU, "
                 f"{b.prediction.tokens_per_s:,.0f} tokens/s/GPU, step {b.prediction.step_seconds * 1e3:,.0f} ms, "
                 f"exposed exchange {exposed_exchange(b.prediction) / b.prediction.step_seconds:.1%} of it, peak "
                 f"{b.peak_gib:.1f} GiB (settings: {' '.join(b.layout.overrides())})")
  return lines
