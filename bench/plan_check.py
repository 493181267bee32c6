"""`temoe plan` against measured peaks: the 1-GPU proxy's flags (bench/proxy_1gpu.py), planned on
this machine (on a GPU: its own; elsewhere: an H200 stand-in), against `peak_hbm_gib` in
bench/results/proxy_1gpu.json. Prints each plan and estimate / measured; exit 1 if any is off by
more than the plan's tolerance (15%).

    python bench/plan_check.py [--paths temoe_fp8,tokamax_gmm] [--results bench/results/proxy_1gpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--paths", default="temoe_fp8")
  parser.add_argument("--results", default=str(HERE / "results" / "proxy_1gpu.json"),
                      help="comma list of proxy_1gpu.py result files; a path's peak comes from the first holding it")
  parser.add_argument("--out", help="write the rows (and this command) as JSON here")
  args = parser.parse_args()
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  sys.path.insert(0, str(HERE))
  import proxy_1gpu  # pylint: disable=import-outside-toplevel

  from temoe.tools import plan  # pylint: disable=import-outside-toplevel

  measured = {}
  for results in reversed(args.results.split(",")):
    measured.update(json.loads(pathlib.Path(results).read_text())["paths"])
  worst, rows = 0.0, []
  for path in args.paths.split(","):
    peak = measured.get(path, {}).get("peak_hbm_gib")
    if not peak:
      print(f"{path}: no measured peak_hbm_gib in {args.results}")
      return 2
    maxtext_args = proxy_1gpu.args_of(path)
    p = plan.make_plan(maxtext_args[0], maxtext_args[1:])
    print(plan.table(p))
    estimate = p.estimate.peak / 2**30
    ratio = estimate / peak
    worst = max(worst, abs(ratio - 1))
    rows.append({"path": path, "estimate_gib": estimate, "measured_gib": peak, "ratio": ratio})
    print(f"PLAN_CHECK {json.dumps(rows[-1])}")
  if args.out:
    command = " ".join(["python", "bench/plan_check.py", *sys.argv[1:]])
    pathlib.Path(args.out).write_text(json.dumps({"command": command, "tolerance": plan.TOLERANCE, "rows": rows}, indent=1))
  return 0 if worst <= plan.TOLERANCE else 1


if __name__ == "__main__":
  sys.exit(main())
