"""Grouped bar charts for the benchmarks' PNGs (matplotlib, Agg; a no-op where it is missing)."""

from __future__ import annotations


def grouped_bars(path: str, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str,
                 figsize=(9, 4), rotate: int = 0, legend_size: int = 7, headroom: float = 1.0) -> bool:
  """One bar per (group, series) value, series side by side within each group; False without matplotlib.
  headroom > 1 raises the y axis above the tallest bar (room for the legend)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=figsize)
  width = 0.8 / max(len(series), 1)
  for i, (name, values) in enumerate(series.items()):
    ax.bar([j + i * width for j in range(len(groups))], values, width, label=name)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=rotate,
                fontsize=7 if rotate else None)
  ax.set_ylabel(ylabel)
  if headroom > 1:
    ax.set_ylim(0, headroom * max((v for values in series.values() for v in values), default=1.0))
  ax.set_title(title)
  ax.legend(fontsize=legend_size, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


# --- the docs' plots, drawn from the canonical results (python bench/plots.py --docs) ----------------------

LAYER_SHAPES = {"dsv3": "DeepSeek-V3\n7168/2048/32/8", "dsv3_ep8": "EP-8 slice\n7168/2048/8/2",
                "qwen3_30b_a3b": "Qwen3-30B-A3B-like\n2048/768/128/8", "gpt_oss_like": "gpt-oss-like\n2880/2880/128/4",
                "small_dsv3": "small DSv3\n1024/512/32/8"}
LAYER_PATHS = {"temoe_fp8": "temoe FP8 current", "temoe_fp8_blockwise": "temoe FP8 blockwise",
               "temoe_bf16": "temoe bf16", "tokamax_bf16": "tokamax bf16 (stock MaxText)",
               "fp8_dense_ceiling": "dense FP8 GEMM ceiling"}


def docs_plots(results: str, out: str) -> list[str]:
  """The layer sweep, the proxy's marginal layer, the small model and the plan against published runs: PNGs in `out`."""
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel

  def read(name):
    with open(os.path.join(results, name)) as f:
      return json.load(f)

  os.makedirs(out, exist_ok=True)
  written = []
  shapes = read("moe_layer.json")["shapes"]
  names = [s for s in LAYER_SHAPES if s in shapes]
  series = {label: [shapes[s].get(f"{p}_fwdbwd_tflops", shapes[s].get(f"{p}_tflops", 0.0)) for s in names]
            for p, label in LAYER_PATHS.items()}
  path = os.path.join(out, "layer_sweep.png")
  if grouped_bars(path, [LAYER_SHAPES[s] for s in names], series, "useful TFLOP/s (fwd+bwd)",
                  "One MoE layer on one H200 (hidden / ffn / experts / top-k): bench/results/moe_layer.json",
                  figsize=(10, 4.5), headroom=1.15):
    written.append(path)
  repeats, unrolled = read("proxy_1gpu.repeats.json")["marginal"], read("proxy_1gpu.unrolled.json")["marginal"]
  series = {"temoe (shipped config)": [repeats["temoe_fp8"]["ms"], unrolled["temoe_fp8_unrolled"]["ms"]],
            "stock MaxText (tokamax)": [repeats["stock_best"]["ms"], unrolled["stock_best_unrolled"]["ms"]]}
  path = os.path.join(out, "proxy_marginal_layer.png")
  if grouped_bars(path, ["layers scanned (median of rounds)", "layers unrolled"], series,
                  "ms per MoE decoder layer (lower is better)",
                  "1-GPU DeepSeek-V3 proxy, H200: the marginal MoE decoder layer", figsize=(7, 4), legend_size=9,
                  headroom=1.25):
    written.append(path)
  small = read("small_model.scan_layers.json")
  forms = {"layers scanned": small["scan_layers_true"], "layers unrolled (shipped)": small["scan_layers_false"]}
  names = {"temoe_bf16": "temoe bf16", "temoe_fp8": "temoe FP8 current", "tokamax": "tokamax bf16 (stock MaxText)"}
  series = {label: [f["paths"][p]["tokens_per_s"] / 1e3 for f in forms.values()] for p, label in names.items()}
  path = os.path.join(out, "small_model.png")
  if grouped_bars(path, list(forms), series, "thousand tokens/s",
                  "The small DeepSeek-V3-shaped model on one H200, batch 32",
                  figsize=(7, 4), legend_size=9, headroom=1.25):
    written.append(path)
  rows = [r for r in read("step_model_check.json")["rows"] if r["kind"] == "published" and r["unit"] == "TFLOP/s/GPU"]
  series = {"temoe plan (predicted)": [r["predicted"] for r in rows], "published": [r["reference"] for r in rows]}
  path = os.path.join(out, "plan_vs_published.png")
  labels = [r["name"].split(" (")[0].replace(", ", "\n").replace("Megatron-", "Megatron-\n").replace(" paper", "")
            for r in rows]
  if grouped_bars(path, labels, series, "TFLOP/s per GPU",
                  "DeepSeek-V3 671B: temoe plan against published runs (bench/results/step_model_check.json)",
                  figsize=(11, 5), legend_size=9, headroom=1.15):
    written.append(path)
  return written


if __name__ == "__main__":
  import argparse  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel

  here = os.path.dirname(os.path.abspath(__file__))
  parser = argparse.ArgumentParser(description="the docs' plots from bench/results")
  parser.add_argument("--docs", action="store_true", help="draw the docs' plots")
  parser.add_argument("--results", default=os.path.join(here, "results"))
  parser.add_argument("--out", default=os.path.join(here, "..", "docs", "assets"))
  args = parser.parse_args()
  if args.docs:
    print("\n".join(docs_plots(args.results, args.out)))
