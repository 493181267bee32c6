"""Where a marginal MoE decoder layer's time goes: two `temoe profile` traces of the 1-GPU proxy at two depths
(bench/proxy_1gpu.py's `path` and `path@5`), per category and per op (XLA op name with its numbers folded,
so the two compiles' ops match), as (deep - shallow) / (layers between them). Reads the traces with
temoe.tools.profiling (real xprof; the device kit's is a stand-in, so run it where xprof is installed).

    python bench/profile_diff.py temoe_fp8.xplane.pb temoe_fp8_at5.xplane.pb --layers 2 --steps 3 --out diff.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

from temoe.tools import profiling


def per_op(trace: str, steps: int) -> tuple[dict, dict]:
  """(ms per step by category, ms per step by (category, op kind, op name)) of one training-step trace."""
  modules, devices = profiling.hlo_modules(trace), profiling.device_ops(trace)
  names = collections.Counter(op[3] for ops in devices.values() for op in ops)
  wanted = {m for m in names if "train_step" in m}
  ops = [op for ops in devices.values() for op in ops if op[3] in wanted]
  _, totals, spent, info = profiling._device_breakdown(ops, modules, steps)  # pylint: disable=protected-access
  by_op = collections.defaultdict(float)
  for key, ns in spent.items():
    category, name, _ = info[key]
    by_op[(category, re.sub(r"[._]\d+$", "", key[1]), re.sub(r"\d+", "#", name))] += ns / 1e6
  return {c: totals.get(c, 0.0) / 1e6 for c in profiling.CATEGORIES}, by_op


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("shallow")
  ap.add_argument("deep")
  ap.add_argument("--layers", type=int, default=2, help="MoE layers the deep run has more")
  ap.add_argument("--steps", type=int, default=3, help="steps in each trace")
  ap.add_argument("--top", type=int, default=30)
  ap.add_argument("--out")
  args = ap.parse_args(argv)
  (cat_a, ops_a), (cat_b, ops_b) = per_op(args.shallow, args.steps), per_op(args.deep, args.steps)
  per_layer = {c: (cat_b[c] - cat_a[c]) / args.layers for c in profiling.CATEGORIES}
  rows = sorted(({"ms": (ops_b.get(k, 0.0) - ops_a.get(k, 0.0)) / args.layers, "category": k[0], "kind": k[1],
                  "op_name": k[2]} for k in set(ops_a) | set(ops_b)), key=lambda r: -r["ms"])
  result = {"command": "python bench/profile_diff.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "step_ms": {"shallow": sum(cat_a.values()), "deep": sum(cat_b.values())},
            "ms_per_layer": sum(per_layer.values()), "by_category": per_layer, "top_ops": rows[: args.top]}
  for c, v in per_layer.items():
    print(f"{c:12s} {v:7.2f} ms")
  print(f"{'per layer':12s} {result['ms_per_layer']:7.2f} ms")
  for r in rows[: args.top]:
    print(f"{r['ms']:7.3f}  {r['category']:10s} {r['kind']:32s} {r['op_name'][:110]}")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
