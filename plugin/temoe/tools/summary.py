"""Prints a run's loss and throughput in one line (`make train`), from `temoe report`'s summary."""

from __future__ import annotations

import os
import sys

from temoe import oneline
from temoe.tools import report


class NotMetrics(ValueError):
  """The file holds no step MaxText's metrics file would."""


def summarize(path: str) -> str:
  """The one line; NotMetrics (one line) for a file that is empty, or holds no row with a loss, or a row whose
  numbers are not numbers."""
  if os.path.getsize(path) == 0:
    raise NotMetrics(f"{path} is empty: no step was logged (the run stopped before its first step, or metrics_file "
                     "points elsewhere)")
  rows = [r for r in report.read_metrics(path) if "learning/loss" in r]
  if not rows:
    raise NotMetrics(f"{path} is not a metrics file: no line is a JSON row with learning/loss (MaxText's "
                     "metrics_file=...jsonl writes one per step)")
  report.check_numbers(rows, path)
  s = report.summarize(rows, path, None, None)
  return (
      f"temoe run: {s['steps']} steps, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}; "
      f"median {s['median_tokens_per_s_per_device']:,.0f} tokens/s/device, "
      f"{s['median_maxtext_tflops_per_s_per_device']:.4f} TFLOP/s/device (MaxText's count)"
  )


@oneline.guarded("temoe summary")
def main(argv: list[str] | None = None) -> int:
  """`python -m temoe.tools.summary <metrics.jsonl>`: 0, or 2 with one line for a path that is not a metrics file."""
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1 or argv[0].startswith("-"):
    print("temoe summary: usage: python -m temoe.tools.summary <metrics.jsonl>", file=sys.stderr)
    return 2
  if not os.path.isfile(argv[0]):
    print(f"temoe summary: {argv[0]} is not a metrics file (MaxText's metrics_file=...jsonl)", file=sys.stderr)
    return 2
  try:
    print(summarize(argv[0]))
  except ValueError as exc:  # NotMetrics, and report's one-line refusals of a row
    print(f"temoe summary: {exc}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
