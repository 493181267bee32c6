"""bench/one_rank.py (one rank of a many-GPU job on one GPU, network mocked) on CPU: the schedule reader on a
scheduled module of the GPU's form, the bench's refusals before anything compiles, its depth extrapolation and
merge, and one depth of the bench on host devices (tiny)."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import HANG_S, ROOT, SMOKE, xla_flags
from temoe.tools import hlo_schedule

sys.path.insert(0, str(ROOT / "bench"))
import one_rank  # noqa: E402  # pylint: disable=wrong-import-position

SCHEDULED = """HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(bf16[8,8]{1,0})->bf16[32,8]{1,0}}

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %add.0 = bf16[] add(%x, %y)
}

%fused_computation (param_0: bf16[8,8]) -> bf16[8,8] {
  %param_0 = bf16[8,8]{1,0} parameter(0)
  ROOT %multiply.1 = bf16[8,8]{1,0} multiply(%param_0, %param_0)
}

%async_computation (param_0.1: bf16[32,8]) -> bf16[32,8] {
  %param_0.1 = bf16[32,8]{1,0} parameter(0)
  ROOT %all-to-all.1 = bf16[32,8]{1,0} all-to-all(%param_0.1), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
}

%body (p: (s32[], bf16[8,8])) -> (s32[], bf16[8,8]) {
  %p = (s32[], bf16[8,8]{1,0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%p), index=0
  %gte.1 = bf16[8,8]{1,0} get-tuple-element(%p), index=1
  %loop_fusion = bf16[8,8]{1,0} fusion(%gte.1), kind=kLoop, calls=%fused_computation
  ROOT %tuple.1 = (s32[], bf16[8,8]{1,0}) tuple(%gte.0, %loop_fusion)
}

%cond (p.1: (s32[], bf16[8,8])) -> pred[] {
  %p.1 = (s32[], bf16[8,8]{1,0}) parameter(0)
  %gte.2 = s32[] get-tuple-element(%p.1), index=0
  %constant.3 = s32[] constant(4)
  ROOT %compare.1 = pred[] compare(%gte.2, %constant.3), direction=LT
}

ENTRY %main (Arg_0: bf16[8,8], Arg_1: bf16[32,8]) -> bf16[32,8] {
  %Arg_0 = bf16[8,8]{1,0} parameter(0)
  %Arg_1 = bf16[32,8]{1,0} parameter(1)
  %all-gather-start = (bf16[8,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(%Arg_0), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
  %gemm_fusion = bf16[8,8]{1,0} fusion(%Arg_0), kind=kCustom, calls=%fused_computation
  %all-gather-done = bf16[32,8]{1,0} all-gather-done(%all-gather-start)
  %all-to-all-start = ((bf16[32,8]{1,0}), bf16[32,8]{1,0}) async-start(%all-gather-done), calls=%async_computation
  %constant.1 = s32[] constant(0)
  %tuple.2 = (s32[], bf16[8,8]{1,0}) tuple(%constant.1, %gemm_fusion)
  %while.1 = (s32[], bf16[8,8]{1,0}) while(%tuple.2), condition=%cond, body=%body
  %all-to-all-done = bf16[32,8]{1,0} async-done(%all-to-all-start)
  %all-reduce-start = bf16[32,8]{1,0} all-reduce-start(%all-to-all-done), channel_id=3, replica_groups=[1,4]<=[4], to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  %all-reduce-done = bf16[32,8]{1,0} all-reduce-done(%all-reduce-start)
  %reduce-scatter.1 = bf16[8,8]{1,0} reduce-scatter(%all-reduce-done), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  ROOT %add.9 = bf16[32,8]{1,0} add(%all-reduce-done, %Arg_1)
}
"""


def test_the_schedule_reader_finds_what_runs_between_each_start_and_done():
  times = {"gemm_fusion": 2.0, "loop_fusion": 0.5, "compare.1": 0.01, "add.9": 7.0}
  found = {c.kind: c for c in hlo_schedule.collectives(SCHEDULED, times)}
  assert sorted(found) == ["all-gather", "all-reduce", "all-to-all", "reduce-scatter"]
  gather, a2a, reduce, scatter = found["all-gather"], found["all-to-all"], found["all-reduce"], found["reduce-scatter"]
  assert gather.is_async and gather.between == ["gemm_fusion"] and gather.done == "all-gather-done"
  assert gather.overlapped_ms == pytest.approx(2.0)
  # the wrapped all-to-all: constants and tuples launch nothing; the while brings its body's and condition's kernels
  assert a2a.is_async and a2a.name == "all-to-all-start" and sorted(a2a.between) == ["compare.1", "loop_fusion"]
  assert a2a.overlapped_ms == pytest.approx(0.51)
  assert not reduce.is_async and reduce.between == [] and reduce.overlapped_ms == 0.0  # XLA marked the pair sync
  assert not scatter.is_async and scatter.done is None
  rows = {r["kind"]: r for r in hlo_schedule.summary(list(found.values()))}
  assert rows["all-to-all"] == {"kind": "all-to-all", "async": True, "count": 1, "with_compute_between": 1,
                                "ops_between": 2, "overlapped_ms": pytest.approx(0.51)}
  assert hlo_schedule.summary(hlo_schedule.collectives(SCHEDULED))[0]["overlapped_ms"] is None  # no op times


def test_the_schedule_reader_reads_no_collective_inside_fusions_or_wrappers():
  computations, entry = hlo_schedule.parse(SCHEDULED)
  assert entry == "main" and [i.name for i in computations["main"]][:3] == ["Arg_0", "Arg_1", "all-gather-start"]
  assert len(hlo_schedule.collectives(SCHEDULED)) == 4  # the all-to-all inside %async_computation counted once


BAD = {
    "missing config": (["configs/nope.yml", "--devices", "8"], "is not a config YAML file"),
    "slices not dividing": ([SMOKE, "--devices", "10", "--slices", "4"], "not a multiple of --slices=4"),
    "zero devices": ([SMOKE, "--devices", "0"], "must be 1.."),
    "too many host devices": ([SMOKE, "--devices", "1024", "--slices", "128", "--cpu"], "at most 16"),
    "host devices in slices": ([SMOKE, "--devices", "16", "--slices", "2", "--cpu"], "--slices must be 1"),
    "one depth": ([SMOKE, "--devices", "8", "--layers", "4"], "two depths a,b"),
    "depths in the wrong order": ([SMOKE, "--devices", "8", "--layers", "5,4"], "two depths a,b"),
    "not key=value": ([SMOKE, "--devices", "8", "steps"], "pass MaxText settings as key=value"),
    "no warm-up": ([SMOKE, "--devices", "8", "--skip", "0"], "must be at least 1"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_bench_refuses_bad_input_with_one_line_before_compiling(capsys, case):
  args, expected = BAD[case]
  assert one_rank.main(args) == 2
  lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("one_rank: ") and expected in lines[0], lines


def test_a_depth_without_a_moe_layer_is_refused():
  with pytest.raises(one_rank.Refused, match="needs a MoE layer after the 1 dense"):
    one_rank.depths_of(SMOKE, [], "1,2")
  assert one_rank.depths_of(SMOKE, [], "") == (2, 3, 3, 1)


def test_the_mock_topology_is_one_device_a_process():
  assert one_rank.topology(1024, 128) == "128x8x1" and one_rank.topology(256, 64) == "64x4x1"


def depth_row(depth: int, step: float, experts: float, overlapped: float | None, count: int) -> dict:
  stages = dict.fromkeys(one_rank.STAGES, 1.0)
  stages["experts"] = experts
  return {"depth": depth, "step_ms": step, "stages_ms": stages, "layout": "expert=64 (8x8) fsdp=16 (1x16)",
          "peak_hbm_gib": 10.0 + depth, "collectives": [
              {"kind": "all-to-all", "async": True, "count": count, "overlapped_ms": overlapped},
              {"kind": "all-gather", "async": False, "count": 3, "overlapped_ms": 0.0}]}


def test_full_depth_is_the_shallower_run_plus_the_marginal_moe_layers():
  full = one_rank.extrapolate(depth_row(4, 100.0, 10.0, 2.0, 4), depth_row(6, 130.0, 20.0, 5.0, 8), 61)
  assert full["marginal_moe_layer_ms"] == pytest.approx(15.0)
  assert full["step_ms"] == pytest.approx(100.0 + 57 * 15.0)
  assert full["stages_ms"]["experts"] == pytest.approx(10.0 + 57 * 5.0) and full["stages_ms"]["idle"] == 1.0
  a2a = next(c for c in full["collectives"] if c["kind"] == "all-to-all")
  assert a2a["count"] == 4 + 57 * 2 and a2a["overlapped_ms"] == pytest.approx(2.0 + 57 * 1.5)
  assert a2a["per_moe_layer"] == {"count": 2, "overlapped_ms": pytest.approx(1.5)}


def test_a_rerun_replaces_its_own_entry_only(tmp_path):
  path = tmp_path / "one_rank.json"
  first = {"config": "c.yml", "devices": 8, "slices": 1, "overrides": [], "platform": "gpu", "step_ms": 1.0}
  other = {**first, "devices": 16}
  path.write_text(json.dumps({"runs": [first, other]}))
  merged = one_rank.merge(path, {**first, "step_ms": 2.0})
  assert [(r["devices"], r["step_ms"]) for r in merged["runs"]] == [(16, 1.0), (8, 2.0)]


def test_one_depth_on_host_devices(tmp_path):
  """The worker of one depth on 2 host devices (EP 2, tiny): MaxText's step traced, the optimized HLO dumped and
  read back, the stages adding up to the step and the exchange's all-to-alls found in the schedule."""
  args, overrides = one_rank.parse([SMOKE, "--devices", "2", "--cpu", "--steps", "1", "--skip", "1",
                                    "--out", str(tmp_path / "out"), "ici_expert_parallelism=2",
                                    "per_device_batch_size=2", "max_target_length=16"])
  row = one_rank.run_depth(args, overrides, 2, str(tmp_path))
  assert "error" not in row, row
  assert row["layout"] == "expert=2 (2x1)" and row["devices_seen"] == 2 and not row["mocked"]
  assert sum(row["stages_ms"].values()) == pytest.approx(row["step_ms"], rel=1e-9)
  assert row["stages_ms"]["experts"] > 0 and row["unmatched_ms"] == 0.0  # every op found in the dumped HLO
  kinds = {c["kind"]: c for c in row["collectives"]}
  assert kinds["all-to-all"]["count"] >= 2 and not kinds["all-to-all"]["async"]  # XLA:CPU runs them in line
  assert all(c["overlapped_ms"] == 0.0 for c in row["collectives"])
  assert list((tmp_path / "depth2" / "hlo").glob("*train_step*after_optimizations.txt"))
  logs = list((tmp_path / "out").glob("one_rank.deepseek3-smoke.2.*.depth2.log"))  # the worker's log, kept, named
  assert len(logs) == 1, logs  # by its settings (runs of one config with other settings keep their own)
  log = logs[0].read_text()
  assert log.count("ONE_RANK ") == 1 and "[NO-OP]" not in log


def measured_file(tmp_path, **changes):
  """A one_rank.json with one GPU run of an EP 8 layout, one that failed and one on host devices."""
  last = {"depth": 5, "device_kind": "NVIDIA H200", "model_name": "deepseek3-671b", "per_device_batch_size": 1.0,
          "max_target_length": 4096}
  stages = {s: 10.0 for s in one_rank.STAGES}
  run = {"config": "configs/x.yml", "devices": 8, "slices": 1, "platform": "gpu (mocked NCCL)", "command": "python b",
         "layout": "expert=8 (8x1)", "step_ms": 100.0, "stages_ms": stages, "measured": [last],
         "depth": {"note": "measured at 4 and 5"},
         "collectives": [{"kind": "all-gather", "async": True, "count": 4, "overlapped_ms": 200.0},
                         {"kind": "all-to-all", "async": False, "count": 8, "overlapped_ms": 0.0}], **changes}
  path = tmp_path / "one_rank.json"
  path.write_text(json.dumps({"runs": [run, {**run, "error": "depth 4: boom"}, {**run, "platform": "cpu (host devices)"}]}))
  return path


def test_the_step_model_reads_the_gpu_runs_of_a_one_rank_file(tmp_path):
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

  from temoe.tools import one_rank as reader  # pylint: disable=import-outside-toplevel

  found = reader.load(measured_file(tmp_path))
  assert len(found) == 1 and found[0].gpu == "h200" and found[0].compute_ms() == pytest.approx(80.0)
  assert reader.load(tmp_path / "absent.json") == []
  axes = ("data", "fsdp", "expert")
  config = SimpleNamespace(mesh_axes=axes, model_name="deepseek3-671b", per_device_batch_size=1, max_target_length=4096)
  job = SimpleNamespace(config=config, ici=(1, 1, 8), dcn=(1, 1, 1), devices=8)
  assert reader.layout_of(axes, (1, 2, 4), (1, 1, 2)) == "fsdp=2 (2x1) expert=8 (4x2)"
  assert reader.find(job, found) is found[0]
  assert reader.find(SimpleNamespace(**{**vars(job), "ici": (1, 8, 1)}), found) is None  # another layout
  config.per_device_batch_size = 2
  assert reader.find(job, found) is None  # another batch


def test_overlap_is_priced_from_the_compiled_schedule(tmp_path):
  from temoe import hardware  # pylint: disable=import-outside-toplevel
  from temoe.tools import calibration, step_model  # pylint: disable=import-outside-toplevel
  from temoe.tools import one_rank as reader  # pylint: disable=import-outside-toplevel

  m = reader.load(measured_file(tmp_path))[0]
  Coll = step_model.Collective
  collectives = (Coll("expert all-to-all (dedup)", 1e9, 8, "NVLink", 0.5, 0.5, "never hidden"),
                 Coll("FSDP all-gather (non-expert weights)", 1e9, 8, "NVLink", 0.3, 0.0, "hidden by flags"),
                 Coll("FSDP all-gather (expert weights)", 1e9, 8, "NVLink", 0.1, 0.0, "hidden by flags"),
                 Coll("FSDP reduce-scatter (expert grads)", 1e9, 8, "NVLink", 0.2, 0.05, "assumed"),
                 Coll("host offload (D2H + H2D)", 1e9, 1, "host", 0.4, 0.0, "overlapped"))
  for gpu in ("h200", "h100"):
    calib = calibration.calibration_for(gpu)
    before = step_model.Prediction(hardware.GPUS[gpu], calib, (step_model.Stage("experts", 1.0),), collectives, 0.0,
                                   4096, 1e15, 1000.0, (calib.describe(),))
    after = reader.apply(before, m)
    exposed = {c.name: c.exposed for c in after.collectives}
    assert exposed["expert all-to-all (dedup)"] == 0.5  # the schedule runs it in line: nothing hides it
    assert exposed["FSDP all-gather (non-expert weights)"] == pytest.approx(0.3 - 0.2 * 0.3 / 0.4)  # 200 ms shared
    assert exposed["FSDP all-gather (expert weights)"] == pytest.approx(0.1 - 0.2 * 0.1 / 0.4)
    assert exposed["FSDP reduce-scatter (expert grads)"] == 0.05  # not in the schedule: the model's assumption
    assert exposed["host offload (D2H + H2D)"] == 0.0  # no collective: the model's
    stages = {s.name: s.seconds for s in after.stages}
    memory = 1.0 if gpu == "h200" else 4.8 / 3.35  # H100 from the H200's run: same peaks, less HBM bandwidth
    assert stages["experts"] == pytest.approx(0.010) and stages["optimizer"] == pytest.approx(0.010 * memory)
    assert stages["idle"] == pytest.approx(0.010) and "collectives" not in stages
    assert after.step_seconds == pytest.approx(sum(stages.values()) + sum(exposed.values()))
    assert "one-rank run of this layout" in after.notes[-1]


OWN_COUNTS = """
import sys
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import one_rank
one_rank.own_counts_for_peers()
mesh = jax.make_mesh((4,), ("x",))
def body(i, f):
  return jax.lax.all_gather(i, "x"), jax.lax.all_gather(f, "x", tiled=True)
fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")), check_vma=False))
sharding = NamedSharding(mesh, P("x"))
ints, floats = fn(jax.device_put(jnp.arange(8, dtype=jnp.int32), sharding), jax.device_put(jnp.arange(8.0), sharding))
print(np.asarray(ints).reshape(4, 4, 2)[1].tolist(), np.asarray(floats).reshape(4, 8)[1].tolist())
"""


def test_under_the_mock_each_peer_routes_as_this_rank():
  """The integer all-gathers temoe's exchange plans with return the rank's own counts for every peer; float
  gathers stay collectives."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel

  env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", OWN_COUNTS], capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=HANG_S, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split("\n")[0] == "[[2, 3], [2, 3], [2, 3], [2, 3]] [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]"


def test_a_mocked_rank_moves_ragged_rows_through_padded_all_to_alls(monkeypatch):
  """Mocked NCCL has no ragged all-to-all (an H200: "No clique found"): the worker's exchanges resolve `ragged` to
  `padded` and dedup's and hier's hops move rows as XLA:CPU's do; the other strategies are kept."""
  from temoe.moe import exchange  # pylint: disable=import-outside-toplevel
  from temoe.moe.exchange import dedup, padded, ragged  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(exchange, "resolve", exchange.resolve)  # restored after the test
  monkeypatch.setattr(dedup, "transport", dedup.transport)
  assert exchange.resolve("auto", 8, "gpu") == "ragged" and dedup.transport("gpu") is ragged
  one_rank.padded_for_ragged()
  assert [exchange.resolve(n, 16, "gpu", top_k=8, local_experts=1, node_size=8) for n in ("auto", "ragged", "dedup",
                                                                                           "hier")] == \
      ["padded", "padded", "dedup", "hier"]
  assert dedup.transport("gpu") is padded


def test_the_mocked_runs_settings_are_maxtexts(tmp_path):
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  config = introspect.initialize_config(["one_rank", SMOKE, f"base_output_directory={tmp_path}",
                                         *one_rank.MOCK_SETTINGS], log_config=False)
  assert config.abort_on_nan_loss is False


def test_a_mocked_rank_reports_no_overflow_to_maxtexts_check(monkeypatch):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from temoe.maxtext import adapter  # pylint: disable=import-outside-toplevel
  from temoe.moe.routing import Routing  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(adapter, "sow_step_outputs", adapter.sow_step_outputs)  # restored after the test
  sown = {}
  layer = type("Layer", (), {"sow": lambda self, kind, name, value: sown.__setitem__(name, value)})()
  stats = {"received": jnp.array(70), "capacity": jnp.array(64), "overflow": jnp.array(True)}
  routing = Routing(experts=None, weights=None, lb_loss=None, bias_update=None, scores=None)
  adapter.sow_step_outputs(layer, stats, routing)
  assert bool(sown["te_moe_capacity_overflow"])
  one_rank.no_overflow_stop()
  adapter.sow_step_outputs(layer, stats, routing)
  assert not bool(sown["te_moe_capacity_overflow"]) and int(sown["te_moe_total_recv_tokens"]) == 70


def test_a_worker_past_its_timeout_leaves_its_stacks_in_its_log(tmp_path):
  """A depth that runs past --timeout is stopped with SIGABRT, so faulthandler prints where every thread was, and
  its log is kept whole beside the result (a hung compile under the mock said nothing when it was killed)."""
  args, overrides = one_rank.parse([SMOKE, "--devices", "2", "--cpu", "--timeout", "2", "--out", str(tmp_path)])
  row = one_rank.run_depth(args, overrides, 2, str(tmp_path))
  assert row["error"] == "timed out after 2s" and row["log"] == "one_rank.deepseek3-smoke.2.depth2.log", row
  log = (tmp_path / row["log"]).read_text()
  assert "Fatal Python error: Aborted" in log and "most recent call first" in log, log[-2000:]
