"""`temoe report <run_dir>`: one self-contained report.html (PNGs embedded) plus the PNGs, a
summary.json and TensorBoard scalars for a run: loss, tokens/s, TFLOP/s/device and MFU per step, an
expert-load heatmap (layer x expert) and, where `temoe profile` left a profile.json, the step-time
breakdown.

Metrics come from MaxText's metrics file (`metrics_file=<run_dir>/metrics.jsonl`, what `make train`
and `temoe profile` write) or else from the run's TensorBoard event files. temoe's model FLOPs and
the GPU peak come from the run's profile.json, or from `--config <yml> [key=value ...]` (+ `--gpu`).
"""

from __future__ import annotations

import base64
import collections
import glob
import html
import json
import os
import re
import statistics
import struct
import sys

from temoe import oneline
from temoe.tools import flops

from temoe.tools import profiling

LOAD = re.compile(r"^temoe/expert_load/moe_layer_(\d+)/expert_(\d+)$")
STEADY_FROM = 2
"""Steps before this one are left out of medians: they include compilation (as temoe.tools.summary does)."""


def tensorboard_rows(run_dir: str) -> list[dict]:
  """Scalars per step from TensorBoard event files (TFRecord framing, tensorboardX's protobufs)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel

  steps = collections.defaultdict(dict)
  for path in glob.glob(os.path.join(run_dir, "**", "events.out.tfevents*"), recursive=True):
    with open(path, "rb") as f:
      while header := f.read(12):  # uint64 length, uint32 length crc; data; uint32 data crc
        try:
          length = struct.unpack("<Q", header[:8])[0] if len(header) == 12 else -1
          if not 0 <= length <= os.path.getsize(path) - f.tell():
            raise ValueError(f"no event record at byte {f.tell() - len(header)}")
          data = f.read(length)
          f.read(4)
          event = event_pb2.Event.FromString(data)
        except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
          raise ValueError(f"temoe report: {path} is not a readable TensorBoard event file ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); move it out of the run "
                           "directory") from exc
        for value in event.summary.value:
          if value.HasField("simple_value"):
            steps[event.step][value.tag] = value.simple_value
  return [{**v, "step": float(k)} for k, v in sorted(steps.items()) if "learning/loss" in v]


def read_metrics(path: str) -> list[dict]:
  """MaxText's metrics JSONL, one row per step, in step order.

  A SIGKILL can leave the last line cut short, and a resumed run appends after it (on the same
  line when no newline was written) and repeats the steps after its checkpoint: a cut row is
  dropped, and a repeated step keeps the later run's row (the one on the resumed trajectory).
  """
  by_step, unnumbered = {}, []
  with open(path, encoding="utf-8", errors="replace") as f:
    for line in f:
      for row in _rows_in(line.strip()):
        if "step" in row:
          by_step[step_of(row, path)] = row
        else:
          unnumbered.append(row)
  return [by_step[step] for step in sorted(by_step)] + unnumbered


NUMBERS = ("learning/loss", "perf/per_device_tokens_per_sec", "perf/step_time_seconds",
           "perf/per_device_tflops_per_sec")
"""The per-step values report and summary compute with: MaxText writes each as a JSON number."""


def check_numbers(rows: list[dict], path: str) -> None:
  """Every NUMBERS value present in `rows` is a number; ValueError (one line) naming the step, key and value."""
  for row in rows:
    for key in ("step", *NUMBERS):
      value = row.get(key, 0.0)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        step = row.get("step", "?")
        step = int(step) if isinstance(step, float) and step.is_integer() else step
        raise ValueError(f"{path}: the row of step {step} holds {key}={value!r}, not a number (MaxText writes a "
                         "JSON number there); fix or remove that line, or pass MaxText's own metrics file")


def step_of(row: dict, path: str) -> int:
  """The row's step as an int; ValueError (one line) when it is not a whole number."""
  step = row["step"]
  if isinstance(step, bool) or not isinstance(step, (int, float)) or step != step or step in (float("inf"), -float("inf")):
    raise ValueError(f"{path}: a row holds step={step!r}, not a step number (MaxText writes one per row); fix or remove "
                     "that line, or pass MaxText's own metrics file")
  return int(step)


def _rows_in(line: str) -> list[dict]:
  """The JSON objects of one line: itself, or after a cut-short row, the complete row glued to it."""
  if not line:
    return []
  try:
    row = json.loads(line)
    return [row] if isinstance(row, dict) else []
  except ValueError:
    start = line.find('{"', 1)
    return _rows_in(line[start:]) if start > 0 else []


def load_rows(run_dir: str) -> tuple[list[dict], str]:
  """(rows, source): MaxText's metrics JSONL in the run directory, else its TensorBoard events."""
  for path in [os.path.join(run_dir, "metrics.jsonl"), *sorted(glob.glob(os.path.join(run_dir, "*.jsonl")))]:
    if os.path.exists(path):
      rows = read_metrics(path)
      if rows and "learning/loss" in rows[0]:
        check_numbers(rows, path)
        return rows, path
  rows = tensorboard_rows(run_dir)
  if not rows:
    raise FileNotFoundError(f"temoe report: no metrics .jsonl or TensorBoard events with learning/loss in {run_dir}")
  return rows, "tensorboard"


def expert_load(rows: list[dict]):
  """(layers x experts) mean load over the steady steps, each layer divided by its mean; or None."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  cells = [(int(m.group(1)), int(m.group(2)), k) for k in rows[0] if (m := LOAD.match(k))]
  if not cells:
    return None
  grid = np.zeros((max(c[0] for c in cells) + 1, max(c[1] for c in cells) + 1))
  steady = rows[STEADY_FROM:] or rows
  for layer, expert, key in cells:
    grid[layer, expert] = statistics.fmean(r[key] for r in steady)
  return grid / np.maximum(grid.mean(axis=1, keepdims=True), 1e-12)


def summarize(rows: list[dict], source: str, count: dict | None, breakdown: dict | None) -> dict:
  """The numbers the report shows: all from the run's own logs, plus temoe's FLOPs where known."""
  steady = rows[STEADY_FROM:] or rows[-1:]
  out = {
      "source": source,
      "steps": len(rows),
      "first_loss": rows[0]["learning/loss"],
      "final_loss": rows[-1]["learning/loss"],
      "median_tokens_per_s_per_device": statistics.median(r["perf/per_device_tokens_per_sec"] for r in steady),
      "median_step_time_s": statistics.median(r["perf/step_time_seconds"] for r in steady),
      "median_maxtext_tflops_per_s_per_device": statistics.median(r["perf/per_device_tflops_per_sec"] for r in steady),
      "steady_from_step": int(steady[0]["step"]),
  }
  if "temoe/load_max_over_mean" in rows[-1]:
    out["final_load_max_over_mean"] = rows[-1]["temoe/load_max_over_mean"]
    out["median_padding_fraction"] = statistics.median(r.get("temoe/padding_fraction", 0.0) for r in steady)
  if count:
    model = [count["model_tflops_per_step_per_device"] / r["perf/step_time_seconds"] for r in steady]
    out["median_model_tflops_per_s_per_device"] = statistics.median(model)
    peak = count["peak_tflops"]
    out["median_mfu"] = out["median_model_tflops_per_s_per_device"] / peak if peak else None
    out["flops"] = count
  if breakdown:
    out["breakdown_ms_per_step"] = breakdown["ms_per_step"]
  return out


def _figures(rows, summary, load, breakdown):
  """(name, draw(figure)) for each PNG this run has data for."""
  steps = [r["step"] for r in rows]
  count = summary.get("flops")

  def line(ax, key, label):
    ax.plot(steps, [r[key] for r in rows], marker=".", label=label)

  def loss(fig):
    ax = fig.subplots()
    line(ax, "learning/loss", "loss")
    ax.set(xlabel="step", ylabel="loss", title="loss")

  def throughput(fig):
    ax = fig.subplots()
    line(ax, "perf/per_device_tokens_per_sec", "tokens/s/device")
    ax.set(xlabel="step", ylabel="tokens/s/device", title="throughput")

  def tflops(fig):
    ax = fig.subplots()
    line(ax, "perf/per_device_tflops_per_sec", "MaxText's count")
    if count:
      ax.plot(steps, [count["model_tflops_per_step_per_device"] / r["perf/step_time_seconds"] for r in rows],
              marker=".", label="temoe model FLOPs")
      if count["peak_tflops"]:
        mfu = ax.twinx()
        per_step = count["model_tflops_per_step_per_device"] / count["peak_tflops"]
        mfu.plot(steps, [100 * per_step / r["perf/step_time_seconds"] for r in rows], color="grey", alpha=0.4)
        mfu.set_ylabel(f"MFU % ({count['gpu']}, peak {count['peak_tflops']:.0f} TFLOP/s)")
    ax.set(xlabel="step", ylabel="TFLOP/s/device", title="TFLOP/s per device and MFU")
    ax.legend()

  def expert_load_map(fig):
    ax = fig.subplots()
    image = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="tokens / layer's mean")
    ax.set_yticks(range(load.shape[0]))
    ax.set(xlabel="expert", ylabel="MoE layer", title=f"expert load, mean over steps >= {STEADY_FROM}")

  def step_breakdown(fig):
    ax = fig.subplots()
    cats = list(profiling.CATEGORIES)
    bars = ax.barh(cats, [breakdown["ms_per_step"][c] for c in cats], color="#76b900")
    ax.bar_label(bars, labels=[f"{100 * breakdown['share'][c]:.1f}%" for c in cats], padding=3)
    ax.invert_yaxis()
    ax.set(xlabel="ms per step", title=f"step time {breakdown['step_ms']:.1f} ms ({breakdown['devices']} device(s))")

  figures = [("loss", loss), ("throughput", throughput), ("tflops_mfu", tflops)]
  figures += [("expert_load", expert_load_map)] if load is not None else []
  figures += [("step_breakdown", step_breakdown)] if breakdown else []
  return figures


def write_tensorboard(out: str, rows: list[dict], count: dict | None) -> None:
  """temoe's model TFLOP/s and MFU per step as TensorBoard scalars beside the run's own."""
  if not count:
    return
  from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

  with SummaryWriter(os.path.join(out, "tensorboard")) as writer:
    for r in rows:
      achieved = count["model_tflops_per_step_per_device"] / r["perf/step_time_seconds"]
      writer.add_scalar("temoe/model_tflops_per_sec_per_device", achieved, int(r["step"]))
      if count["peak_tflops"]:
        writer.add_scalar("temoe/mfu", achieved / count["peak_tflops"], int(r["step"]))


def _html(summary: dict, images: dict[str, str], breakdown: dict | None, run_dir: str) -> str:
  numbers = {k: v for k, v in summary.items() if isinstance(v, float)}
  rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in numbers.items())
  parts = [f"<h1>temoe report: {html.escape(run_dir)}</h1>", f"<table>{rows}</table>"]
  if summary.get("flops"):
    count = {k: v for k, v in summary["flops"].items() if not isinstance(v, dict)}
    text = {k: f"{v:.6g}" if isinstance(v, float) else str(v) for k, v in count.items()}
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in text.items())
    parts.append(f"<h2>model FLOPs (temoe.tools.flops) and peak</h2><table>{cells}</table>")
  if breakdown:
    cells = "".join(
        f"<tr><td>{c}</td><td>{breakdown['ms_per_step'][c]:.3f}</td><td>{100 * breakdown['share'][c]:.1f}%</td></tr>"
        for c in profiling.CATEGORIES
    )
    parts.append(f"<h2>step time</h2><table><tr><th>category</th><th>ms/step</th><th>share</th></tr>{cells}</table>")
  parts += [f'<h2>{name}</h2><img src="data:image/png;base64,{data}"/>' for name, data in images.items()]
  style = "body{font-family:sans-serif} td,th{padding:2px 10px;text-align:right} td:first-child{text-align:left}"
  head = f"<head><meta charset='utf-8'><title>temoe report</title><style>{style}</style></head>"
  return f"<!doctype html><html>{head}<body>{''.join(parts)}</body></html>"


PROFILE_KEYS = ("step_ms", "ms_per_step", "share", "devices")
"""What a profile.json from `temoe profile` holds at least (temoe.tools.profiling.breakdown)."""


def read_profile(path: str) -> dict | None:
  """The run's profile.json (`temoe profile`'s step breakdown), None if there is none; ValueError (one
  line) if it is not one."""
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      breakdown = json.load(f)
  except (OSError, UnicodeDecodeError, ValueError) as exc:
    raise ValueError(f"temoe report: {path} is not a profile.json of `temoe profile` ({type(exc).__name__}: "
                     f"{str(exc)[:200]}); move it out of the run directory") from exc
  missing = [key for key in PROFILE_KEYS if not isinstance(breakdown, dict) or key not in breakdown]
  if missing:
    raise ValueError(f"temoe report: {path} is not a profile.json of `temoe profile` (no {', '.join(missing)}); "
                     "move it out of the run directory")
  return breakdown


def report(run_dir: str, out: str, count: dict | None = None, gpu: str | None = None) -> dict:
  """Writes summary.json, the PNGs, report.html and TensorBoard scalars to `out`; returns the summary."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  rows, source = load_rows(run_dir)
  breakdown = read_profile(os.path.join(run_dir, "profile.json"))
  count = count or (breakdown or {}).get("flops")
  if count and gpu:  # the effective peak depends only on the share of FLOPs run in FP8
    peak = flops.effective_peak(1.0, count["fp8_fraction"], flops.PEAK_TFLOPS[gpu.upper()])
    count = {**count, "gpu": gpu.upper(), "peak_tflops": peak}
    if "model_tflops_per_s_per_device" in count:
      count["mfu"] = count["model_tflops_per_s_per_device"] / peak
  summary = summarize(rows, source, count, breakdown)
  os.makedirs(out, exist_ok=True)
  images = {}
  for name, draw in profiling.progress(_figures(rows, summary, expert_load(rows), breakdown), "temoe report"):
    fig = plt.figure(figsize=(8, 4.5))
    draw(fig)
    fig.tight_layout()
    path = os.path.join(out, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    images[name] = base64.b64encode(open(path, "rb").read()).decode()
  write_tensorboard(out, rows, count)
  with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  with open(os.path.join(out, "report.html"), "w", encoding="utf-8") as f:
    f.write(_html(summary, images, breakdown, run_dir))
  return summary


def main(argv: list[str] | None = None) -> int:
  parser = oneline.ArgumentParser(prog="temoe report", description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("run_dir")
  parser.add_argument("--out", help="output directory (default <run_dir>/report)")
  parser.add_argument("--config", nargs="+", metavar="ARG", help="the run's config.yml and key=value overrides")
  parser.add_argument("--gpu", choices=sorted(k.lower() for k in flops.PEAK_TFLOPS), help="GPU peak for MFU")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if not os.path.isdir(args.run_dir):
    print(f"temoe report: {args.run_dir} is not a run directory"
          f"{' (it is a file; pass the directory holding it)' if os.path.isfile(args.run_dir) else ''}", file=sys.stderr)
    return 2
  count = None
  if args.config:
    import temoe  # pylint: disable=import-outside-toplevel
    from temoe import cli  # pylint: disable=import-outside-toplevel
    from temoe.run import inputs  # pylint: disable=import-outside-toplevel

    try:
      inputs.check_config_file(args.config[0])
      inputs.check_settings(args.config[1:], "temoe report <run_dir> --config <config.yml> [key=value ...]")
      temoe.register()
      config, message = cli.config_or_message(["report", *args.config])
    except inputs.InputError as exc:
      config, message = None, str(exc)
    if message:
      print(f"temoe report: --config: {message}", file=sys.stderr)
      return 2
    count = flops.summary(config, gpu=args.gpu)
  out = args.out or os.path.join(args.run_dir, "report")
  if os.path.exists(out) and not os.path.isdir(out):
    print(f"temoe report: the output path {out} is a file, not a directory; pass --out with a directory (made if "
          "missing), or move the file away", file=sys.stderr)
    return 2
  try:
    summary = report(args.run_dir, out, count, args.gpu)
  except (FileNotFoundError, ValueError) as exc:
    print(str(exc) if str(exc).startswith("temoe report") else f"temoe report: {exc}", file=sys.stderr)
    return 2
  except OSError as exc:  # the output directory: read-only, full, not a directory on the way
    print(f"temoe report: the report cannot be written to {out} ({exc.strerror or exc}"
          f"{': ' + str(exc.filename) if exc.filename else ''}); pass --out with a directory this process can write",
          file=sys.stderr)
    return 2
  print(f"temoe report: {summary['steps']} steps from {summary['source']}; loss {summary['first_loss']:.3f} -> "
        f"{summary['final_loss']:.3f}; median {summary['median_tokens_per_s_per_device']:,.0f} tokens/s/device")
  print(f"wrote {os.path.join(out, 'report.html')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
