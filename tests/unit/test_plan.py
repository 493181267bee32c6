"""`temoe plan`: the per-device HBM estimate against what XLA reports for the compiled train step on
this CPU host (tests/plan_measure.py: CPU devices have no memory_stats), against the peaks measured
on an H200 (bench/results/proxy_1gpu*.json, plan_check.measured.json), and its verdict and exit codes."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

import scripts
from conftest import ROOT, SMOKE
from temoe.tools import plan

TOLERANCE = plan.TOLERANCE
"""The estimate is within 15% of the measured peak (both ways)."""

@pytest.fixture(scope="module")
def cpu_peaks():
  """{case: measured and estimated bytes}, from one process whose two children (1 and 4 host devices) run side by
  side, forked (tests/scripts.py) from the session's fork server: MaxText imported already."""
  done = scripts.run(ROOT / "tests" / "plan_measure.py", "smoke", "loss", "seq_256", "batch_16", "remat_minimal",
                     "unrolled", "--devices", "4", "fsdp_state", "expert_parallel")
  assert done.returncode == 0, done.stderr[-3000:]
  rows = {r["case"]: r for r in (json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
                                  if line.startswith("PLAN_MEASURE "))}
  assert len(rows) == 8 and rows["smoke"]["devices"] == 1 and rows["fsdp_state"]["devices"] == 4, rows
  return rows


@pytest.mark.parametrize("case", ["smoke", "loss", "fsdp_state", "seq_256", "batch_16", "remat_minimal", "unrolled"])
def test_estimate_within_tolerance_of_the_compiled_step_on_cpu(cpu_peaks, case):
  row = cpu_peaks[case]
  assert row["memory_stats"] is None  # why the measure is XLA's memory_analysis of the compiled step
  assert abs(row["estimate"] / row["measured"] - 1) <= TOLERANCE, row


def test_expert_parallel_estimate_errs_on_the_safe_side(cpu_peaks):
  """EP on XLA:CPU (padded all_to_all): buffers at their worst case; the estimate is over, not under."""
  row = cpu_peaks["expert_parallel"]
  assert 1.0 <= row["estimate"] / row["measured"] <= 1.25, row


def test_unrolled_layers_belong_to_their_blocks():
  """scan_layers=false: MaxText names each layer `<block>_<i>`; its parameters and gradients are that block's
  (once counted as the head's, which left every layer's gradient live from the loss on)."""
  from temoe.tools import hbm  # pylint: disable=import-outside-toplevel

  assert hbm.block_of(["decoder", "moe_layers_1", "MoeBlock_0", "wi"]) == "moe_layers"
  assert hbm.block_of(["decoder", "dense_layers_0", "mlp", "wo", "kernel"]) == "dense_layers"
  assert hbm.block_of(["decoder", "layers_12", "self_attention", "query", "kernel"]) == "layers"
  assert hbm.block_of(["decoder", "moe_layers", "MoeBlock_0", "wi"]) == "moe_layers"  # scanned
  assert hbm.block_of(["decoder", "logits_dense", "kernel"]) == "head"
  assert hbm.block_of(["decoder", "decoder_norm", "scale"]) == "head"
  assert hbm.block_of(["token_embedder", "embedding"]) == "embedding"


def proxy_args(path: str, measured_in: str | None = None) -> list[str]:
  sys.path.insert(0, str(ROOT / "bench"))
  import proxy_1gpu  # pylint: disable=import-outside-toplevel

  return proxy_1gpu.args_of(path, measured_in=measured_in)


RESULTS = ROOT / "bench" / "results"
MEASURED = ",".join(str(RESULTS / f) for f in ("proxy_1gpu.json", "proxy_1gpu.scan0.json", "proxy_1gpu.scan1.json",
                                                "proxy_1gpu.paths.json", "proxy_1gpu.save_moe.json",
                                                "proxy_1gpu.variants.json", "proxy_1gpu.fp8_weights.json",
                                                "proxy_1gpu.unrolled.json", "plan_check.measured.json"))
"""The committed H200 peaks: the proxy bench's calls and plan_check.py --measure's (plan_check.measured.json)."""


def h200_peaks() -> dict:
  sys.path.insert(0, str(ROOT / "bench"))
  import plan_check  # pylint: disable=import-outside-toplevel

  return {path: peak for path, peak in plan_check.measured_peaks(MEASURED).items() if peak}


GPU_TARGET = 0.05
"""The 1-GPU proxy paths: within 5% of the measured peak (the issue's target for every path the plan reports)."""
NOT_WITHIN_TARGET = {"temoe_fp8_unrolled": 1.056}
"""Measured paths the plan misses the 5% target for, with estimate / measured: temoe's unrolled 3-layer proxy
is over-estimated (the safe side) by a constant 2.4-2.7 GiB at 3 and 5 layers that the plan does not account
for. The test checks each stays on the safe side within the plan's tolerance, and fails once it is within 5%
(then it leaves this list)."""


def test_every_measured_gpu_proxy_path_is_planned_within_5_percent_of_its_h200_peak():
  """Planned here (no GPU: an H200 stand-in) against every committed H200 measurement of the same flags (as
  each file's runs had them: proxy_1gpu.as_measured), none of which the estimate's terms were fitted to but
  stock_best_scan0 at 3 and 5 layers: the grouped-GEMM MoE's copy of its expert weights was read from them
  (temoe.tools.hbm.state_parts); stock_best of proxy_1gpu.json (another remat policy) checks it."""
  peaks = h200_peaks()
  sys.path.insert(0, str(ROOT / "bench"))
  import plan_check  # pylint: disable=import-outside-toplevel

  import proxy_1gpu  # pylint: disable=import-outside-toplevel

  sources = {path: f for path, (_, f) in plan_check.measured_with_sources(MEASURED).items()}
  assert {"temoe_fp8", "stock_best", "temoe_fp8_remat_full", "temoe_fp8_scan0"} <= set(peaks), peaks
  backends = {"temoe_fp8": "mosaic", "temoe_fp8_te": "te", "temoe_bf16_moe": "mosaic", "stock_best": "gmm"}
  from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel

  off, plans = {}, {}
  for path, measured in sorted(peaks.items()):
    args = proxy_args(path, sources[path])  # the config as that run had it
    with proxy_1gpu.switches_as_measured(path, sources[path]):  # and temoe's switches
      key = (tuple(args), mosaic_tokens.SCALINGS)  # runs of one config and switches (another environment) plan once
      if key not in plans:
        plans[key] = plan.make_plan(args[0], args[1:], hbm_gib=141)
      p = plans[key]
    assert p.backend == backends.get(path, p.backend), path
    ratio = p.estimate.peak / 2**30 / measured
    if path in NOT_WITHIN_TARGET:
      assert GPU_TARGET < ratio - 1 <= TOLERANCE and round(ratio, 3) == NOT_WITHIN_TARGET[path], (path, ratio)
    elif abs(ratio - 1) > GPU_TARGET:
      off[path] = (round(p.estimate.peak / 2**30, 2), round(measured, 2), round(ratio, 3))
  assert not off, off


def test_plan_check_reports_estimate_over_measured_per_path(tmp_path, monkeypatch, capsys):
  """bench/plan_check.py's main, in this process (MaxText imported already)."""
  out = tmp_path / "rows.json"
  sys.path.insert(0, str(ROOT / "bench"))
  import plan_check  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(sys, "argv", ["plan_check.py", "--paths", "temoe_fp8,temoe_fp8@5", "--results", MEASURED,
                                    "--out", str(out)])
  # what main sets (setdefault), restored after the test
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false"))
  done = types.SimpleNamespace(returncode=plan_check.main(), stdout=capsys.readouterr().out)
  rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["temoe_fp8"]["measured_gib"] == h200_peaks()["temoe_fp8"]
  assert abs(rows["temoe_fp8"]["ratio"] - 1) <= GPU_TARGET
  assert rows["temoe_fp8@5"]["estimate_gib"] > rows["temoe_fp8"]["estimate_gib"] + 20  # two MoE layers' state more
  if "temoe_fp8@5" in h200_peaks():
    assert done.returncode == 0, done.stdout[-3000:]
  else:  # not measured yet: planned, and said so
    assert done.returncode == 2 and "no measured peak: temoe_fp8@5" in done.stdout, done.stdout[-3000:]


def test_fits_and_does_not_fit(capsys):
  assert plan.main([SMOKE, "--hbm-gib", "1"]) == 0
  out = capsys.readouterr().out
  assert "fits:" in out and "parameters" in out and "layer working set (MoE layer) <- peak" in out
  assert plan.main([SMOKE, "--hbm-gib", "0.01"]) == 1
  assert "does not fit:" in capsys.readouterr().out


BAD = {
    "missing config": (["configs/nope.yml"], "is not a config YAML file"),
    "not a YAML": (["README.md"], "is not a config YAML file"),
    "negative HBM": ([SMOKE, "--hbm-gib", "-1"], "must be a positive number of GiB"),
    "zero devices": ([SMOKE, "--devices", "0"], "must be at least 1"),
    "not key=value": ([SMOKE, "steps"], "pass MaxText settings as key=value"),
    "bad recipe": ([SMOKE, "te_gmm_quantization=te_fp9"], "valid choices: te_no_quant"),
    "mesh not spanning the devices": ([SMOKE, "ici_fsdp_parallelism=3", "--devices", "4"], "cannot span 4 device(s)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line(capsys, case):
  args, expected = BAD[case]
  assert plan.main(args) == 2
  lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("temoe plan: ")]
  assert len(lines) == 1 and expected in lines[0], lines


def test_cli_plans_the_smoke_config_and_reports_a_miss(capsys):
  """`temoe plan` through the CLI's main, in this process: the table, and a miss in 0.001 GiB as exit code 1 (main's
  verdicts and both exit codes are test_fits_and_does_not_fit's; this checks the command passes them on; the
  `temoe` program's own entry is test_cli_errors')."""
  from temoe import cli  # pylint: disable=import-outside-toplevel

  code = cli.main(["plan", SMOKE, "--hbm-gib", "0.001"])
  out = capsys.readouterr()
  assert code == 1, out.err[-2000:]
  assert "does not fit:" in out.out and "peak estimate" in out.out, out.out[-2000:]


def test_remat_policy_none_recomputes_scanned_layers_and_keeps_unscanned_ones():
  """MaxText wraps each scanned layer in jax.checkpoint with the policy `none` names (None: nothing
  saved), and calls unscanned layers without remat (nnx_decoders)."""
  from temoe.tools import hbm_activations  # pylint: disable=import-outside-toplevel

  for name in ("none", None):  # MaxText's config holds None for "none"
    for scanned, where in ((True, "remat"), (False, "device")):
      config = types.SimpleNamespace(remat_policy=name, scan_layers=scanned)
      assert hbm_activations.placement(None, "mlpwo", config) == where
      assert hbm_activations.placement(None, "decoder_layer_input", config) == "device"


def test_the_plan_takes_the_tokens_mlp_where_the_block_does(monkeypatch):
  """The memory plan drops the bf16 dispatched and gradient rows exactly where the block hands the tokens
  to mosaic_tokens: temoe's mosaic kernels, an FP8 scaling in its SCALINGS, no expert biases, and an
  exchange in exchange.TOKENS_MLP (one device, or dedup under expert parallelism)."""
  from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel
  from temoe.tools import hbm_activations as act  # pylint: disable=import-outside-toplevel

  def takes(recipe="te_fp8_current", backend="mosaic", ep=1, exchange="auto", bias=False):
    config = types.SimpleNamespace(te_gmm_quantization=recipe, mlp_bias=bias, te_moe_exchange=exchange,
                                   num_experts=64, num_experts_per_tok=8)
    s = act.Shapes(tokens=4096, batch=1, seq=4096, emb=7168, tp=1, ep=ep, act=2)
    return act.from_tokens(config, s, backend)

  monkeypatch.setattr(mosaic_tokens, "SCALINGS", frozenset(("blockwise", "current")))
  assert takes() and takes("te_fp8_blockwise") and takes(ep=8) and takes(ep=8, exchange="dedup")
  assert not takes(ep=8, exchange="ragged")  # one row per pair: the buffer path
  assert not takes(backend="te") and not takes("te_no_quant") and not takes(bias=True)
  monkeypatch.setattr(mosaic_tokens, "SCALINGS", frozenset(("blockwise",)))
  assert not takes() and takes("te_fp8_blockwise")


def tools_imports() -> dict[str, set[str]]:
  """{module of temoe.tools: the temoe.tools modules it imports}, lazy (function-level) imports included."""
  import ast  # pylint: disable=import-outside-toplevel

  folder = ROOT / "plugin" / "temoe" / "tools"
  mods = {p.stem for p in folder.glob("*.py")}
  graph = {}
  for name in mods:
    deps = set()
    for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == "temoe.tools":
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("temoe.tools."):
        deps.add(node.module.split(".")[2])
    graph[name] = (deps & mods) - {name}
  return graph


def test_no_import_circle_among_the_offline_tools():
  """plan -> sweep -> planner: the layout sweep plans through temoe.tools.planner, not through the CLI module
  that calls it (once plan <-> sweep)."""
  graph = tools_imports()
  assert "sweep" in graph["plan"] and "planner" in graph["sweep"] and "plan" not in graph["sweep"]

  def reaches(start: str, goal: str, seen: set[str]) -> bool:
    return any(d == goal or (d not in seen and reaches(d, goal, seen | {d})) for d in graph[start])

  circles = sorted(m for m in graph if reaches(m, m, set()))
  assert not circles, {m: graph[m] for m in circles}
