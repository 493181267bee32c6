"""Benchmark: MaxText training of the 1-GPU DeepSeek-V3 proxy, one path per fresh process, and the
marginal MoE decoder layer as its headline.

`temoe_fp8` is the shipped config, `configs/deepseek3-proxy-1gpu.yml`, as a user runs it (FP8 expert
GEMMs on temoe's sync-free Hopper kernels, MaxText's TE FP8 for the dense GEMMs). `stock_best` is the
fastest stock MaxText we know on the same GPU: the same model and settings (cuDNN attention, MaxText's
TE FP8 for the dense GEMMs, the same remat) with MaxText's own tokamax grouped GEMM instead of temoe's
block. The other paths take one setting away or swap one part, so each setting's gain is measured in
the same call: `temoe_bf16_moe` (bf16 expert GEMMs on temoe's kernels), `temoe_fp8_blockwise` (FP8 with
DeepSeek-V3's block scales), `temoe_fp8_te` (FP8 expert
GEMMs on TE's grouped GEMM), `temoe_fp8_env` / `stock_best_env` (+ `temoe env`'s container profile),
`temoe_fp8_graphs` (XLA's command-buffer list, i.e. CUDA graphs, set explicitly without CONDITIONAL;
every path runs with XLA's default list, which includes custom calls), `temoe_fp8_remat_full`,
`temoe_fp8_bf16_dense`, `temoe_fp8_autoattn`, `*_scan0` (`param_scan_axis=0`: the scanned weights stored layers
first, so the scan reads each layer's slice in place; with MaxText's default 1 the step copies the expert
weights into that order), `*_unrolled` (scan_layers=false: each layer its own parameters, no layer scan),
`*_unrolled_noremat` (also remat_policy=none, which an unscanned layer takes as no checkpoint at all: nothing
recomputed), the remat variants that keep more of a layer for the backward (`*_save_moe`: minimal_with_context plus the MoE GEMM outputs MaxText names moe_mlpwi_0/1 and
moe_mlpwo, which minimal_with_context recomputes in part: it names the gate half mlpwi_0 but not the
up half; the shipped config's policy since it measured faster, so `temoe_fp8_save_moe` / `stock_best_save_moe`
now run the shipped config and stock_best; `*_save_all`: every tensor MaxText names; remat_policy=none is no variant here: MaxText
wraps each scanned layer in jax.checkpoint with the policy it names, and none names no policy, i.e.
saves nothing, as full does), the memory plan's checks (`temoe_fp8_batch4`: twice the batch;
`*_experts64`: twice the experts), and the stock paths as committed before (`tokamax_gmm`, `native_ragged`, `capacity_1.25`: autoselected attention, remat full).

Each path runs at every depth of --layers: `path` is the proxy's own 3 layers (1 dense + 2 MoE),
`path@5` the same with base_num_decoder_layers=5 (1 dense + 4 MoE). Only MoE layers are added, so for
a path measured at two depths a < b, (t_b - t_a) / (b - a) is the time of one MoE decoder layer
(forward, backward, its optimizer share) and t_a minus a - 1 such layers the fixed part (embedding,
logits, the dense layer). The headline `marginal_moe_layer` is that per-layer time for `temoe_fp8` and
`stock_best`, and their ratio. Each run reports median tokens/s, MaxText's TFLOP/s/device and step time
over the steps after warm-up, peak HBM and its wall time; ratios are against `stock_best` at the same
depth. One run per depth resolves a layer to about +-3 ms on the H200, so `--repeats R` runs every run R
times, in R rounds of the whole list (drift in the machine then hits every path alike); each run's
timings are then their medians over its rounds, with every round's step time beside them, the headline
comes from those medians, and `marginal_moe_layer` also lists each round's own ratio. Writes proxy_1gpu.json (with
the exact command) and a PNG. `--smoke` runs the same code on this CPU at a tiny size (no timing meaning).

    python bench/proxy_1gpu.py [--paths temoe_fp8,stock_best] [--layers 3,5] [--steps 12] [--repeats 1] [--out bench/results]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common_smoke  # noqa: E402  # pylint: disable=wrong-import-position
import training_runs  # noqa: E402  # pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = str(ROOT / "configs" / "deepseek3-proxy-1gpu.yml")
COMMON = ["dataset_type=synthetic", "enable_checkpointing=false", "enable_tensorboard=false"]
BASE_LAYERS = 3
"""Every path's own depth (1 dense + 2 MoE layers); `path@N` runs it with N."""

PROXY = [  # the stock paths as committed before: MaxText's 671B shapes cut to the proxy
    "model_name=deepseek3-671b", "override_model_config=true", "base_num_decoder_layers=3",
    "first_num_dense_layers=1", "num_experts=32", "max_target_length=2048", "per_device_batch_size=2",
    "weight_dtype=bfloat16", "dtype=bfloat16", "remat_policy=full", "hardware=gpu",
    "skip_jax_distributed_system=true",
]
STOCK_MOE = training_runs.STOCK_MOE

GRAPHS = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"}

MINIMAL_WITH_CONTEXT = ("query_proj", "value_proj", "key_proj", "kv_proj", "qkv_proj", "out_proj", "mlpwi_0", "mlpwi_1",
                        "mlpwi", "mlpwo", "context")
"""The names MaxText 0.2.5's remat_policy=minimal_with_context saves (its decoder's minimal_policy)."""
MOE_OUTPUTS = ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
"""The routed experts' gate, up and down GEMM outputs (MaxText's names; temoe's block gives the same)."""
OTHER_NAMES = ("query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "attention_out", "moe_x_sorted", "moe_routing_maps")
"""MaxText's other remat names of a DeepSeek layer: MLA's low-rank projections, attention's output,
MaxText's own sorted MoE input and routing maps (temoe's block names neither)."""


def saved_on_device(*names: str) -> list[str]:
  """remat_policy=custom keeping exactly `names` (and each layer's input) on the device."""
  return ["remat_policy=custom", *(f"{n}=device" for n in names)]


SAVE_MOE = saved_on_device(*MINIMAL_WITH_CONTEXT, *MOE_OUTPUTS)
SAVE_QUANTIZED = "remat_policy=minimal_with_context_and_quantization"
"""minimal_with_context plus MaxText's `quantization` name: its dense FP8 layers' quantized operands and
temoe's expert GEMMs' FP8 copies are kept for the backward instead of quantized again."""
SAVE_ALL = saved_on_device(*MINIMAL_WITH_CONTEXT, *MOE_OUTPUTS, *OTHER_NAMES)

PATHS = {  # name -> (config, overrides, environment: False, True (the container env profile) or a dict)
    "temoe_fp8": (SHIPPED, [], False),
    "stock_best": (SHIPPED, STOCK_MOE, False),
    "temoe_bf16_moe": (SHIPPED, ["te_gmm_quantization=te_no_quant"], False),
    "temoe_fp8_blockwise": (SHIPPED, ["te_gmm_quantization=te_fp8_blockwise"], False),
    "temoe_fp8_te": (SHIPPED, ["te_moe_backend=te"], False),
    "temoe_fp8_env": (SHIPPED, [], True),
    "temoe_fp8_graphs": (SHIPPED, [], GRAPHS),
    "temoe_fp8_unfused": (SHIPPED, [], {"TEMOE_TOKENS_MLP": "none"}),  # x and dy through bf16 buffers
    "stock_best_env": (SHIPPED, STOCK_MOE, True),
    "temoe_fp8_remat_full": (SHIPPED, ["remat_policy=full"], False),
    "temoe_fp8_bf16_dense": (SHIPPED, ["quantization=''"], False),
    "temoe_fp8_autoattn": (SHIPPED, ["attention=autoselected"], False),
    "temoe_fp8_save_moe": (SHIPPED, SAVE_MOE, False),
    "temoe_fp8_save_quant": (SHIPPED, [SAVE_QUANTIZED], False),  # FP8 copies kept, not quantized again
    "stock_best_save_quant": (SHIPPED, [*STOCK_MOE, SAVE_QUANTIZED], False),
    "stock_best_save_moe": (SHIPPED, [*STOCK_MOE, *SAVE_MOE], False),
    "temoe_fp8_save_all": (SHIPPED, SAVE_ALL, False),
    "stock_best_save_all": (SHIPPED, [*STOCK_MOE, *SAVE_ALL], False),
    "temoe_fp8_keep_fp8w": (SHIPPED, ["te_moe_fp8_weights=device"], False),  # weights not quantized again
    "temoe_fp8_blockwise_keep_fp8w": (SHIPPED, ["te_gmm_quantization=te_fp8_blockwise", "te_moe_fp8_weights=device"],
                                      False),
    "temoe_fp8_unrolled": (SHIPPED, ["scan_layers=false"], False),  # layers unrolled: no layer scan (a while loop)
    "stock_best_unrolled": (SHIPPED, [*STOCK_MOE, "scan_layers=false"], False),
    # unrolled with remat_policy=none: MaxText wraps an unscanned layer in no checkpoint, so nothing is recomputed
    "temoe_fp8_unrolled_noremat": (SHIPPED, ["scan_layers=false", "remat_policy=none"], False),
    "stock_best_unrolled_noremat": (SHIPPED, [*STOCK_MOE, "scan_layers=false", "remat_policy=none"], False),
    "temoe_fp8_scan0": (SHIPPED, ["param_scan_axis=0"], False),  # layers first: no transposed copy per step
    "stock_best_scan0": (SHIPPED, [*STOCK_MOE, "param_scan_axis=0"], False),
    "temoe_fp8_batch4": (SHIPPED, ["per_device_batch_size=4"], False),  # memory-plan checks: twice the tokens,
    "temoe_fp8_experts64": (SHIPPED, ["override_model_config=true", "num_experts=64"], False),  # twice the experts
    "stock_best_experts64": (SHIPPED, [*STOCK_MOE, "override_model_config=true", "num_experts=64"], False),
    "temoe_bf16": (SHIPPED, ["te_gmm_quantization=te_no_quant", "quantization=''"], False),
    "tokamax_gmm": ("base.yml", [*PROXY, "sparse_matmul=true", "megablox=false", "use_tokamax_gmm=true"], False),
    "native_ragged": ("base.yml", [*PROXY, "sparse_matmul=true", "megablox=false"], False),
    "capacity_1.25": ("base.yml", [*PROXY, "sparse_matmul=false", "capacity_factor=1.25"], False),
}

SMOKE = [  # --smoke: the same paths on this CPU, every model width cut to a few dozen (no GPU kernels)
    "override_model_config=true", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128",
    "base_moe_mlp_dim=32", "q_lora_rank=32", "kv_lora_rank=16", "qk_nope_head_dim=16", "qk_rope_head_dim=8",
    "v_head_dim=16", "vocab_size=256", "num_experts=8", "max_target_length=32", "per_device_batch_size=2",
    "hardware=cpu", "attention=dot_product", "quantization=''", "te_gmm_quantization=te_no_quant",
    "use_tokamax_gmm=false",  # tokamax has no CPU kernel: MaxText's own ragged_dot stands in
]


def split_name(run: str) -> tuple[str, int]:
  """'path@5' -> ('path', 5); 'path' -> ('path', BASE_LAYERS). Refuses unknown paths, naming the choices."""
  path, _, layers = run.partition("@")
  if path not in PATHS:
    raise SystemExit(f"unknown proxy path {path!r}; valid choices: {', '.join(PATHS)}")
  if layers and not (layers.isdigit() and int(layers) >= 2):
    raise SystemExit(f"{run!r}: the depth after @ must be a whole number of layers >= 2 (1 dense + MoE)")
  return path, int(layers) if layers else BASE_LAYERS


def run_name(path: str, layers: int) -> str:
  return path if layers == BASE_LAYERS else f"{path}@{layers}"


SHIPPED_BEFORE = {  # result file -> the shipped config's settings then that it has no longer
    **dict.fromkeys(
        ("proxy_1gpu.scan1.json", "proxy_1gpu.paths.json", "proxy_1gpu.save_moe.json", "proxy_1gpu.variants.json",
         "proxy_1gpu.recipes.json", "proxy_1gpu.tagging.json", "proxy_1gpu.blockwise.json",
         "proxy_1gpu.run2-allpaths.json", "plan_check.measured.json"),
        ("remat_policy=minimal_with_context", "param_scan_axis=1")),
    **dict.fromkeys(("proxy_1gpu.scan0.json", "proxy_1gpu.scan0-shipped.json"), ("remat_policy=minimal_with_context",)),
}
"""Result files measured before the shipped config took param_scan_axis=0 (MaxText's default 1 then) and
the custom remat policy (minimal_with_context then): the checks plan and predict their runs with the config
they ran (`as_measured`); a path's own overrides still come after these."""


def as_measured(result_file: str | None) -> list[str]:
  """Overrides that give the shipped config as it was when `result_file` (a bench/results name) was measured."""
  return list(SHIPPED_BEFORE.get(os.path.basename(result_file), ())) if result_file else []


SWITCHES_BEFORE = dict.fromkeys(
    ("proxy_1gpu.blockwise.json", "proxy_1gpu.fp8_scales.json", "proxy_1gpu.fp8_weights.json", "proxy_1gpu.paths.json",
     "proxy_1gpu.recipes.json", "proxy_1gpu.run2-allpaths.json", "proxy_1gpu.save_moe.json",
     "proxy_1gpu.save_moe_scan0.json", "proxy_1gpu.scan0-shipped.json", "proxy_1gpu.scan0.json", "proxy_1gpu.scan1.json",
     "proxy_1gpu.tagging.json", "proxy_1gpu.tokens.json", "proxy_1gpu.triton_amax.json", "proxy_1gpu.variants.json",
     "plan_check.measured.json"),
    {"TEMOE_TOKENS_MLP": "blockwise"})
"""Result files measured while current scaling's layers went through the bf16 buffer (an unset
TEMOE_TOKENS_MLP meant blockwise only then): their runs are planned with the switches they ran."""


@contextlib.contextmanager
def switches_as_measured(run: str, result_file: str | None = None):
  """temoe's import-time switches (mosaic_tokens.SCALINGS) set, in this process, as `run` had them when
  `result_file` was measured (SWITCHES_BEFORE, then the path's own environment), for planning it here."""
  from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel

  extra = PATHS[split_name(run)[0]][2]
  switches = {**SWITCHES_BEFORE.get(os.path.basename(result_file or ""), {}), **(extra if isinstance(extra, dict) else {})}
  before = mosaic_tokens.SCALINGS
  if mosaic_tokens.ENV in switches:
    mosaic_tokens.SCALINGS = mosaic_tokens.scalings_of(switches[mosaic_tokens.ENV])
  try:
    yield
  finally:
    mosaic_tokens.SCALINGS = before


def args_of(run: str, smoke: bool = False, measured_in: str | None = None) -> list[str]:
  """MaxText's arguments for `run` ('path' or 'path@layers'): its config file, then key=value overrides;
  `measured_in`: a result file's name, for the config as that file's runs had it (`as_measured`)."""
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  path, layers = split_name(run)
  config, overrides, _ = PATHS[path]
  depth = [] if layers == BASE_LAYERS else ["override_model_config=true", f"base_num_decoder_layers={layers}"]
  config = config if os.path.isabs(config) else os.path.join(introspect.configs_dir(), config)
  return [config, *COMMON, *as_measured(measured_in), *overrides, *depth, *(SMOKE if smoke else [])]


APPENDED = ("XLA_FLAGS",)
"""Variables a path's extra environment adds to (flag lists); it sets any other, such as TEMOE_TOKENS_MLP."""
PATH_OWNED = ("TEMOE_TOKENS_MLP",)
"""temoe's switches that only a path's own environment sets: not inherited from the calling shell."""


def environment(path: str) -> dict:
  """The process environment `path` runs in: this one (less PATH_OWNED), plus the container profile or
  its extra variables."""
  env = {k: v for k, v in os.environ.items() if k not in PATH_OWNED}
  extra = PATHS[path][2]
  if extra is True:
    from temoe.deploy import env as profile  # pylint: disable=import-outside-toplevel

    env.update(profile.environment("hopper", env))
  elif extra:
    env.update({k: f"{env.get(k, '')} {v}".strip() if k in APPENDED else v for k, v in extra.items()})
  return env


def measure(run: str, steps: int, workdir: str, timeout: int, smoke: bool = False) -> dict:
  """`run`'s row: a fresh process (training_runs), or with --smoke a run forked from this one (bench_common_smoke)."""
  how = bench_common_smoke.measure if smoke else training_runs.measure
  return how(run, args_of(run, smoke), steps, workdir, timeout, environment(split_name(run)[0]))


def ratios(paths: dict) -> dict:
  """Every run's tokens/s and peak HBM over `stock_best`'s at the same depth (and over `tokamax_gmm`'s)."""
  out = {}
  for name, row in paths.items():
    path, layers = split_name(name)
    for base in ("stock_best", "tokamax_gmm"):
      ref = paths.get(run_name(base, layers), {})
      if path == base:
        continue
      if row.get("tokens_per_s") and ref.get("tokens_per_s"):
        out[f"{name}_over_{base}_tokens"] = row["tokens_per_s"] / ref["tokens_per_s"]
      if row.get("peak_hbm_gib") and ref.get("peak_hbm_gib"):
        out[f"{name}_over_{base}_peak_hbm"] = row["peak_hbm_gib"] / ref["peak_hbm_gib"]
  return out


def marginal(paths: dict) -> dict:
  """Per path measured at two or more depths: ms per MoE decoder layer between its shallowest and
  deepest runs, the fixed part, the deepest run's peak HBM, and stock_best's per-layer time over it."""
  depths: dict[str, dict[int, dict]] = {}
  for name, row in paths.items():
    if row.get("step_time_s"):
      path, layers = split_name(name)
      depths.setdefault(path, {})[layers] = row
  out = {}
  for path, rows in depths.items():
    if len(rows) < 2:
      continue
    a, b = min(rows), max(rows)
    per_layer = 1e3 * (rows[b]["step_time_s"] - rows[a]["step_time_s"]) / (b - a)
    out[path] = {"ms": per_layer, "fixed_ms": 1e3 * rows[a]["step_time_s"] - (a - 1) * per_layer, "layers": [a, b],
                 "peak_hbm_gib_deepest": rows[b].get("peak_hbm_gib")}
  stock = out.get("stock_best", {}).get("ms")
  for row in out.values():
    if stock and row["ms"] > 0:
      row["stock_best_over_this"] = stock / row["ms"]
  return out


def headline(per_path: dict) -> dict | None:
  """`marginal_moe_layer`: the shipped config's and stock_best's ms per MoE decoder layer, stock / temoe."""
  temoe, stock = per_path.get("temoe_fp8"), per_path.get("stock_best")
  if not (temoe and stock):
    return None
  return {"temoe_ms": temoe["ms"], "stock_best_ms": stock["ms"], "ratio": stock["ms"] / temoe["ms"],
          "temoe_fixed_ms": temoe["fixed_ms"], "stock_best_fixed_ms": stock["fixed_ms"], "layers": temoe["layers"]}


def median_row(rounds: list[dict]) -> dict:
  """One run's row over its rounds: the median of each timing over the rounds that ran (for an even
  count the mean of the middle two, as `statistics.median`), every round's step time beside it in
  `step_time_s_rounds`, and the other fields from the median round; the last error if none ran."""
  ran = sorted((r for r in rounds if r.get("step_time_s")), key=lambda r: r["step_time_s"])
  if not ran:
    return rounds[-1]
  row = dict(ran[(len(ran) - 1) // 2])
  if len(rounds) > 1:
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device"):
      if all(r.get(key) for r in ran):
        row[key] = statistics.median(r[key] for r in ran)
    row["step_time_s_rounds"] = [r.get("step_time_s") for r in rounds]
  return row


def per_round_ratios(rounds: list[dict]) -> list[float | None]:
  """Each round's own `marginal_moe_layer` ratio (None where a run of that round failed)."""
  out = []
  for paths in rounds:
    head = headline(marginal(paths))
    out.append(head["ratio"] if head else None)
  return out


def plot(result: dict, png: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  names = [k for k, v in result["paths"].items() if "tokens_per_s" in v]
  per_layer = result.get("marginal", {})
  fig, axes = plt.subplots(1, 2 if per_layer else 1, figsize=(11 if per_layer else 7, 3.5), squeeze=False)
  ax = axes[0][0]
  ax.bar(names, [result["paths"][k]["tokens_per_s"] for k in names], color="#76b900")
  ax.set_ylabel("tokens/s/device")
  ax.set_title("DeepSeek-V3 proxy (32 experts), 1 GPU; @N: N layers")
  ax.tick_params(axis="x", labelsize=7, rotation=30)
  if per_layer:
    ax = axes[0][1]
    ax.bar(list(per_layer), [v["ms"] for v in per_layer.values()], color="#5e8fd1")
    ax.set_ylabel("ms per MoE decoder layer")
    ax.set_title("marginal MoE decoder layer")
    ax.tick_params(axis="x", labelsize=7, rotation=30)
  fig.tight_layout()
  fig.savefig(png, dpi=120)


def runs_of(paths: str, layers: str) -> list[str]:
  """The runs asked for, depth by depth: each path at each depth of `layers` ('path@N': at N only)."""
  depths = layers.split(",")
  if not all(d.isdigit() and int(d) >= 2 for d in depths):
    raise SystemExit(f"--layers={layers}: give depths of at least 2 layers (1 dense + MoE), e.g. 3,5")
  runs = []
  for depth in map(int, depths):
    for entry in paths.split(","):
      path, _ = split_name(entry)
      name = entry if "@" in entry else run_name(path, depth)
      if name not in runs:
        runs.append(name)
  return runs


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--paths", default="temoe_fp8,stock_best", help=f"comma list of: {', '.join(PATHS)} (path@N: N layers only)")
  parser.add_argument("--layers", default="3,5", help="depths every path runs at (1 dense + the rest MoE)")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--timeout", type=int, default=150, help="seconds per run")
  parser.add_argument("--repeats", type=int, default=1, help="rounds of the whole run list; each run keeps its median timings")
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--smoke", action="store_true", help="tiny widths on this CPU: exercises the code, times nothing")
  args = parser.parse_args()
  if args.repeats < 1:
    raise SystemExit(f"--repeats={args.repeats}: give at least 1 round")
  runs = runs_of(args.paths, args.layers)
  workdir = tempfile.mkdtemp(prefix="proxy-")
  atexit.register(shutil.rmtree, workdir, ignore_errors=True)  # the runs' outputs: results are copied out
  result = {"command": " ".join(["python", "bench/proxy_1gpu.py", *sys.argv[1:]]), "shipped_config": "configs/deepseek3-proxy-1gpu.yml",
            "stock_moe_flags": STOCK_MOE, "proxy_flags": PROXY, "smoke": args.smoke, "paths": {}}
  os.makedirs(args.out, exist_ok=True)
  rounds: list[dict] = []
  for r in range(args.repeats):
    rounds.append({})
    os.makedirs(os.path.join(workdir, f"round{r}"), exist_ok=True)
    for run in runs:
      rounds[r][run] = measure(run, args.steps, os.path.join(workdir, f"round{r}"), args.timeout, args.smoke)
      print(*([f"round {r}"] if args.repeats > 1 else []), run, json.dumps(rounds[r][run]), flush=True)
      result["paths"] = {name: median_row([rnd[name] for rnd in rounds if name in rnd]) for name in runs if name in rounds[0]}
      result["ratios"] = ratios(result["paths"])
      result["marginal"] = marginal(result["paths"])
      if headline(result["marginal"]):
        result["marginal_moe_layer"] = headline(result["marginal"])
        if args.repeats > 1:
          result["marginal_moe_layer"]["round_ratios"] = per_round_ratios(rounds)
      with open(os.path.join(args.out, "proxy_1gpu.json"), "w", encoding="utf-8") as f:  # after every run
        json.dump(result, f, indent=1)
  try:
    plot(result, os.path.join(args.out, "proxy_1gpu.png"))
  except ImportError as exc:
    print("no plot:", exc)
  print(json.dumps(result["ratios"]))
  for path, row in result["marginal"].items():
    print(f"marginal MoE decoder layer {path}: {row['ms']:.2f} ms (fixed {row['fixed_ms']:.1f} ms, "
          f"layers {row['layers']}, peak {row['peak_hbm_gib_deepest']} GiB at the deepest)")
  if "marginal_moe_layer" in result:
    print("marginal_moe_layer " + json.dumps(result["marginal_moe_layer"]))


if __name__ == "__main__":
  main()
