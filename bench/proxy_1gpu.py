"""Benchmark: MaxText training of the 1-GPU DeepSeek-V3 proxy, one path per fresh process.

`temoe_fp8` is the shipped config, `configs/deepseek3-proxy-1gpu.yml`, as a user runs it (FP8 expert
GEMMs on temoe's sync-free Hopper kernels, MaxText's TE FP8 for the dense GEMMs). `stock_best` is the
fastest stock MaxText we know on the same GPU: the same model and settings (cuDNN attention, MaxText's
TE FP8 for the dense GEMMs, the same remat) with MaxText's own tokamax grouped GEMM instead of temoe's
block. The other paths take one setting away or swap one part, so each setting's gain is measured in
the same call: `temoe_bf16_moe` (bf16 expert GEMMs on temoe's kernels), `temoe_fp8_te` (FP8 expert
GEMMs on TE's grouped GEMM), `temoe_fp8_env` / `stock_best_env` (+ `temoe env`'s container profile),
`temoe_fp8_graphs` (XLA's command-buffer list, i.e. CUDA graphs, set explicitly without CONDITIONAL;
every path runs with XLA's default list, which includes custom calls), `temoe_fp8_remat_full`, `temoe_fp8_bf16_dense`, `temoe_fp8_autoattn`, and the stock paths as committed
before (`tokamax_gmm`, `native_ragged`, `capacity_1.25`: autoselected attention, remat full). Each
reports median tokens/s and MaxText's TFLOP/s/device over the steps after warm-up, and peak HBM;
ratios are against `stock_best`. Writes JSON (with the exact command) and a PNG.

    python bench/proxy_1gpu.py [--paths temoe_fp8,stock_best] [--steps 10] [--out bench/results]
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = str(ROOT / "configs" / "deepseek3-proxy-1gpu.yml")
COMMON = ["dataset_type=synthetic", "enable_checkpointing=false", "enable_tensorboard=false"]

PROXY = [  # the stock paths as committed before: MaxText's 671B shapes cut to the proxy
    "model_name=deepseek3-671b", "override_model_config=true", "base_num_decoder_layers=3",
    "first_num_dense_layers=1", "num_experts=32", "max_target_length=2048", "per_device_batch_size=2",
    "weight_dtype=bfloat16", "dtype=bfloat16", "remat_policy=full", "hardware=gpu",
    "skip_jax_distributed_system=true",
]
STOCK_MOE = ["te_moe_block=false", "sparse_matmul=true", "megablox=false", "use_tokamax_gmm=true"]

GRAPHS = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"}

PATHS = {  # name -> (config, overrides, environment: False, True (the container env profile) or a dict)
    "temoe_fp8": (SHIPPED, [], False),
    "stock_best": (SHIPPED, STOCK_MOE, False),
    "temoe_bf16_moe": (SHIPPED, ["te_gmm_quantization=te_no_quant"], False),
    "temoe_fp8_te": (SHIPPED, ["te_moe_backend=te"], False),
    "temoe_fp8_env": (SHIPPED, [], True),
    "temoe_fp8_graphs": (SHIPPED, [], GRAPHS),
    "stock_best_env": (SHIPPED, STOCK_MOE, True),
    "temoe_fp8_remat_full": (SHIPPED, ["remat_policy=full"], False),
    "temoe_fp8_bf16_dense": (SHIPPED, ["quantization=''"], False),
    "temoe_fp8_autoattn": (SHIPPED, ["attention=autoselected"], False),
    "temoe_bf16": (SHIPPED, ["te_gmm_quantization=te_no_quant", "quantization=''"], False),
    "tokamax_gmm": ("base.yml", [*PROXY, "sparse_matmul=true", "megablox=false", "use_tokamax_gmm=true"], False),
    "native_ragged": ("base.yml", [*PROXY, "sparse_matmul=true", "megablox=false"], False),
    "capacity_1.25": ("base.yml", [*PROXY, "sparse_matmul=false", "capacity_factor=1.25"], False),
}


def args_of(path: str) -> list[str]:
  """MaxText's arguments for `path`: its config file, then key=value overrides."""
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  config, overrides, _ = PATHS[path]
  return [config if os.path.isabs(config) else os.path.join(introspect.configs_dir(), config), *COMMON, *overrides]


def worker(path: str, steps: int, workdir: str) -> None:
  """Trains one path in this process and prints one JSON line with its peak HBM."""
  import temoe  # pylint: disable=import-outside-toplevel
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  temoe.register()
  argv = ["bench", *args_of(path), f"steps={steps}",
          f"base_output_directory={workdir}", f"run_name={path}", f"metrics_file={workdir}/{path}.jsonl"]
  try:
    introspect.train(argv)
  except SystemExit as exc:
    if exc.code:
      raise
  import jax  # pylint: disable=import-outside-toplevel

  stats = jax.local_devices()[0].memory_stats() or {}
  print("BENCH_PEAK " + json.dumps({"peak_bytes": stats.get("peak_bytes_in_use")}), flush=True)


def measure(path: str, steps: int, workdir: str, timeout: int) -> dict:
  cmd = [sys.executable, __file__, "--worker", path, "--steps", str(steps), "--workdir", workdir]
  env = dict(os.environ)
  extra = PATHS[path][2]
  if extra is True:
    from temoe.deploy import env as profile  # pylint: disable=import-outside-toplevel

    env.update(profile.environment("hopper", env))
  elif extra:
    env.update({k: f"{env.get(k, '')} {v}".strip() for k, v in extra.items()})
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
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
  """Every path's tokens/s and peak HBM over `stock_best`'s (and over `tokamax_gmm`'s, as before)."""
  out = {}
  for base in ("stock_best", "tokamax_gmm"):
    ref = paths.get(base, {})
    for name, row in paths.items():
      if name != base and row.get("tokens_per_s") and ref.get("tokens_per_s"):
        out[f"{name}_over_{base}_tokens"] = row["tokens_per_s"] / ref["tokens_per_s"]
      if name != base and row.get("peak_hbm_gib") and ref.get("peak_hbm_gib"):
        out[f"{name}_over_{base}_peak_hbm"] = row["peak_hbm_gib"] / ref["peak_hbm_gib"]
  return out


def plot(result: dict, png: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  names = [k for k, v in result["paths"].items() if "tokens_per_s" in v]
  fig, ax = plt.subplots(figsize=(7, 3.5))
  ax.bar(names, [result["paths"][k]["tokens_per_s"] for k in names], color="#76b900")
  ax.set_ylabel("tokens/s/device")
  ax.set_title("DeepSeek-V3 proxy (3 layers, 32 experts), 1 GPU")
  ax.tick_params(axis="x", labelsize=7, rotation=30)
  fig.tight_layout()
  fig.savefig(png, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--paths", default="temoe_fp8,stock_best,temoe_bf16_moe,temoe_fp8_te")
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
  result = {"command": " ".join(["python", "bench/proxy_1gpu.py", *sys.argv[1:]]), "shipped_config": "configs/deepseek3-proxy-1gpu.yml",
            "stock_moe_flags": STOCK_MOE, "proxy_flags": PROXY, "paths": {}}
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
