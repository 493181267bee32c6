"""Prints a run's loss and throughput in one line (`make train`), from `temoe report`'s summary."""

from __future__ import annotations

import os
import sys

from temoe import oneline
from temoe.tools import report


def summarize(path: str) -> str:
  rows = [r for r in report.read_metrics(path) if "learning/loss" in r]
  if not rows:
    return f"{path}: no steps logged"
  s = report.summarize(rows, path, None, None)
  return (
      f"temoe run: {s['steps']} steps, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}; "
      f"median {s['median_tokens_per_s_per_device']:,.0f} tokens/s/device, "
      f"{s['median_maxtext_tflops_per_s_per_device']:.4f} TFLOP/s/device (MaxText's count)"
  )


@oneline.guarded("temoe summary")
def main(argv: list[str] | None = None) -> int:
  """`python -m temoe.tools.summary <metrics.jsonl>`: 0, or 2 with one line for a path that is not a file."""
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1 or argv[0].startswith("-"):
    print("temoe summary: usage: python -m temoe.tools.summary <metrics.jsonl>", file=sys.stderr)
    return 2
  if not os.path.isfile(argv[0]):
    print(f"temoe summary: {argv[0]} is not a metrics file (MaxText's metrics_file=...jsonl)", file=sys.stderr)
    return 2
  print(summarize(argv[0]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
