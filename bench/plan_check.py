"""`temoe plan` against measured peaks: the 1-GPU proxy's runs (bench/proxy_1gpu.py's paths, `path@N`
for N layers), each planned on this machine (on a GPU: its own; elsewhere: an H200 stand-in) and
compared with its peak HBM: measured here with --measure (each run in a fresh process, a few steps:
the allocator's peak is reached in the first), else read from `peak_hbm_gib` in --results. Prints
each plan and estimate / measured; writes the rows (with this command) to --out; exit 1 if any is
off by more than the plan's tolerance (15%), and says which are off by more than 5%.

    python bench/plan_check.py [--paths temoe_fp8,stock_best@5] [--results bench/results/proxy_1gpu.json]
    python bench/plan_check.py --measure --paths temoe_fp8_experts64,temoe_fp8_batch4 --out plan_check.measured.json  # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
TARGET = 0.05
"""How close the issue's target wants every estimate to its measured peak."""


def measured_with_sources(results: str) -> dict:
  """path -> (peak GiB, the file it came from) from proxy_1gpu.py result files or this script's own (its
  `rows`); the first file holding a measured peak for a path wins; files not there are skipped."""
  out = {}
  for path in reversed([r for r in results.split(",") if r and pathlib.Path(r).exists()]):
    result = json.loads(pathlib.Path(path).read_text())
    if "rows" in result:
      peaks = {r["path"]: r.get("measured_gib") for r in result["rows"]}
    else:
      peaks = {k: v.get("peak_hbm_gib") for k, v in result["paths"].items()}
    out.update({k: (v, path) for k, v in peaks.items() if v})
  return out


def measured_peaks(results: str) -> dict:
  """path -> peak GiB (`measured_with_sources` without the files)."""
  return {k: v for k, (v, _) in measured_with_sources(results).items()}


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--paths", default="temoe_fp8")
  parser.add_argument("--results", default=str(HERE / "results" / "proxy_1gpu.json"),
                      help="comma list of proxy_1gpu.py result files; a path's peak comes from the first holding it")
  parser.add_argument("--measure", action="store_true", help="measure each path's peak here (a GPU host) instead")
  parser.add_argument("--steps", type=int, default=4, help="steps per measured run")
  parser.add_argument("--timeout", type=int, default=150, help="seconds per measured run")
  parser.add_argument("--out", help="write the rows (and this command) as JSON here")
  parser.add_argument("--smoke", action="store_true", help="the proxy's --smoke size on this CPU (no peak to compare)")
  args = parser.parse_args()
  preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")  # what the measured runs see, as the proxy bench's
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # planning here takes none of the GPU's memory
  sys.path.insert(0, str(HERE))
  import bench_common_smoke  # pylint: disable=import-outside-toplevel
  import proxy_1gpu  # pylint: disable=import-outside-toplevel
  import training_runs  # pylint: disable=import-outside-toplevel

  from temoe.tools import plan  # pylint: disable=import-outside-toplevel

  runs = args.paths.split(",")
  for run in runs:
    proxy_1gpu.split_name(run)  # unknown paths: one line naming the choices, before anything runs
  found = {} if args.measure else measured_with_sources(args.results)
  measured = {k: peak for k, (peak, _) in found.items()}
  sources = {k: f for k, (_, f) in found.items()}
  workdir = tempfile.mkdtemp(prefix="plan-check-")  # the measured runs' output directories

  def measure(run: str, how=training_runs.measure) -> dict:
    env = proxy_1gpu.environment(proxy_1gpu.split_name(run)[0])
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    env.update({} if preallocate is None else {"XLA_PYTHON_CLIENT_PREALLOCATE": preallocate})
    return how(run, proxy_1gpu.args_of(run, args.smoke), args.steps, workdir, args.timeout, env)

  worst, rows = 0.0, []
  try:
    # --smoke: every run forked from this process (bench_common_smoke) before its planning makes a JAX backend
    forked = {run: measure(run, bench_common_smoke.measure) for run in runs} if args.measure and args.smoke else {}
    for run in runs:
      if args.measure:
        row = forked[run] if run in forked else measure(run)
        measured[run] = row.get("peak_hbm_gib")
        if not measured[run]:
          print(f"{run}: no peak measured: {row.get('error') or 'this device reports no memory_stats'}")
      peak = measured.get(run)
      maxtext_args = proxy_1gpu.args_of(run, args.smoke, sources.get(run))  # the config as the peak's run had it
      with proxy_1gpu.switches_as_measured(run, None if args.measure else sources.get(run)):
        p = plan.make_plan(maxtext_args[0], maxtext_args[1:])
      print(plan.table(p))
      estimate = p.estimate.peak / 2**30
      row = {"path": run, "estimate_gib": estimate, "measured_gib": peak, "ratio": estimate / peak if peak else None,
             "phase": p.estimate.transient.name}
      rows.append(row)
      print(f"PLAN_CHECK {json.dumps(row)}", flush=True)
      if peak:
        worst = max(worst, abs(estimate / peak - 1))
      if args.out:  # after every run
        command = " ".join(["python", "bench/plan_check.py", *sys.argv[1:]])
        pathlib.Path(args.out).write_text(json.dumps({"command": command, "tolerance": plan.TOLERANCE, "target": TARGET,
                                                       "measured_here": args.measure, "rows": rows}, indent=1))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  missing = [r["path"] for r in rows if not r["measured_gib"]]
  off = [f"{r['path']} {r['ratio']:.3f}" for r in rows if r["ratio"] and abs(r["ratio"] - 1) > TARGET]
  print(f"worst |estimate / measured - 1| = {worst:.3f}; beyond {TARGET:.0%}: {', '.join(off) or 'none'}"
        + (f"; no measured peak: {', '.join(missing)}" if missing else ""))
  if missing:
    return 2
  return 0 if worst <= plan.TOLERANCE else 1


if __name__ == "__main__":
  sys.exit(main())
