"""Benchmark: a small DeepSeek-V3-shaped model (configs/deepseek3-small-1gpu.yml: hidden 1024, expert
ffn 512, 32 experts, top-8, 1 dense + 3 MoE layers, seq 256, batch 32, bf16 activations, float32
weights) trained end to end on one GPU, one path per fresh process, in one call:

  temoe_fp8            te_gmm_quantization=te_fp8_current (FP8 expert GEMMs, per-expert current scaling)
  temoe_bf16           te_gmm_quantization=te_no_quant (bf16 expert GEMMs)
  temoe_fp8_blockwise  te_gmm_quantization=te_fp8_blockwise (1x128 / 128x128 block scales)
  tokamax              stock MaxText: te_moe_block=false sparse_matmul=true megablox=false use_tokamax_gmm=true

Each path reports median tokens/s, TFLOP/s/device and step time after warm-up, peak HBM and wall
time; ratios are tokens/s over tokamax's. `--data learnable` trains on temoe's learnable token stream
(`temoe data`'s Markov chain, at the model's vocabulary and sequence length, the same rows in the same
order for every path) instead of MaxText's all-zero synthetic batches, and records each path's mean
loss over the last --loss-window steps and its ratio to temoe_bf16's: with --steps 300, the training
check of the blockwise recipe (within 0.1% of bf16). `--profile` then runs `temoe profile` (MaxText's
profiler, 3 warm-up + 3 traced steps, CUDA graphs off) on --profile-paths in the same call and adds the
per-category step breakdown (attention, router, dispatch, experts, combine, dense, optimizer, other,
idle) and its difference between the first two profiled paths; each trace is copied beside the JSON,
and `--analyse` fills the breakdown in from those copies on another machine if the analysis could not
run where the traces were taken. `--smoke`: the same code on this CPU at a tiny size (tokamax has no
CPU kernel there: MaxText's own ragged_dot stands in; FP8 paths need a GPU; a profiled path trains its
--steps in its profile run, one process fewer; each run forked from this process, bench/bench_common_smoke.py).

    python bench/small_model.py [--paths temoe_fp8,temoe_bf16,tokamax] [--steps 30] [--data learnable]
        [--profile] [--out bench/results] [key=value ...]
"""

from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common_smoke  # noqa: E402  # pylint: disable=wrong-import-position
import training_runs  # noqa: E402  # pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "deepseek3-small-1gpu.yml")
COMMON = ["enable_checkpointing=false", "enable_tensorboard=false"]

PATHS = {
    "temoe_fp8": ["te_gmm_quantization=te_fp8_current"],
    "temoe_bf16": ["te_gmm_quantization=te_no_quant"],
    "temoe_fp8_blockwise": ["te_gmm_quantization=te_fp8_blockwise"],
    "tokamax": training_runs.STOCK_MOE,
}
REFERENCE = "tokamax"
"""Speed ratios are over this path's tokens/s."""
LOSS_REFERENCE = "temoe_bf16"
"""Loss ratios are over this path's mean loss."""

SMOKE = [  # --smoke: this CPU, every width cut to a few dozen
    "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=144", "base_moe_mlp_dim=16",
    "num_experts=8", "num_experts_per_tok=2", "q_lora_rank=32", "kv_lora_rank=16", "qk_nope_head_dim=16",
    "qk_rope_head_dim=8", "v_head_dim=16", "vocab_size=256", "max_target_length=32", "per_device_batch_size=2",
    "hardware=cpu", "attention=dot_product", "use_tokamax_gmm=false",
]

PROFILE_SKIP, PROFILE_STEPS = 3, 3


def config_value(key: str, overrides: list[str]):
  """`key` as the run sees it: the last key=value override, else the config file's value."""
  import yaml  # pylint: disable=import-outside-toplevel

  for item in reversed(overrides):
    k, _, v = item.partition("=")
    if k == key:
      return yaml.safe_load(v)
  return yaml.safe_load(pathlib.Path(CONFIG).read_text())[key]


def learnable_data(workdir: str, steps: int, overrides: list[str]) -> list[str]:
  """Writes the learnable stream for `steps` steps of this model (every row read once) and returns the
  MaxText flags that train on it."""
  from temoe.run import data  # pylint: disable=import-outside-toplevel

  batch, seq = int(config_value("per_device_batch_size", overrides)), int(config_value("max_target_length", overrides))
  vocab = int(config_value("vocab_size", overrides))
  path = data.write_parquet(os.path.join(workdir, "learnable.parquet"), rows=(steps + 1) * batch, length=seq + 1,
                            vocab=vocab)
  return ["dataset_type=grain", "grain_file_type=parquet", f"grain_train_files={path}", "grain_worker_count=0",
          "tokenize_train_data=false", "train_data_columns=['tokens']", "packing=false", "enable_data_shuffling=false",
          "eval_interval=-1"]


def args_of(path: str, extra: list[str]) -> list[str]:
  """MaxText's arguments for `path`: the config, the path's flags, then `extra` (data, smoke, user's)."""
  return [CONFIG, *COMMON, *PATHS[path], *extra]


def profile(path: str, extra: list[str], workdir: str, out: str, timeout: int, skip: int = PROFILE_SKIP,
            smoke: bool = False) -> dict:
  """`temoe profile` of `path` in a fresh process (`skip` steps, then PROFILE_STEPS traced; --smoke: forked from
  this one, bench_common_smoke): its step breakdown, and a copy of its trace in `out`."""
  run_dir = os.path.join(workdir, "profile", path)
  cmd = [sys.executable, "-m", "temoe.cli", "profile", *args_of(path, extra), "--out", run_dir,
         "--skip", str(skip), "--steps", str(PROFILE_STEPS)]
  start = time.monotonic()
  try:
    if smoke:
      proc = bench_common_smoke.cli(cmd[3:], timeout)
    else:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout}s"}
  row = {"wall_s": round(time.monotonic() - start, 1)}
  traces = sorted(glob.glob(os.path.join(run_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  if traces:
    row["trace"] = f"small_model.{path}.xplane.pb"
    shutil.copyfile(traces[-1], os.path.join(out, row["trace"]))
  done = os.path.join(run_dir, "profile.json")
  if proc.returncode == 0 and os.path.exists(done):
    row.update(breakdown_fields(json.loads(pathlib.Path(done).read_text())))
  else:
    row["error"] = training_runs.error_of(proc)
  return row


def trained_in_profile(path: str, workdir: str, profiled: dict, loss_window: int) -> dict:
  """--smoke: `path`'s row from the metrics of its profile run, which trained the path's --steps (one process
  fewer on this CPU, where the numbers time nothing). On a GPU every path trains in a process of its own,
  unprofiled: a trace slows the steps it covers."""
  metrics = pathlib.Path(workdir, "profile", path, "metrics.jsonl")
  rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.exists() else []
  if "error" in profiled or not rows:
    return {"error": profiled.get("error", "the profile run wrote no metrics rows"), "wall_s": profiled.get("wall_s")}
  return {**training_runs.summary(rows, loss_window), "peak_hbm_gib": None, "wall_s": profiled["wall_s"]}


def breakdown_fields(result: dict) -> dict:
  """What the benchmark keeps of a `temoe profile` result."""
  keep = ("step_ms", "ms_per_step", "share", "idle_fraction", "maxtext_step_ms", "unmatched_ms")
  row = {k: result[k] for k in keep if k in result}
  row["top_ops"] = result.get("top_ops", [])[:10]
  if result.get("flops"):
    row["mfu"] = result["flops"].get("mfu")
  return row


def profile_difference(profiles: dict) -> dict | None:
  """ms per step per category of the first profiled path minus the second's (where both were analysed)."""
  done = [(p, r) for p, r in profiles.items() if "ms_per_step" in r]
  if len(done) < 2:
    return None
  (a, ra), (b, rb) = done[:2]
  ms = {c: ra["ms_per_step"][c] - rb["ms_per_step"].get(c, 0.0) for c in ra["ms_per_step"]}
  return {"of": f"{a} - {b}", "step_ms": ra["step_ms"] - rb["step_ms"], "ms_per_step": ms}


def ratios(paths: dict) -> dict:
  """tokens/s over tokamax's; mean loss over temoe_bf16's (where both ran)."""
  out = {}
  ref = paths.get(REFERENCE, {})
  window = next((k for row in paths.values() for k in row if k.startswith("loss_mean_last_")), None)
  for name, row in paths.items():
    if name != REFERENCE and row.get("tokens_per_s") and ref.get("tokens_per_s"):
      out[f"{name}_over_{REFERENCE}_tokens"] = row["tokens_per_s"] / ref["tokens_per_s"]
    loss_ref = paths.get(LOSS_REFERENCE, {}).get(window)
    if window and row.get(window) and loss_ref:
      row[f"loss_ratio_to_{LOSS_REFERENCE}"] = row[window] / loss_ref
  return out


def analyse(json_path: str) -> int:
  """Fills in each profiled path's breakdown from its trace beside `json_path` (e.g. on a machine with
  a working xprof after the GPU run could not analyse it)."""
  from temoe.tools import profiling  # pylint: disable=import-outside-toplevel

  result = json.loads(pathlib.Path(json_path).read_text())
  for path, row in result.get("profile", {}).items():
    if row.get("trace") and "ms_per_step" not in row:
      row.update(breakdown_fields(profiling.breakdown(os.path.join(os.path.dirname(json_path), row["trace"]), PROFILE_STEPS)))
      row.pop("error", None)
      row["analysed_apart"] = True
      print(f"{path}:\n{profiling.table(row)}")
  result["profile_difference"] = profile_difference(result.get("profile", {}))
  pathlib.Path(json_path).write_text(json.dumps(result, indent=1))
  return 0


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--paths", default="temoe_fp8,temoe_bf16,temoe_fp8_blockwise,tokamax",
                      help=f"comma list of: {', '.join(PATHS)}")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--data", choices=("synthetic", "learnable"), default="synthetic")
  parser.add_argument("--loss-window", type=int, default=50, help="steps at the end whose mean loss is recorded")
  parser.add_argument("--profile", action="store_true", help="also profile --profile-paths in this call")
  parser.add_argument("--profile-paths", default="temoe_fp8,tokamax")
  parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--smoke", action="store_true", help="tiny widths on this CPU: exercises the code, times nothing")
  parser.add_argument("--analyse", metavar="JSON", help="only fill in the profile breakdowns of this result file")
  args, overrides = parser.parse_known_args(argv)
  bad = [o for o in overrides if "=" not in o or o.startswith("-")]
  if bad:
    parser.error(f"unknown arguments {' '.join(bad)}; pass MaxText settings as key=value")
  for flag in ("paths", "profile_paths"):
    unknown = [p for p in getattr(args, flag).split(",") if p not in PATHS]
    if unknown:
      parser.error(f"--{flag.replace('_', '-')}: unknown {', '.join(unknown)}; valid choices: {', '.join(PATHS)}")
  if args.steps <= training_runs.STEADY_FROM:
    parser.error(f"--steps={args.steps}: more than {training_runs.STEADY_FROM} warm-up steps are needed")
  return args, overrides


def main(argv: list[str] | None = None) -> int:
  args, overrides = parse(sys.argv[1:] if argv is None else argv)
  if args.analyse:
    return analyse(args.analyse)
  workdir = tempfile.mkdtemp(prefix="small-model-")
  atexit.register(shutil.rmtree, workdir, ignore_errors=True)  # the runs' outputs: results are copied out
  extra = [*(SMOKE if args.smoke else []), *overrides]
  window = min(args.loss_window, args.steps - training_runs.STEADY_FROM) if args.data == "learnable" else 0
  if args.data == "learnable":
    extra = [*learnable_data(workdir, args.steps, extra), *extra]
  result = {"command": " ".join(["python", "bench/small_model.py", *(sys.argv[1:] if argv is None else argv)]),
            "config": "configs/deepseek3-small-1gpu.yml", "paths_flags": {p: PATHS[p] for p in args.paths.split(",")},
            "data": args.data, "steps": args.steps, "smoke": SMOKE if args.smoke else False, "overrides": overrides,
            "paths": {}}
  os.makedirs(args.out, exist_ok=True)
  out_json = os.path.join(args.out, "small_model.json")

  def save():
    result["ratios"] = ratios(result["paths"])
    pathlib.Path(out_json).write_text(json.dumps(result, indent=1))

  profiles = {}
  if args.profile:
    result["profile"] = profiles
  in_profile = set(args.profile_paths.split(",")) if args.profile and args.smoke else set()
  for path in args.paths.split(","):
    if path in in_profile:  # --smoke: the path trains in its profile run, the last PROFILE_STEPS steps traced
      profiles[path] = profile(path, extra, workdir, args.out, args.timeout, skip=args.steps - PROFILE_STEPS,
                               smoke=True)
      result["paths"][path] = trained_in_profile(path, workdir, profiles[path], window)
    else:  # --smoke: forked from this process (bench_common_smoke), else a fresh one
      how = bench_common_smoke.measure if args.smoke else training_runs.measure
      result["paths"][path] = how(path, args_of(path, extra), args.steps, workdir, args.timeout, loss_window=window)
    print(path, json.dumps(result["paths"][path]), flush=True)
    save()
  if args.profile:
    for path in args.profile_paths.split(","):
      if path not in profiles:
        profiles[path] = profile(path, extra, workdir, args.out, args.timeout, smoke=args.smoke)
      print("profile", path, json.dumps({k: v for k, v in result["profile"][path].items() if k != "top_ops"}), flush=True)
      result["profile_difference"] = profile_difference(result["profile"])
      save()
  print(json.dumps(result["ratios"]))
  if result.get("profile_difference"):
    print("profile difference " + json.dumps(result["profile_difference"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
