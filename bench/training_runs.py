"""One MaxText training run per fresh process, and what the benchmarks read from it: median tokens/s,
TFLOP/s/device and step time over the steps after warm-up, the loss, the peak HBM the device
allocator saw, and the run's wall time. bench/proxy_1gpu.py, bench/small_model.py and
bench/plan_check.py measure through it, so every bench counts a run the same way.

A fresh process per run, since the allocator's peak (`memory_stats()["peak_bytes_in_use"]`) only
grows within a process and a compiled executable keeps its buffers' sizes.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

STOCK_MOE = ["te_moe_block=false", "sparse_matmul=true", "megablox=false", "use_tokamax_gmm=true"]
"""Stock MaxText's fastest MoE on a GPU we know: its own block on tokamax's grouped GEMM."""

STEADY_FROM = 3
"""Steps before this one are warm-up (compilation, autotuning) and left out of the medians."""


def worker(name: str, maxtext_args: list[str], steps: int, workdir: str) -> None:
  """Trains `maxtext_args` (a config file, then key=value) in this process; prints its peak HBM."""
  import temoe  # pylint: disable=import-outside-toplevel
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  temoe.register()
  argv = ["bench", *maxtext_args, f"steps={steps}", f"base_output_directory={workdir}", f"run_name={name}",
          f"metrics_file={metrics_path(workdir, name)}"]
  try:
    introspect.train(argv)
  except SystemExit as exc:
    if exc.code:
      raise
  import jax  # pylint: disable=import-outside-toplevel

  stats = jax.local_devices()[0].memory_stats() or {}
  print("BENCH_PEAK " + json.dumps({"peak_bytes": stats.get("peak_bytes_in_use")}), flush=True)


def metrics_path(workdir: str, name: str) -> str:
  return os.path.join(workdir, f"{name.replace('@', '_at_')}.jsonl")


def error_of(proc: subprocess.CompletedProcess) -> str:
  """The lines that say why a run failed (MaxText's stub notices left out), at most 1,500 characters."""
  lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip() and "[NO-OP]" not in l]
  tail = [l for l in lines if "rror" in l][-3:] or lines[-6:]
  return " | ".join(tail)[-1500:]


def summary(rows: list[dict], loss_window: int = 0) -> dict:
  """Medians over the steady steps of MaxText's metrics rows; with `loss_window`, the mean loss of
  the last that many steps (a training-quality figure rather than a speed one)."""
  steady = rows[STEADY_FROM:] or rows[-1:]
  out = {
      "tokens_per_s": statistics.median(r["perf/per_device_tokens_per_sec"] for r in steady),
      "tflops_per_device": statistics.median(r["perf/per_device_tflops_per_sec"] for r in steady),
      "step_time_s": statistics.median(r["perf/step_time_seconds"] for r in steady),
      "loss_last": rows[-1]["learning/loss"],
      "steps_measured": len(steady),
  }
  if loss_window:
    window = rows[-loss_window:]
    out[f"loss_mean_last_{loss_window}"] = statistics.fmean(r["learning/loss"] for r in window)
    out["loss_steps"] = [int(window[0]["step"]), int(window[-1]["step"])]
  return out


def measure(name: str, maxtext_args: list[str], steps: int, workdir: str, timeout: int, env: dict | None = None,
            loss_window: int = 0) -> dict:
  """Trains `maxtext_args` for `steps` steps in a fresh process; returns its summary with
  `peak_hbm_gib` and `wall_s` (process start to exit: start-up, compilation, the steps), or
  {"error": ..., "wall_s": ...}."""
  cmd = [sys.executable, __file__, "--worker", name, "--steps", str(steps), "--workdir", workdir, "--",
         *maxtext_args]
  start = time.monotonic()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ))
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout}s", "wall_s": round(time.monotonic() - start, 1)}
  return row_of(proc, name, workdir, round(time.monotonic() - start, 1), loss_window)


def row_of(proc: subprocess.CompletedProcess, name: str, workdir: str, wall: float, loss_window: int = 0) -> dict:
  """A finished run's row: its metrics' summary with `peak_hbm_gib` (its BENCH_PEAK line; None where the device
  reports none) and `wall_s`, or {"error": ..., "wall_s": ...}; the same for a fresh process and a forked one."""
  metrics = pathlib.Path(metrics_path(workdir, name))
  if proc.returncode != 0 or not metrics.exists():
    return {"error": error_of(proc), "wall_s": wall}
  rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
  if not rows:
    return {"error": "the run wrote no metrics rows", "wall_s": wall}
  peak = [json.loads(l.split(" ", 1)[1]) for l in proc.stdout.splitlines() if l.startswith("BENCH_PEAK ")]
  return {**summary(rows, loss_window),
          "peak_hbm_gib": (peak[0]["peak_bytes"] / 2**30) if peak and peak[0]["peak_bytes"] else None, "wall_s": wall}


def main() -> None:
  import argparse  # pylint: disable=import-outside-toplevel

  parser = argparse.ArgumentParser(description="one training run (the benchmarks start this)")
  parser.add_argument("--worker", required=True, help="run name")
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("maxtext_args", nargs="+", help="config file, then key=value")
  args = parser.parse_args()
  worker(args.worker, args.maxtext_args, args.steps, args.workdir)


if __name__ == "__main__":
  main()
