"""GPU time per kernel name in a profiler trace (.xplane.pb), per iteration: for traces whose kernels ran
inside CUDA graphs (bench/moe_layer.py --trace), where XLA's per-op events are not there to classify.

    python bench/kernel_times.py TRACE.xplane.pb [--iters 3] [--out summary.json] [--host]

Sums each kernel name's events on the GPU streams (derived timelines left out), divides by --iters, and
prints them largest first with the busy total; --out writes them as JSON with this command. --host does
the same for the host's threads (the /host:CPU plane: what a host-bound step spends its time on),
keyed "<thread> | <event>", each event's time inclusive of the events nested in it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plugin"))
from temoe.tools.profiling import DERIVED_LINES  # noqa: E402  # pylint: disable=wrong-import-position


def kernel_ms(trace: str, iters: int, host: bool = False) -> dict[str, dict]:
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel

  ms, count = collections.defaultdict(float), collections.Counter()
  for plane in ProfileData.from_file(trace).planes:
    if not (plane.name == "/host:CPU" if host else plane.name.startswith("/device:GPU")):
      continue
    for line in plane.lines:
      if line.name in DERIVED_LINES:
        continue
      for event in line.events:
        name = f"{line.name} | {event.name}" if host else event.name
        ms[name] += (event.end_ns - event.start_ns) / 1e6 / iters
        count[name] += 1
  return {name: {"ms_per_iter": v, "launches_per_iter": count[name] / iters}
          for name, v in sorted(ms.items(), key=lambda kv: -kv[1])}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("trace")
  parser.add_argument("--iters", type=int, default=3, help="iterations the trace holds (moe_layer.py traces 3)")
  parser.add_argument("--out")
  parser.add_argument("--host", action="store_true", help="the host threads' events instead of the GPU's kernels")
  args = parser.parse_args()
  kernels = kernel_ms(args.trace, args.iters, args.host)
  busy = sum(k["ms_per_iter"] for k in kernels.values())
  for name, k in list(kernels.items())[:25]:
    print(f"{k['ms_per_iter']:8.3f} ms  x{k['launches_per_iter']:<5g} {name[:100]}")
  print(f"{busy:8.3f} ms {'in host events (nested ones counted in each)' if args.host else 'busy'} per iteration")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"command": "python bench/kernel_times.py " + " ".join(sys.argv[1:]), "busy_ms_per_iter": busy,
                 "kernels": kernels}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
