"""Benchmark: what temoe's per-batch token check costs on the 1-GPU proxy's batch, against its step time.

`temoe train` checks every host batch's `inputs` (`temoe.run.tokens.BatchCheck`, called from the
`multihost_dataloading._form_global_array` seam) on the host, in the main thread, before the batch
goes to the device. Here that same call runs on a batch of the proxy's shape and dtype (the ids
MaxText's Grain pipeline produces: int32, per_device_batch_size x max_target_length of
configs/deepseek3-proxy-1gpu.yml on one device, ids drawn in [0, vocab_size)); its median over
`--iters` calls is compared with the proxy's step time from bench/results/proxy_1gpu.json (the shipped
path, temoe_fp8). The cost is an upper bound on the slowdown: with JAX's asynchronous dispatch the
host works ahead of the GPU, so host time is hidden unless the host is the bottleneck. The check's
time depends on the host CPU only, so the GPU host's own CPU is the one to measure on.

    python bench/batch_check.py [--iters 2000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROXY = ROOT / "configs" / "deepseek3-proxy-1gpu.yml"
# Settings that change neither the batch nor the vocabulary, so the config builds on a host without TE or a GPU.
WITHOUT_GPU = ["hardware=cpu", "te_gmm_quantization=te_no_quant", "quantization=''", "attention=dot_product"]


def proxy_batch(config):
  import numpy as np  # pylint: disable=import-outside-toplevel

  rows = int(config.per_device_batch_size)  # one device: the host batch is one device's
  return np.random.default_rng(0).integers(0, config.vocab_size, (rows, config.max_target_length), dtype=np.int32)


def measure(iters: int) -> dict:
  import numpy as np  # pylint: disable=import-outside-toplevel

  import temoe.maxtext  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import  (MaxText's asset root)
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel
  from temoe.run import tokens  # pylint: disable=import-outside-toplevel

  config = introspect.initialize_config(["bench", str(PROXY), *WITHOUT_GPU, "skip_jax_distributed_system=true"])
  check, ids = tokens.BatchCheck(config), proxy_batch(config)
  for _ in range(50):  # warm caches
    check(ids)
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    check(ids)
    times.append(time.perf_counter() - start)
  step_s = json.loads((ROOT / "bench" / "results" / "proxy_1gpu.json").read_text())["paths"]["temoe_fp8"]["step_time_s"]
  median = statistics.median(times)
  return {
      "command": " ".join(["python", "bench/batch_check.py", *sys.argv[1:]]),
      "host": {"machine": platform.machine(), "processor": platform.processor() or None, "cpus": os.cpu_count(),
               "numpy": np.__version__},
      "batch": {"shape": list(ids.shape), "dtype": str(ids.dtype), "vocab_size": int(config.vocab_size),
                "config": str(PROXY.relative_to(ROOT))},
      "iters": iters,
      "check_us_median": median * 1e6,
      "check_us_p99": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6,
      "proxy_step_time_s": step_s,
      "proxy_step_time_from": "bench/results/proxy_1gpu.json paths.temoe_fp8.step_time_s (one H200)",
      "fraction_of_step": median / step_s,
      "target_fraction": 0.01,
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=2000)
  parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
  args = parser.parse_args(argv)
  result = measure(args.iters)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "batch_check.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print(f"batch check on {result['batch']['shape']} {result['batch']['dtype']}: {result['check_us_median']:.1f} us "
        f"median ({result['check_us_p99']:.1f} us p99) = {100 * result['fraction_of_step']:.4f}% of the proxy's "
        f"{1e3 * result['proxy_step_time_s']:.1f} ms step; wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
