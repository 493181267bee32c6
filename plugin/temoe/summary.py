"""Prints a run's loss and throughput from MaxText's metrics file (`metrics_file=...jsonl`)."""

from __future__ import annotations

import json
import statistics
import sys


def summarize(path: str) -> str:
  rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
  if not rows:
    return f"{path}: no steps logged"
  losses = [r["learning/loss"] for r in rows]
  steady = rows[min(2, len(rows) - 1) :]  # the first steps include compilation
  tokens = statistics.median(r["perf/per_device_tokens_per_sec"] for r in steady)
  tflops = statistics.median(r["perf/per_device_tflops_per_sec"] for r in steady)
  return (
      f"temoe run: {len(rows)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
      f"median {tokens:,.0f} tokens/s/device, {tflops:.4f} TFLOP/s/device (MaxText's count)"
  )


if __name__ == "__main__":
  print(summarize(sys.argv[1]))
