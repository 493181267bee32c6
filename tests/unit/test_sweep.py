"""`temoe plan --sweep` (temoe.tools.sweep): the layouts it enumerates, its plans equal to plans of configs built for
each layout (it builds MaxText's config and state once per family and varies the rest), and its table: ranked,
with what does not fit and what temoe refuses (with why) left out of the ranking."""

from __future__ import annotations

import math

import jax
import pytest

from conftest import ROOT
from temoe.tools import calibration, hbm, plan, planner, step_model, sweep

PROXY_8GPU = str(ROOT / "configs" / "deepseek3-proxy-8gpu.yml")
NO_BIAS = ["override_model_config=true", "routed_bias=false"]  # MaxText's pipeline carries no routing bias


def test_every_layout_spans_the_devices_and_keeps_its_axes_where_they_belong():
  found = sweep.layouts(256, 1024, 128, heads=128, batch=2, pipeline_layers=58)
  assert found and len({x.describe() for x in found}) == len(found)
  for layout in found:
    assert math.prod(layout.size(a) for a in sweep.AXES) == 1024, layout
    assert math.prod(layout.ici.values()) == 8 and layout.dcn["tensor"] == 1 and layout.ici["stage"] == 1, layout
    assert 256 % layout.size("expert") == 0 and layout.size("tensor") <= sweep.MAX_TENSOR
    if layout.exchange == "hier":  # where the expert axis spans slices, a node is a slice's expert ranks
      assert layout.node == (layout.ici["expert"] if layout.dcn["expert"] > 1 else layout.node) < layout.size("expert")
    if layout.size("stage") > 1:  # one repeat of whole stages, microbatches a multiple of the stages
      stages = layout.size("stage")
      assert layout.pipeline_layers % stages == 0 and layout.microbatches % stages == 0 and layout.repeats == 1
      assert layout.microbatches <= 2 * stages  # one sequence a device and microbatch at most
  kinds = {(layout.size("tensor") > 1, layout.size("stage") > 1, layout.exchange, layout.chunks) for layout in found}
  assert {(True, False, "hier", 2), (False, True, "dedup", 4), (False, False, "ragged", 1)} <= kinds
  assert {layout.size("stage") for layout in found} == {1, 2, 4, 8, 16}


def test_the_base_of_a_family_holds_every_swept_axis():
  """MaxText drops size-1 axes from each parameter's spec, so the family's state is built with each axis present."""
  for devices, slices in ((1024, 128), (256, 64), (16, 2)):
    first = sweep.layouts(32, devices, slices)[0]
    base = sweep.family_base(first, devices, slices)
    assert math.prod(base.size(a) for a in sweep.AXES) == devices
    assert all(base.size(a) >= 2 for a in ("tensor", "expert", "fsdp", "data")), base


@pytest.fixture(scope="module")
def families():
  """The proxy on 16 H200s in 2 nodes without its routing bias: one family without a pipeline, one of 2 stages."""
  every = sweep.layouts(32, 16, 2, heads=128, batch=2, pipeline_layers=2)
  flat = [layout for layout in every if layout.size("stage") == 1]
  piped = [layout for layout in every if layout.size("stage") == 2]
  return {stages: planner.make_plan(PROXY_8GPU, ["num_slices=2", *NO_BIAS, *sweep.family_base(group[0], 16, 2).overrides()],
                                    16, "h200")
          for stages, group in ((1, flat), (2, piped))}, flat, piped


def test_a_varied_plan_is_the_plan_of_a_config_built_for_the_layout(families):
  bases, flat, piped = families
  calib = calibration.calibration_for("h200")
  flags = step_model.xla_flags_for(calib.gpu, {})[1]
  wanted = [next(x for x in flat if x.size("tensor") == 2 and x.size("data") == 2 and x.size("expert") > 1),
            next(x for x in flat if x.exchange == "hier" and x.chunks == 4),
            next(x for x in piped if x.size("expert") == 4 and x.microbatches == 4)]
  for layout in wanted:
    built = planner.make_plan(PROXY_8GPU, ["num_slices=2", *NO_BIAS, *layout.overrides()], 16, "h200")
    base = bases[layout.size("stage")]
    config = sweep.varied(base.config, layout)
    ici, dcn = planner.mesh_split(config, 16)
    assert (ici, dcn) == planner.mesh_split(built.config, 16), layout
    mesh = jax.sharding.AbstractMesh(tuple(a * b for a, b in zip(ici, dcn)), tuple(config.mesh_axes))
    est = hbm.estimate(config, mesh, base.backend, "gpu", hbm.retarget(base.estimate.state, mesh))
    assert est.peak == pytest.approx(built.estimate.peak, rel=1e-12), layout.describe()
    got = step_model.predict(step_model.job_of(config, ici, dcn, 2, base.backend, base.quantization, est), calib, flags)
    want = step_model.predict(step_model.job_of(built.config, ici, dcn, 2, built.backend, built.quantization,
                                                built.estimate), calib, flags)
    assert got.step_seconds == pytest.approx(want.step_seconds, rel=1e-12), layout.describe()


def test_the_sweep_ranks_what_fits_and_names_what_it_refuses(capsys):
  assert plan.main([PROXY_8GPU, "--devices", "16", "--slices", "2", "--sweep", "--hbm-gib", "80"]) == 0
  out = capsys.readouterr().out
  assert "layouts of 16 devices in 2 slices" in out and "best: " in out and "does not fit:" in out
  refused = [line for line in out.splitlines() if line.strip().startswith("refused:")]
  assert any("PP2" in line and "routed_bias=true under pipeline parallelism" in line for line in refused), refused
  ranked = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
  assert ranked and not any("PP2" in line for line in ranked)
  tokens = [float(line.split()[-4].replace(",", "")) for line in ranked]
  assert tokens == sorted(tokens, reverse=True)
  assert plan.main([PROXY_8GPU, "--sweep"]) == 2


def test_without_the_routing_bias_pipelines_are_planned_and_circular_repeats_refused(capsys):
  assert plan.main([PROXY_8GPU, "--devices", "16", "--slices", "2", "--sweep", "--hbm-gib", "80", *NO_BIAS]) == 0
  out = capsys.readouterr().out
  refused = [line for line in out.splitlines() if line.strip().startswith("refused:")]
  assert any("r2" in line and "num_pipeline_repeats > 1" in line for line in refused), refused
  assert not any("routed_bias" in line for line in refused)
  head = next(line for line in out.splitlines() if "layouts of 16 devices in 2 slices" in line)
  planned = len(sweep.layouts(32, 16, 2, heads=128, batch=2, pipeline_layers=2))
  assert head.startswith(f"temoe plan --sweep: {planned + 1} layouts") and head.count(", 1 refused;") == 1, head
