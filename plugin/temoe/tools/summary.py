"""Prints a run's loss and throughput in one line (`make train`), from `temoe report`'s summary."""

from __future__ import annotations

import json
import sys

from temoe.tools import report


def summarize(path: str) -> str:
  rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
  if not rows:
    return f"{path}: no steps logged"
  s = report.summarize(rows, path, None, None)
  return (
      f"temoe run: {s['steps']} steps, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}; "
      f"median {s['median_tokens_per_s_per_device']:,.0f} tokens/s/device, "
      f"{s['median_maxtext_tflops_per_s_per_device']:.4f} TFLOP/s/device (MaxText's count)"
  )


if __name__ == "__main__":
  print(summarize(sys.argv[1]))
