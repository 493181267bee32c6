"""What JAX's mocked NCCL (one process of a many-GPU job on one GPU) runs of temoe's collectives, and how long a
mocked collective takes, written to bench/results/mock_collectives.json.

Each topology is tried in its own process (the mock is set before the GPU client starts): for every collective
kind temoe's step uses (all-to-all, ragged all-to-all, all-gather, reduce-scatter, psum, ppermute), one
shard_map program over all the job's devices is compiled, its optimized HLO read for the collective's op
(async start/done or not), run, timed against the same program without the collective, and its output's
local shard compared with what a real collective would hold. XLA's autotuner is off (MOCK_XLA_FLAGS): with it, the
first program of 1x8x1 did not compile in 40 s on an H200. A topology's devices per host must be the host's real
GPUs (one here).

    python bench/mock_collectives.py [--out DIR] [--topologies 1x8x1,2x4x1,16x8x1] [--mib 64] [--iters 20]
    python bench/mock_collectives.py --child TOPOLOGY ...   (one topology; what the parent runs)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
MOCK_XLA_FLAGS = "--xla_gpu_autotune_level=0"
KINDS = ("all_to_all", "ragged_all_to_all", "all_gather", "reduce_scatter", "psum", "ppermute")
HLO_OPS = {"all_to_all": "all-to-all", "ragged_all_to_all": "ragged-all-to-all", "all_gather": "all-gather",
           "reduce_scatter": "reduce-scatter", "psum": "all-reduce", "ppermute": "collective-permute"}


def hlo_summary(text: str, op: str) -> dict:
  """How the optimized HLO holds `op`: sync ops, async start/done pairs, or absent."""
  import re  # pylint: disable=import-outside-toplevel

  calls = re.findall(rf"= [^=]*? {re.escape(op)}(-start|-done)?\(", text)
  return {"sync": sum(1 for c in calls if not c), "start": sum(1 for c in calls if c == "-start"),
          "done": sum(1 for c in calls if c == "-done")}


def time_ms(fn, x, iters: int) -> float:
  import jax  # pylint: disable=import-outside-toplevel

  jax.block_until_ready(fn(x))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t)
  return sorted(times)[len(times) // 2] * 1e3


def child(topology: str, mib: float, iters: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  if topology != "none":
    jax.config.update("jax_mock_gpu_topology", topology)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  out = {"topology": topology, "devices": jax.device_count(), "local_devices": jax.local_device_count(),
         "process_index": jax.process_index(), "process_count": jax.process_count(),
         "device_kind": jax.devices()[0].device_kind, "kinds": {}}
  n = jax.device_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))  # jax.make_mesh refuses multi-slice topologies
  rows = max(n, int(mib * 2**20 / 4 / 1024) // n * n)  # float32 rows of 1024: `mib` MiB a device
  spec = P("x")
  sharding = NamedSharding(mesh, spec)
  local = np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024) % 251 + 1  # never zero
  x = jax.make_array_from_callback((rows * n, 1024), sharding, lambda idx: local)
  chunk = rows // n

  def ragged(v):
    off = jnp.arange(n, dtype=jnp.int32) * chunk  # my rows for peer j
    sizes = jnp.full((n,), chunk, jnp.int32)
    at = jnp.full((n,), jax.lax.axis_index("x") * chunk, jnp.int32)  # where they land in peer j's buffer
    return jax.lax.ragged_all_to_all(v, jnp.zeros_like(v), off, sizes, at, sizes, axis_name="x")

  bodies = {
      "none": lambda v: v * 2.0,
      "all_to_all": lambda v: jax.lax.all_to_all(v * 2.0, "x", 0, 0, tiled=True),
      "ragged_all_to_all": lambda v: ragged(v * 2.0),
      "all_gather": lambda v: jax.lax.all_gather(v * 2.0, "x", tiled=True)[:rows],
      "reduce_scatter": lambda v: jnp.tile(jax.lax.psum_scatter(v * 2.0, "x", tiled=True), (n, 1)),
      "psum": lambda v: jax.lax.psum(v * 2.0, "x"),
      "ppermute": lambda v: jax.lax.ppermute(v * 2.0, "x", [(i, (i + 1) % n) for i in range(n)]),
  }
  first = np.tile((local * 2)[:chunk], (n, 1))  # device 0 receives every device's first block
  expected = {"none": local * 2, "all_to_all": first, "ragged_all_to_all": first, "all_gather": local * 2,
              "reduce_scatter": first * n, "psum": local * 2 * n, "ppermute": local * 2}
  # every device holds `local`: what device 0's shard of a real collective holds
  for kind, body in bodies.items():
    row = {}
    try:
      fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
      compiled = fn.lower(x).compile()
      if kind != "none":
        row["hlo"] = hlo_summary(compiled.as_text(), HLO_OPS[kind])
      row["ms"] = time_ms(compiled, x, iters)
      got = np.asarray(compiled(x).addressable_shards[0].data)
      row["output"] = ("as a real collective" if np.array_equal(got, expected[kind]) else
                       "zeros" if not got.any() else "the input doubled (untouched)" if np.array_equal(got, local * 2)
                       else "other")
      row["ok"] = True
    except Exception as exc:  # pylint: disable=broad-exception-caught
      row = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    out["kinds"][kind] = row
    print(f"  {topology} {kind}: {row}", flush=True)
  base = out["kinds"]["none"].get("ms")
  for kind in KINDS:
    row = out["kinds"][kind]
    if row.get("ok") and base is not None:
      row["ms_over_no_collective"] = row["ms"] - base
  out["mib_per_device"] = rows * 1024 * 4 / 2**20
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(HERE / "results"))
  parser.add_argument("--topologies", default="1x8x1,2x4x1,16x8x1")
  parser.add_argument("--mib", type=float, default=64.0, help="buffer per device")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print("MOCK_RESULT " + json.dumps(child(args.child, args.mib, args.iters)), flush=True)
    return 0
  results = []
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {MOCK_XLA_FLAGS}".strip()}
  for topology in args.topologies.split(","):
    try:
      run = subprocess.run([sys.executable, __file__, "--child", topology, "--mib", str(args.mib), "--iters",
                            str(args.iters)], capture_output=True, text=True, timeout=120, check=False, env=env)
    except subprocess.TimeoutExpired as exc:
      results.append({"topology": topology, "error": "timed out after 120 s", "stdout": str(exc.stdout)[-1000:]})
      continue
    found = [l for l in run.stdout.splitlines() if l.startswith("MOCK_RESULT ")]
    if found:
      results.append(json.loads(found[-1].split(" ", 1)[1]))
    else:
      results.append({"topology": topology, "error": (run.stderr.strip().splitlines() or ["no output"])[-1][:400],
                      "rc": run.returncode})
    print(json.dumps(results[-1]), flush=True)
  pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
  result = {"command": " ".join(["python", "bench/mock_collectives.py", *sys.argv[1:]]), "results": results,
            "env": {k: env.get(k, "") for k in ("XLA_FLAGS",)}}
  (pathlib.Path(args.out) / "mock_collectives.json").write_text(json.dumps(result, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
