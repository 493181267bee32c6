"""Benchmark: MaxText training of the 1-GPU DeepSeek-V3 proxy, one MoE path per fresh process.

Paths: temoe_fp8, temoe_bf16 (where TE's bf16 grouped GEMM runs), native_ragged, tokamax_gmm,
capacity_1.25. Each reports median tokens/s and MaxText's TFLOP/s/device over the steps after
warm-up, and peak HBM. Writes JSON (with the exact command) and a PNG under bench/results/.

    python bench/proxy_1gpu.py [--paths temoe_fp8,tokamax_gmm] [--steps 10] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

PROXY = [
    "model_name=deepseek3-671b",
    "override_model_config=true",
    "base_num_decoder_layers=3",
    "first_num_dense_layers=1",
    "num_experts=32",
    "max_target_length=2048",
    "per_device_batch_size=2",
    "weight_dtype=bfloat16",
    "dtype=bfloat16",
    "remat_policy=full",
    "dataset_type=synthetic",
    "hardware=gpu",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    "skip_jax_distributed_system=true",
]

PATHS = {
    "temoe_fp8": ["te_moe_block=true", "te_gmm_quantization=te_fp8_current", "te_moe_backend=te",
                  "sparse_matmul=true", "prefuse_moe_weights=true"],
    "temoe_bf16": ["te_moe_block=true", "te_gmm_quantization=te_no_quant", "te_moe_backend=te",
                   "sparse_matmul=true", "prefuse_moe_weights=true"],
    "native_ragged": ["sparse_matmul=true", "megablox=false"],
    "tokamax_gmm": ["sparse_matmul=true", "megablox=false", "use_tokamax_gmm=true"],
    "capacity_1.25": ["sparse_matmul=false", "capacity_factor=1.25"],
}


def worker(path: str, steps: int, workdir: str) -> None:
  """Trains one path in this process and prints one JSON line with its peak HBM."""
  import temoe  # pylint: disable=import-outside-toplevel

  temoe.register()
  from absl import app  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel
  from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # pylint: disable=import-outside-toplevel

  del pyconfig
  argv = ["bench", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml"), *PROXY, *PATHS[path], f"steps={steps}",
          f"base_output_directory={workdir}", f"run_name={path}", f"metrics_file={workdir}/{path}.jsonl"]
  try:
    app.run(train.main, argv=argv)
  except SystemExit as exc:
    if exc.code:
      raise
  import jax  # pylint: disable=import-outside-toplevel

  stats = jax.local_devices()[0].memory_stats() or {}
  print("BENCH_PEAK " + json.dumps({"peak_bytes": stats.get("peak_bytes_in_use")}), flush=True)


def measure(path: str, steps: int, workdir: str, timeout: int) -> dict:
  cmd = [sys.executable, __file__, "--worker", path, "--steps", str(steps), "--workdir", workdir]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout}s"}
  peak = [json.loads(l.split(" ", 1)[1]) for l in proc.stdout.splitlines() if l.startswith("BENCH_PEAK ")]
  metrics = pathlib.Path(workdir, f"{path}.jsonl")
  if proc.returncode != 0 or not metrics.exists():
    lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip() and "[NO-OP]" not in l]
    tail = [l for l in lines if "rror" in l][-3:] or lines[-6:]
    return {"error": " | ".join(tail)[-1500:]}
  rows = [json.loads(l) for l in metrics.read_text().splitlines()]
  steady = rows[3:] or rows[-1:]
  return {
      "tokens_per_s": statistics.median(r["perf/per_device_tokens_per_sec"] for r in steady),
      "tflops_per_device": statistics.median(r["perf/per_device_tflops_per_sec"] for r in steady),
      "step_time_s": statistics.median(r["perf/step_time_seconds"] for r in steady),
      "loss_last": rows[-1]["learning/loss"],
      "peak_hbm_gib": (peak[0]["peak_bytes"] / 2**30) if peak and peak[0]["peak_bytes"] else None,
      "steps_measured": len(steady),
  }


def ratios(paths: dict) -> dict:
  def tok(name):
    return paths.get(name, {}).get("tokens_per_s")

  out = {}
  if tok("temoe_fp8") and tok("tokamax_gmm"):
    out["temoe_fp8_over_tokamax_tokens"] = tok("temoe_fp8") / tok("tokamax_gmm")
  if tok("temoe_bf16") and tok("tokamax_gmm"):
    out["temoe_bf16_over_tokamax_tokens"] = tok("temoe_bf16") / tok("tokamax_gmm")
  hbm = {k: v.get("peak_hbm_gib") for k, v in paths.items()}
  if hbm.get("temoe_fp8") and hbm.get("tokamax_gmm"):
    out["temoe_fp8_over_tokamax_peak_hbm"] = hbm["temoe_fp8"] / hbm["tokamax_gmm"]
  return out


def plot(result: dict, png: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  names = [k for k, v in result["paths"].items() if "tokens_per_s" in v]
  fig, ax = plt.subplots(figsize=(7, 3.5))
  ax.bar(names, [result["paths"][k]["tokens_per_s"] for k in names], color="#76b900")
  ax.set_ylabel("tokens/s/device")
  ax.set_title("DeepSeek-V3 proxy (3 layers, 32 experts), 1x H200")
  fig.tight_layout()
  fig.savefig(png, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--paths", default=",".join(PATHS))
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--timeout", type=int, default=240)
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--worker")
  parser.add_argument("--workdir")
  args = parser.parse_args()
  if args.worker:
    worker(args.worker, args.steps, args.workdir)
    return
  workdir = tempfile.mkdtemp(prefix="proxy-")
  result = {"command": " ".join(["python", "bench/proxy_1gpu.py", *sys.argv[1:]]), "proxy_flags": PROXY, "paths": {}}
  for path in args.paths.split(","):
    result["paths"][path] = measure(path, args.steps, workdir, args.timeout)
    print(path, json.dumps(result["paths"][path]), flush=True)
    result["ratios"] = ratios(result["paths"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "proxy_1gpu.json"), "w", encoding="utf-8") as f:  # after every path
      json.dump(result, f, indent=1)
  try:
    plot(result, os.path.join(args.out, "proxy_1gpu.png"))
  except ImportError as exc:
    print("no plot:", exc)
  print(json.dumps(result["ratios"]))


if __name__ == "__main__":
  main()
