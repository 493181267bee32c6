"""`temoe plan`'s step model: the GPU catalog it prices links with, the calibration and its scaling, the
collectives and overlap of real planned layouts (MaxText configs built on CPU), the scale hazards, the
calibration bench on CPU, and bench/results/step_model_check.json regenerated and compared."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import scripts

from conftest import ROOT
from temoe import hardware
from temoe.deploy import doctor, env, hazards
from temoe.tools import calibration, model_size, plan, step_model

PROXY_8GPU = str(ROOT / "configs" / "deepseek3-proxy-8gpu.yml")
PROXY_1GPU = str(ROOT / "configs" / "deepseek3-proxy-1gpu.yml")
CHECK = ROOT / "bench" / "results" / "step_model_check.json"


def test_every_catalog_gpu_has_its_links_and_sources():
  for gpu in hardware.GPUS.values():
    assert gpu.hbm_tbps > 0 and gpu.nvlink_gbps > 0 and gpu.scale_out_gbps > 0 and gpu.host_gbps > 0, gpu
    assert gpu.nvlink_domain >= gpu.gpus_per_node >= 1 and len(gpu.sources) >= 3, gpu
  assert hardware.gpu_of_kind("NVIDIA GB300").name == "gb300"
  assert hardware.gpu_of_kind("NVIDIA GB200").name == "gb200" and hardware.gpu_of_kind("NVIDIA B200").name == "b200"


def test_a_gpu_without_a_calibration_is_the_h200_one_scaled_and_says_so():
  own = calibration.calibration_for("h200")
  assert not own.scaled and own.data["origin"] in ("derived", "measured")
  assert ("not a calibrate.py run" in own.describe()) == (own.data["origin"] == "derived")
  gb200 = calibration.calibration_for("gb200")
  assert gb200.scaled and "no calibration measured" in gb200.describe()
  assert gb200.compute_scale("fp8") == pytest.approx(5000 / 1978.9)
  assert gb200.bandwidth_scale() == pytest.approx(8.0 / 4.8)
  assert gb200.dense_tflops("bf16") == pytest.approx(own.dense_tflops("bf16") * 2500 / 989.4)
  with pytest.raises(calibration.CalibrationError, match="valid choices"):
    calibration.calibration_for("a100")


def test_every_number_of_the_h200_file_says_where_it_comes_from():
  data = calibration.calibration_for("h200").data
  sources = [c["source"] for path in data["grouped_mlp"].values() for c in path.values() if isinstance(c, dict)]
  sources += [data["dense_gemm_tflops"][d]["source"] for d in ("bf16", "fp8")] + [data["elementwise_tbps"]["source"]]
  for source in sources:  # derived: a committed result file; measured: the benchmark function that measured it
    name = source.split()[0]
    assert (ROOT / "bench" / "results" / name).is_file() or data["origin"] == "measured" and ".py" in name, source
  for key in ("dense_efficiency", "elementwise_efficiency", "optimizer_efficiency"):
    assert data["fitted"][key]["rows"] == ["temoe_fp8"], key
    assert all((ROOT / f.split()[0]).is_file() for f in data["fitted"][key]["fitted_from"])


@pytest.fixture(scope="module")
def proxy_plan():
  """The 8-GPU proxy planned for 8 H200s (EP 8), its step-model job."""
  p = plan.make_plan(PROXY_8GPU, [], 8, "h200")
  ici, dcn = plan.mesh_split(p.config, 8)
  return p, step_model.job_of(p.config, ici, dcn, 1, p.backend, p.quantization, p.estimate)


def test_the_expert_exchange_is_priced_from_the_exchange_volume_and_hides_only_behind_the_shared_expert(proxy_plan):
  p, job = proxy_plan
  calib = calibration.calibration_for("h200")
  pred = step_model.predict(job, calib, step_model.xla_flags_for(calib.gpu, {})[1])
  a2a = next(c for c in pred.collectives if c.name.startswith("expert all-to-all"))
  assert "dedup" in a2a.name and a2a.link == "NVLink" and a2a.ranks == 8
  share = step_model.recomputed_share(p.config, step_model.placements_of(p.config))
  shared = (step_model.flops.count(p.config).shared_experts * (1 + share["mlp"] / 3)
            / (calib.dense_tflops(step_model.dense_dtype(job)) * 1e12))
  assert 0 < shared < a2a.seconds and a2a.exposed == pytest.approx(a2a.seconds - shared)  # one chunk: no GEMM overlap
  assert "assumed hidden behind the shared expert" in a2a.note
  bare = step_model.predict(dataclasses.replace(job, layer_overlap=False), calib, step_model.xla_flags_for(calib.gpu, {})[1])
  assert all(c.exposed == c.seconds for c in bare.collectives if c.name.startswith("expert all-to-all"))
  from temoe.tools import exchange_volume  # pylint: disable=import-outside-toplevel

  volume = exchange_volume.config_volumes(p.config, p.mesh)["dedup"]
  layers = model_size.layers(p.config).moe
  recompute = 1 if step_model.recomputed_share(p.config, step_model.placements_of(p.config))["gate_up"] else 0
  sent = layers * (volume.bytes + recompute * volume.bytes_forward / 2)
  assert a2a.bytes == pytest.approx(sent * 7 / 8, rel=1e-3)  # a device's rows to itself stay
  assert a2a.seconds == pytest.approx(a2a.bytes / (450e9 * step_model.LINK_EFFICIENCY["nvlink_all_to_all"]))
  assert pred.step_seconds == pytest.approx(pred.compute + sum(c.exposed for c in pred.collectives))
  assert pred.tokens == p.config.per_device_batch_size * p.config.max_target_length
  assert pred.tflops == pytest.approx(pred.model_flops / pred.step_seconds / 1e12)


def test_the_layer_hides_exchange_behind_the_shared_expert_and_other_chunks_gemms():
  """`layer_overlap`: the shared expert hides its time; C chunks hide (1 - 1/C) of the routed GEMMs' time; hier's
  hops (two links) pipeline over chunks; never more than the exchange."""
  assert step_model.layer_overlap([1.0], 1, 0.5, 0.2)[0] == pytest.approx(0.8)
  assert step_model.layer_overlap([1.0], 4, 0.5, 0.2)[0] == pytest.approx(0.8 - 0.5 * 0.75)
  assert step_model.layer_overlap([1.0], 4, 5.0, 0.2)[0] == pytest.approx(0.8 - 0.8 * 0.75)  # GEMMs longer than it
  assert step_model.layer_overlap([0.1], 2, 5.0, 0.2)[0] == 0.0
  hops, note = step_model.layer_overlap([1.0, 0.4], 2, 0.0, 0.0, hops=True)
  assert hops == pytest.approx(1.4 - 0.4 * 0.5) and "hops pipelined" in note
  assert step_model.layer_overlap([1.0, 0.4], 1, 0.0, 0.0, hops=True)[0] == pytest.approx(1.4)


def test_collectives_that_share_the_nic_bound_the_step():
  nic = [step_model.Collective("a", 0, 8, "scale-out", 2.0, 0.0), step_model.Collective("b", 0, 8, "NVLink + scale-out", 1.5, 0.5),
         step_model.Collective("c", 0, 8, "NVLink", 9.0, 0.0)]
  floor = step_model.nic_floor(nic, 2.0)
  assert len(floor) == 1 and floor[0].exposed == pytest.approx(3.5 - 2.5) and floor[0].name == step_model.NIC_FLOOR
  assert step_model.nic_floor(nic, 3.0) == []


def test_fsdp_collectives_hide_only_with_the_profiles_xla_flags():
  p = plan.make_plan(PROXY_8GPU, ["ici_expert_parallelism=2", "ici_fsdp_parallelism=4"], 8, "h200")
  ici, dcn = plan.mesh_split(p.config, 8)
  job = step_model.job_of(p.config, ici, dcn, 1, p.backend, p.quantization, p.estimate)
  calib = calibration.calibration_for("h200")
  with_profile = step_model.predict(job, calib, step_model.xla_flags_for(calib.gpu, {})[1])
  bare = step_model.predict(job, calib, {})
  gathers = [c for c in bare.collectives if c.name.startswith("FSDP")]
  assert gathers and all(c.exposed == c.seconds for c in gathers)
  hidden = [c for c in with_profile.collectives if c.name.startswith("FSDP")]
  assert all(c.exposed < c.seconds for c in hidden) and with_profile.step_seconds < bare.step_seconds
  # the user's flag wins over the profile's: the pipelined all-gather turned off is exposed again
  off = step_model.xla_flags_for(calib.gpu, {"XLA_FLAGS": "--xla_gpu_pipeline_all_gather=off"})[1]
  gathered = [c for c in step_model.predict(job, calib, off).collectives if "all-gather" in c.name]
  assert all(c.exposed == c.seconds for c in gathered)


def test_groups_that_leave_the_nvlink_domain_take_the_nic():
  p = plan.make_plan(PROXY_8GPU, ["num_slices=2", "ici_expert_parallelism=8", "dcn_expert_parallelism=2"], 16, "h100")
  ici, dcn = plan.mesh_split(p.config, 16)
  job = step_model.job_of(p.config, ici, dcn, 2, p.backend, p.quantization, p.estimate)
  h100, gb200 = hardware.GPUS["h100"], hardware.GPUS["gb200"]
  assert step_model.group_links(job, ("expert",), h100) == (16, 8)  # two 8-GPU nodes, 8 ranks in each
  assert step_model.group_links(job, ("expert",), gb200) == (16, 16)  # one NVL72 domain holds both
  seconds, moved, link = step_model.all_to_all_seconds(8e9, 8, 4, h100)
  assert link == "NVLink + scale-out" and moved == 7e9
  assert seconds == pytest.approx(4e9 / (50e9 * step_model.LINK_EFFICIENCY["scale_out"]))


def test_a_pipelined_config_pays_maxtexts_bubble():
  settings = ["ici_pipeline_parallelism=2", "ici_expert_parallelism=4", "num_pipeline_microbatches=4",
              "pipeline_parallel_layers=2", "scan_layers=false",
              "override_model_config=true", "routed_bias=false"]  # MaxText's pipeline carries no routing bias
  p = plan.make_plan(PROXY_8GPU, settings, 8, "h200")
  ici, dcn = plan.mesh_split(p.config, 8)
  job = step_model.job_of(p.config, ici, dcn, 1, p.backend, p.quantization, p.estimate)
  stages, repeats, micro = step_model.pipeline(job)
  assert (stages, micro) == (2, 4)
  pred = step_model.predict(job, calibration.calibration_for("h200"), {})
  fraction = (stages - 1) / (repeats * micro + stages - 1)
  busy = sum(s.seconds for s in pred.stages if s.name != "optimizer") + sum(c.exposed for c in pred.collectives)
  assert pred.bubble == pytest.approx(busy * fraction / (1 - fraction))
  assert any(c.name == "pipeline send/receive" for c in pred.collectives)


@pytest.mark.parametrize("ranks, flags, blocking", [
    (64, "--xla_gpu_ragged_all_to_all_mode=symmetric", True),
    (64, "", False),
    (33, "--xla_gpu_ragged_all_to_all_mode=private --xla_gpu_ragged_all_to_all_mode=symmetric", True),
])
def test_one_shot_ragged_all_to_all_above_32_ranks_in_a_domain_is_flagged_with_the_setting(ranks, flags, blocking):
  found = hazards.for_layout(ranks, ranks, flags)
  crash = [h for h in found if "47283" in h.source]
  assert len(crash) == 1 and crash[0].blocking is blocking
  assert "leave xla_gpu_ragged_all_to_all_mode at private" in crash[0].fix
  assert any("8 ranks" in h.what for h in found)  # wider than XLA's peer-pointer kernel too


def test_small_or_split_expert_groups_raise_no_crash_hazard():
  assert hazards.for_layout(32, 32, "--xla_gpu_ragged_all_to_all_mode=symmetric") == [hazards.peer_kernel_limit(32)]
  assert hazards.for_layout(64, 8, "--xla_gpu_ragged_all_to_all_mode=symmetric") == [hazards.peer_kernel_limit(64)]
  assert hazards.for_layout(8, 8, "--xla_gpu_ragged_all_to_all_mode=symmetric") == []


def test_plan_flags_the_gb200_preset_ep_64_inside_one_nvl72(capsys):
  assert plan.main([str(ROOT / "configs" / "deepseek3-671b-gb200x256.yml"), "--devices", "256", "--slices", "64",
                    "--gpu", "gb200"]) == 0
  out = capsys.readouterr().out
  assert "64 expert-parallel ranks in one NVLink domain" in out and "openxla/xla#47283" in out
  assert "step time on gb200 (gb200: no calibration measured; h200's" in out
  assert "expert all-to-all (dedup) [NVLink, 64 ranks]" in out and "TFLOP/s/GPU (MaxText's count)" in out


GB200 = hardware.Platform("gpu", "NVIDIA GB200", (10, 0), "2.20.2", None, (13, 4, 0))


def test_doctor_warns_of_the_symmetric_mode_on_a_multi_node_nvlink_gpu_and_of_nccl_2_30_7():
  environ = env.environment("blackwell", {"XLA_FLAGS": "--xla_gpu_ragged_all_to_all_mode=symmetric"})
  report = doctor.diagnose(GB200, environ, None, (2, 30, 7))
  assert any("openxla/xla#47283" in w and "do not pass --xla_gpu_ragged_all_to_all_mode=symmetric" in w
             for w in report.warnings)
  assert any("marin-community/marin#8313" in w for w in report.warnings) and report.problems == []
  clean = doctor.diagnose(GB200, env.environment("blackwell"), None, (2, 28, 9))
  assert not any("ragged all-to-all" in w for w in clean.warnings)


def test_plan_prints_the_step_table_for_a_gpu_config_and_says_why_not_for_a_cpu_one(capsys):
  assert plan.main([PROXY_1GPU]) == 0
  out = capsys.readouterr().out
  for stage in ("attention", "dense", "experts", "dispatch/combine", "elementwise", "optimizer"):
    assert f"compute: {stage}" in out
  assert "tokens/s/GPU" in out and "MFU" in out
  assert plan.main([str(ROOT / "configs" / "deepseek3-smoke.yml")]) == 0
  assert "step time: not predicted for hardware=cpu" in capsys.readouterr().out


def test_the_calibration_bench_runs_every_measurement_on_cpu(tmp_path):
  run = scripts.run(ROOT / "bench" / "calibrate.py", "--smoke", "--iters", "1", "--out", str(tmp_path))
  assert run.returncode == 0, run.stderr[-3000:]
  data = json.loads((tmp_path / "smoke.json").read_text())
  assert data["origin"] == "measured" and data["grouped_mlp"]["xla_bf16"]["smoke"]["layer_ms"] > 0
  assert all(v["ms"] > 0 for v in data["grouped_gemm"].values())  # temoe's grouped GEMM, interpret mode
  assert data["dense_gemm_tflops"]["bf16"]["value"] > 0 and data["attention_core_tflops"]["dot_product"]["value"] > 0
  assert data["elementwise_tbps"]["value"] > 0 and data["optimizer_tbps"]["value"] > 0
  assert "cudnn_flash_te_error" in data["attention_core_tflops"]  # no cuDNN here: said, not invented


def close(a, b) -> bool:
  if isinstance(a, float) or isinstance(b, float):
    return math.isclose(a, b, rel_tol=1e-6)
  if isinstance(a, dict):
    return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
  if isinstance(a, list):
    return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
  return a == b


def check_module():
  sys.path.insert(0, str(ROOT / "bench"))
  import step_model_check  # pylint: disable=import-outside-toplevel

  return step_model_check


@pytest.fixture(scope="module")
def regenerated():
  """bench/step_model_check.py's rows recomputed in this process (MaxText imported once), all but the target rows,
  whose sweeps test_the_target_rows_are_the_models_prediction_for_their_layouts checks through their best layouts."""
  return json.loads(json.dumps(check_module().build(targets=False)))


def test_the_committed_check_is_what_the_script_computes(regenerated):
  committed = json.loads(CHECK.read_text())
  rows = [r for r in committed["rows"] if r["kind"] != "target"]
  assert [r["name"] for r in regenerated["rows"]] == [r["name"] for r in rows]
  for new, old in zip(regenerated["rows"], rows):
    assert close(new, old), (new, old)
  assert regenerated["excluded"] == committed["excluded"]


def test_the_target_rows_are_the_models_prediction_for_their_layouts(regenerated):
  """Each target row: temoe's best layout of the sweep at a published run's GPUs and batch, against the model's
  prediction for the publisher's own layout (the published row's), its best layout planned again as one config
  giving the recorded prediction; the H100 row against issue 53's 372 TFLOP/s/GPU and 10% exposed exchange."""
  step_model_check = check_module()
  committed = json.loads(CHECK.read_text())
  published = {r["name"]: r["predicted"] for r in regenerated["rows"] if r["kind"] == "published"}
  targets = [r for r in committed["rows"] if r["kind"] == "target"]
  versus = {r["name"].split(": ", 1)[1]: r for r in targets if r["name"].startswith("temoe's best layout vs")}
  assert set(versus) == {row[0] for row in step_model_check.PUBLISHED}
  planned = {}
  for name, gpu, config, devices, slices, *_ in step_model_check.PUBLISHED:
    row = versus[name]
    assert row["reference"] == pytest.approx(published[name], rel=1e-9) and row["ratio"] == row["predicted"] / row["reference"]
    if row["layout"] is None:  # no layout of the sweep fits: said, and priced at nothing
      assert row["predicted"] == 0.0 and "no layout fits" in row["source"]
      continue
    key = (gpu, config, devices, slices, tuple(row["settings"]))
    if key not in planned:
      p = plan.make_plan(str(ROOT / "configs" / config), [f"num_slices={slices}", *row["settings"]], devices, gpu)
      ici, dcn = plan.mesh_split(p.config, devices)
      calib = calibration.calibration_for(gpu)
      planned[key] = step_model.predict(step_model.job_of(p.config, ici, dcn, slices, p.backend, p.quantization,
                                                          p.estimate), calib, step_model.xla_flags_for(calib.gpu, {})[1])
    assert row["predicted"] == pytest.approx(planned[key].tflops, rel=1e-9), name
    share = step_model.exchange_exposed(planned[key]) / planned[key].step_seconds
    assert row["exposed_exchange_share"] == pytest.approx(share, rel=1e-9)
  h100 = next(r for r in targets if r["name"].startswith("temoe's best layout on 1,024 H100"))
  assert (h100["reference"], h100["exposed_exchange_target"]) == step_model_check.H100_TARGET
  best = versus["Megatron-Bridge 25.09, 1,024 H100, FP8 (TP2 PP8 VP4 EP64, MBS 1)"]
  assert h100["layout"] == best["layout"] and h100["predicted"] == best["predicted"]


def test_no_row_counts_as_a_check_of_a_constant_fitted_to_it(regenerated):
  fitted = calibration.calibration_for("h200").data["fitted"]
  fitted_to = {r for entry in [fitted["dense_efficiency"], *fitted["attention_core_tflops"].values()]
               for r in entry["rows"]}
  for row in regenerated["rows"]:
    path = row["name"].split(":")[1] if row["kind"] == "one_gpu" and row["name"].startswith("proxy") else None
    if path in fitted_to:
      assert row["fitted"], row
  # the five runs named temoe_fp8 (proxy_1gpu.json, .scan1, .paths, .variants, .recipes: the shipped config when
  # each ran; the constants were fitted to the one of .variants, and the newest file's config has changed since,
  # but a row named as a fitted path is never counted as a check), the two .paths runs of the same config with
  # another environment only (temoe_fp8_env, temoe_fp8_graphs: the model reads neither), the tokamax run
  assert sum(r["fitted"] for r in regenerated["rows"]) == 8
  from temoe.tools import one_rank  # pylint: disable=import-outside-toplevel

  assert {r["kind"] for r in regenerated["rows"]} == {"one_gpu", "published"} | ({"one_rank"} if one_rank.load() else set())


def test_the_planning_guides_table_is_the_committed_check():
  step_model_check = check_module()

  page = (ROOT / "docs" / "guides" / "planning.md").read_text()
  assert step_model_check.PAGE == ROOT / "docs" / "guides" / "planning.md"
  committed = json.loads(CHECK.read_text())
  assert step_model_check.TABLE_BEGIN + "\n" + step_model_check.render_table(committed) in page
  assert step_model_check.ONE_RANK_BEGIN + "\n" + step_model_check.render_one_rank_table(committed) in page
