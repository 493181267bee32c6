#!/usr/bin/env bash
# Step-time breakdown of the 1-GPU DeepSeek-V3 proxy per path of bench/proxy_1gpu.py (its PATHS: the
# shipped config and its variants; default temoe_fp8 and stock_best): `temoe profile` then `temoe report` for each, on a
# GPU host with TE + MaxText 0.2.5 (on the project's H200: `source tools-device/env.sh` first).
#   bash bench/profile_1gpu.sh [path ...]     e.g. bash bench/profile_1gpu.sh temoe_fp8 stock_best
# Writes $OUT (or bench/results)/profile_1gpu/<path>/{profile.json,metrics.jsonl,report/*.png,report.html}
# and profile_1gpu.json (the breakdowns side by side) with its commands.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/plugin${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-bench/results}/profile_1gpu; mkdir -p "$out"
paths=("$@"); [ ${#paths[@]} -gt 0 ] || paths=(temoe_fp8 stock_best)
rc=0
for p in "${paths[@]}"; do
  # the path's config file, then its key=value overrides (bench/proxy_1gpu.py's args_of)
  args=$(python3 -c 'import sys; sys.path.insert(0, "bench"); import proxy_1gpu as b; print(" ".join(b.args_of(sys.argv[1])))' "$p" | tail -n 1) || { rc=1; continue; }
  echo "== $p: temoe profile $args"
  # shellcheck disable=SC2086  # a config path and MaxText key=value words, none with spaces
  python3 -m temoe.cli profile $args --out "$out/$p" --skip 3 --steps 3 2>&1 | tee "$out/$p.log" | grep -v "^I[0-9]" || rc=1
  python3 -m temoe.cli report "$out/$p" || rc=1
done
python3 - "$out" "${paths[@]}" <<'EOF'
import json, os, sys
out, paths = sys.argv[1], sys.argv[2:]
rows = {}
for p in paths:
  path = os.path.join(out, p, "profile.json")
  if os.path.exists(path):
    r = json.load(open(path))
    rows[p] = {"command": r.get("command"), "step_ms": r["step_ms"], "ms_per_step": r["ms_per_step"], "flops": r.get("flops")}
json.dump(rows, open(os.path.join(out, "profile_1gpu.json"), "w"), indent=1)
for p, r in rows.items():
  print(f"{p:<14} {r['step_ms']:9.2f} ms/step  " + "  ".join(f"{k} {v:.2f}" for k, v in r["ms_per_step"].items()))
EOF
exit $rc
