"""`temoe profile` on the smoke config (CPU): the trace's device time split by temoe's named scopes."""

from __future__ import annotations

import json
import re

import pytest

from temoe.tools import profiling


@pytest.fixture(scope="module")
def profiled(profiled_smoke):
  out, result = profiled_smoke
  return out, json.loads((out / "profile.json").read_text()), result.stdout


def test_every_moe_stage_attention_and_the_optimizer_take_time(profiled):
  _, r, stdout = profiled
  ms = r["ms_per_step"]
  assert r["steps"] == 2 and r["devices"] == 1 and r["modules"] == ["jit_train_step"]
  for category in ("attention", "router", "dispatch", "experts", "combine", "optimizer"):
    assert ms[category] > 0, category
  assert ms["collectives"] == 0  # one device: nothing to exchange
  assert ms["other"] + ms["idle"] < 0.5 * r["step_ms"], ms  # the scopes name most of the step
  assert r["top_ops"][0]["ms_per_step"] > 0 and "op_name" in r["top_ops"][0]
  assert re.search(r"^experts\s+[\d.]+\s+[\d.]+%$", stdout, re.M)


def test_categories_sum_to_the_step_time_and_overlap_counts_once(profiled):
  """The non-idle time equals the union of the step's op intervals, computed here independently
  (XLA:CPU runs ops on several threads at once: a sum of op durations would exceed the step)."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel

  out, r, _ = profiled
  assert sum(r["ms_per_step"].values()) == pytest.approx(r["step_ms"], rel=1e-9)
  intervals = sorted(
      (e.start_ns, e.end_ns)
      for plane in ProfileData.from_file(profiling.latest_trace(str(out))).planes
      if plane.name == "/host:CPU"
      for line in plane.lines
      for e in line.events
      if dict(e.stats).get("hlo_module") == "jit_train_step" and not re.match(r"(while|conditional|call)\b", e.name)
  )
  union, (start, end) = 0.0, intervals[0]
  for s, e in intervals[1:]:
    if s > end:
      union, start = union + end - start, s
    end = max(end, e)
  union += end - start
  busy_ms = r["step_ms"] - r["ms_per_step"]["idle"]
  assert busy_ms == pytest.approx(union / r["steps"] / 1e6, rel=1e-6)
  assert r["idle_fraction"] == pytest.approx(1 - union / r["steps"] / 1e6 / r["step_ms"], rel=1e-6)
  assert 1 / 3 < r["step_ms"] / r["maxtext_step_ms"] < 3  # and MaxText's own clock agrees on the scale


def test_flops_and_trace_mode(profiled, tmp_path):
  out, r, _ = profiled
  f = r["flops"]
  assert f["model_tflops_per_step_per_device"] == pytest.approx(486_752_256 / 1e12)
  assert f["model_tflops_per_s_per_device"] == pytest.approx(f["model_tflops_per_step_per_device"] / r["step_ms"] * 1e3)
  assert f["device_kind"] == "cpu" and f["mfu"] is None  # no GPU peak to divide by
  assert profiling.main(["--trace", str(out), "--out", str(tmp_path), "--steps", "2"]) == 0
  again = json.loads((tmp_path / "profile.json").read_text())
  assert again["ms_per_step"] == pytest.approx(r["ms_per_step"], rel=1e-9)


def test_classification_by_opcode_and_innermost_scope():
  remat = "jit(train_step)/transpose(jvp())/while/body/checkpoint/rematted_computation"
  assert profiling.classify(f"{remat}/temoe_experts/dot_general", "fusion") == "experts"
  assert profiling.classify(f"{remat}/temoe_attention/temoe_router/x", "fusion") == "router"
  assert profiling.classify("jit(train_step)/temoe_dispatch/ragged_all_to_all", "ragged-all-to-all") == "collectives"
  assert profiling.classify("", "async-start", "all-gather-start.3") == "collectives"
  assert profiling.classify("jit(train_step)/temoe_optimizer/mul", "multiply") == "optimizer"
  assert profiling.classify("jit(train_step)/temoe_expertsx/add", "add") == "other"
  hlo = '  ROOT %all-to-all.1 = (f32[2]{0}, s32[]) all-to-all(%p), metadata={op_name="jit(f)/temoe_dispatch/a"}'
  assert profiling.hlo_instructions(hlo) == {"all-to-all.1": ("all-to-all", "jit(f)/temoe_dispatch/a")}
  # unscoped GEMMs are dense: cuBLAS / TE custom calls, dots, GEMM fusions; other custom calls are not
  gemm = ('  %custom-call.9 = (bf16[4096,129280]{1,0}, s8[0]{0}) custom-call(%a, %b), '
          'custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/jvp()/dot_general"}')
  fusion = '  %fusion.3 = bf16[8,8]{1,0} fusion(%a), kind=kCustom, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}'
  found = profiling.hlo_instructions("\n".join([gemm, fusion]))
  assert found["custom-call.9"] == ("custom-call:__cublas$gemm", "jit(train_step)/jvp()/dot_general")
  assert found["fusion.3"] == ("fusion:gemm", "")
  for name in ("custom-call.9", "fusion.3"):
    opcode, op_name = found[name]
    assert profiling.classify(op_name, opcode) == "dense", name
  assert profiling.classify("jit(train_step)/dot_general", "custom-call:te_gemm_ffi") == "dense"
  assert profiling.classify("jit(train_step)/x", "dot") == "dense"
  assert profiling.classify("jit(train_step)/attn", "custom-call:__cudnn$fmhaSoftmax") == "other"
  assert profiling.classify(f"{remat}/temoe_experts/x", "custom-call:mosaic_gpu_v2") == "experts"


def test_attribution_shares_overlap_and_exposes_collectives():
  nested = profiling._leaf_segments([(0, 10, "parent"), (2, 4, "child")])  # pylint: disable=protected-access
  assert sorted(nested) == [(0, 2, "parent"), (2, 4, "child"), (4, 10, "parent")]
  spent = profiling.attribute([(0, 10, "a"), (5, 15, "b"), (8, 20, "nccl"), (30, 31, "c")], lambda k: k == "nccl")
  # [0,5) a; [5,8) a+b; [8,10) a+b, nccl hidden; [10,15) b, nccl hidden; [15,20) nccl exposed; [30,31) c
  assert spent == {"a": 5 + 1.5 + 1, "b": 1.5 + 1 + 5, "nccl": 5, "c": 1}
