"""One rank of a many-GPU training job, on the one GPU here: MaxText's train step with temoe compiled for the
job's whole mesh under JAX's mock GPU topology (mocked NCCL: `jax.devices()` is the job, one device is real),
a few steps of this rank profiled, and per-rank step time split by stage (temoe.tools.profiling's categories),
peak HBM, and what the compiled schedule does with each collective (async or not, which compute is scheduled
between its start and its done and how long that compute ran: temoe.tools.hlo_schedule).

Depth: each run trains the preset at two reduced depths a < b (MaxText's base_num_decoder_layers; only MoE
layers are added, as bench/proxy_1gpu.py does), so (t_b - t_a) / (b - a) is one MoE decoder layer of this
rank and t_a + (L - a) such layers the full depth L's step: every figure at full depth is extrapolated so, and
the result says it. Mocked collectives move no data (what they do and cost was measured by
bench/mock_collectives.py): the step time is this rank's compute with its network free, not a step of the job.

Results merge into OUT/one_rank.json: {"runs": [{"config", "devices", "layout", "step_ms", "stages_ms",
"peak_hbm_gib", "collectives": [{"kind", "async", "overlapped_ms", ...}], "depth", "measured", ...}]}.

    python bench/one_rank.py configs/deepseek3-671b-h100x1024.yml --devices 1024 --slices 128 [--layers 4,5]
        [--steps 3] [--skip 3] [--out bench/results] [key=value ...]
    python bench/one_rank.py configs/deepseek3-smoke.yml --devices 4 --cpu --layers 2,3   (host devices; tiny)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT / "plugin") not in sys.path:
  sys.path.insert(0, str(ROOT / "plugin"))
MAX_DEVICES = 1 << 16
MAX_CPU_DEVICES = 16
"""Host devices a --cpu run may fake: XLA:CPU runs every one of them, on this host's cores."""
COMMON = ["dataset_type=synthetic", "enable_checkpointing=false", "enable_tensorboard=false",
          "skip_jax_distributed_system=true", "log_config=false", "override_model_config=true"]
MOCK_SETTINGS = ["abort_on_nan_loss=false"]
"""MaxText settings of a mocked run: its collectives return buffers nothing wrote (bench/mock_collectives.py), so
activations and gradients are garbage (NaN losses on an H200 from the first or second step); a NaN loss must not
stop the run. The kernels' time does not depend on the values; the routing does (see MOCK_NOTES)."""
MOCK_XLA_FLAGS = "--xla_gpu_autotune_level=0"
"""XLA's autotuner hung under the mock on an H200 (a shard_map of one multiply did not compile in 40 s on 1x8x1;
with this flag all of bench/mock_collectives.py's programs ran): kernels take XLA's default configurations."""
MOCK_NOTES = ["XLA autotuning off (" + MOCK_XLA_FLAGS + "): default kernel configurations",
              "a NaN loss stops nothing (" + " ".join(MOCK_SETTINGS) + "): activations and gradients hold what mocked "
              "collectives leave, so the routing is not a trained model's (the receive buffers bound the rows an "
              "expert rank computes at capacity)",
              "the expert exchange's ragged all-to-alls run as padded all-to-alls (mocked NCCL has no ragged "
              "all-to-all: 'No clique found'): receive buffers of one slot per sender and row",
              "the expert-parallel overflow flag reads 0 (routing of garbage activations would overflow the receive "
              "buffers and stop MaxText's run; rows past capacity are still dropped, as a real overflow drops them)"]
"""What a mocked run changes from the real job's rank, in its result."""
STAGES = ("attention", "router", "dispatch", "experts", "combine", "collectives", "dense", "optimizer", "other",
          "idle")


PARENT_ONLY: set[str] = set()
"""Environment variables the parent set for itself, not passed to the workers."""


class Refused(ValueError):
  """Arguments this bench cannot run; exit code 2, before anything compiles."""


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(prog="bench/one_rank.py", description=__doc__.splitlines()[0])
  parser.add_argument("config", help="MaxText config YAML (a preset of configs/)")
  parser.add_argument("--devices", type=int, required=True, help="devices of the whole job")
  parser.add_argument("--slices", type=int, default=1, help="slices (GPU nodes) of the job")
  parser.add_argument("--layers", default="", help="two decoder depths a,b (default: dense layers + 1 and + 2)")
  parser.add_argument("--steps", type=int, default=3, help="steps traced")
  parser.add_argument("--skip", type=int, default=3, help="steps before the trace (compile, warm-up)")
  parser.add_argument("--gpu", default=None, help="peak table row for MFU (default: the device's)")
  parser.add_argument("--cpu", action="store_true", help="host devices instead of the mocked GPU job (tiny configs)")
  parser.add_argument("--out", default=str(HERE / "results"))
  parser.add_argument("--timeout", type=int, default=900, help="seconds per depth")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if "=" not in a or a.startswith("-")]
  if bad:
    raise Refused(f"unknown arguments {' '.join(bad)}; pass MaxText settings as key=value")
  if not args.config.endswith((".yml", ".yaml")) or not os.path.isfile(args.config):
    raise Refused(f"{args.config} is not a config YAML file")
  if not 1 <= args.devices <= MAX_DEVICES or not 1 <= args.slices <= args.devices:
    raise Refused(f"--devices={args.devices} must be 1..{MAX_DEVICES:,} and --slices={args.slices} 1..--devices")
  if args.devices % args.slices:
    raise Refused(f"--devices={args.devices} is not a multiple of --slices={args.slices} (devices per slice are equal)")
  if args.cpu and args.devices > MAX_CPU_DEVICES:
    raise Refused(f"--cpu runs every device on this host: at most {MAX_CPU_DEVICES} (asked {args.devices}); "
                  "a job's full mesh needs a GPU and the mock topology")
  if args.cpu and args.slices > 1:
    raise Refused(f"--cpu runs host devices, which form one slice (they report no slice_index): --slices must be 1 "
                  f"(asked {args.slices}); a job of several slices needs a GPU and the mock topology")
  if args.steps < 1 or args.skip < 1:
    raise Refused(f"--steps={args.steps} and --skip={args.skip} must be at least 1 (the first step compiles)")
  if args.layers:
    try:
      depths = [int(d) for d in args.layers.split(",")]
    except ValueError:
      depths = []
    if len(depths) != 2 or not 1 <= depths[0] < depths[1]:
      raise Refused(f"--layers={args.layers} must be two depths a,b with 1 <= a < b (e.g. 4,5)")
  return args, rest


def topology(devices: int, slices: int) -> str:
  """JAX's mock topology for the job with one device a process (this host has one real GPU): slices x hosts x 1."""
  return f"{slices}x{devices // slices}x1"


def have_gpu() -> bool:
  import jax  # pylint: disable=import-outside-toplevel

  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def depths_of(config_path: str, overrides: list[str], layers: str, devices: int = 1,
              slices: int = 1) -> tuple[int, int, int, int]:
  """(a, b, the config's full depth, its dense layers), checked: a and b hold at least one MoE layer each. The
  config is built as `temoe plan` builds it (for the job's device count; temoe's checks see this GPU, else an H200)."""
  from temoe.tools import planner  # pylint: disable=import-outside-toplevel

  seen, _, _ = planner.target("h200", 1.0)
  with planner.platform_seen_as(seen):
    config = planner.build_config(config_path, [*overrides, "override_model_config=true", f"num_slices={slices}"],
                                  devices)
  full, dense = int(config.base_num_decoder_layers), int(config.first_num_dense_layers or 0)
  a, b = (int(d) for d in layers.split(",")) if layers else (dense + 1, dense + 2)
  if a <= dense or b > full:
    raise Refused(f"--layers={a},{b}: each depth needs a MoE layer after the {dense} dense one(s), at most the "
                  f"config's {full}")
  return a, b, full, dense


def own_counts_for_peers() -> None:
  """Under the mock a collective's output holds whatever its buffer held, and temoe's exchange plans its receive
  buffers from the routing counts each rank all-gathers: garbage counts would overflow them or empty the experts.
  This process's integer all-gathers instead return this rank's own operand for every peer: each rank routes as
  this one, which on a balanced router is the mean load (the result says so)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  real = jax.lax.all_gather

  def gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, **kw):
    if axis_index_groups is None and jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
      n = jax.lax.axis_size(axis_name)
      return jnp.concatenate([x] * n, axis=axis) if tiled else jnp.stack([x] * n, axis=axis)
    return real(x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled, **kw)

  jax.lax.all_gather = gather


def padded_for_ragged() -> None:
  """Mocked NCCL runs no ragged all-to-all (on an H200: "No clique found for clique key", bench/mock_collectives.py):
  this process's expert exchanges move their rows as XLA:CPU's do, through padded all-to-alls of the same plan
  (`ragged` as `padded`; dedup's and hier's hops by `padded`)."""
  from temoe.moe import exchange  # pylint: disable=import-outside-toplevel
  from temoe.moe.exchange import dedup, padded  # pylint: disable=import-outside-toplevel

  real = exchange.resolve

  def resolve(*args, **kwargs):
    name = real(*args, **kwargs)
    return "padded" if name == "ragged" else name

  exchange.resolve = resolve
  dedup.transport = lambda platform: padded


def no_overflow_stop() -> None:
  """Mocked collectives hand the layers buffers nothing wrote (NaN losses on an H200 from the first step at 3 layers),
  and routing NaN scores overflows the expert-parallel receive buffers, which stops MaxText's run at its overflow
  check: this process's MoE layers report no overflow to that check."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from temoe.maxtext import adapter  # pylint: disable=import-outside-toplevel

  real = adapter.sow_step_outputs

  def sow_step_outputs(layer, stats, routing):
    real(layer, {**stats, "overflow": jnp.zeros_like(stats["overflow"])}, routing)

  adapter.sow_step_outputs = sow_step_outputs


def worker(args, overrides: list[str], depth: int, rundir: str) -> None:
  """Trains one depth in this process (fresh: the allocator's peak and the mock are per process); prints a row."""
  import jax  # pylint: disable=import-outside-toplevel

  mocked = not args.cpu
  if mocked:
    jax.config.update("jax_mock_gpu_topology", topology(args.devices, args.slices))
    own_counts_for_peers()
    padded_for_ragged()
    no_overflow_stop()
  from temoe.tools import hlo_schedule, planner, profiling  # pylint: disable=import-outside-toplevel
  from temoe.tools import one_rank as one_rank_reader  # pylint: disable=import-outside-toplevel

  hlo_dir = os.path.join(rundir, "hlo")
  settings = [*overrides, *COMMON, *([] if args.cpu else MOCK_SETTINGS), f"base_num_decoder_layers={depth}",
              f"num_slices={args.slices}", "hardware=cpu" if args.cpu else "hardware=gpu"]
  result = profiling.profile_run(args.config, settings, rundir, args.skip, args.steps, args.gpu, hlo_dir=hlo_dir)
  modules = profiling.dumped_modules(hlo_dir)
  trace = profiling.latest_trace(rundir)
  times = profiling.op_ms(trace, args.steps, modules=modules)
  found = hlo_schedule.collectives(profiling.dumped_hlo(hlo_dir), times)
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  config = introspect.initialize_config(["one_rank", args.config, *settings])
  ici, dcn = planner.mesh_split(config, jax.device_count())
  layout = one_rank_reader.layout_of(config.mesh_axes, ici, dcn)
  stats = jax.local_devices()[0].memory_stats() or {}
  row = {"depth": depth, "step_ms": result["step_ms"], "stages_ms": result["ms_per_step"],
         "maxtext_step_ms": result.get("maxtext_step_ms"), "unmatched_ms": result["unmatched_ms"],
         "collectives_total_ms": result["collectives_total_ms"],
         "peak_hbm_gib": stats["peak_bytes_in_use"] / 2**30 if stats.get("peak_bytes_in_use") else None,
         "collectives": hlo_schedule.summary(found), "layout": layout,
         "devices_seen": jax.device_count(), "local_devices": jax.local_device_count(),
         "mocked": mocked, "device_kind": jax.devices()[0].device_kind, "model_name": str(config.model_name),
         "per_device_batch_size": float(config.per_device_batch_size),
         "max_target_length": int(config.max_target_length),
         "top_ops": result["top_ops"][:10], "flops": result.get("flops")}
  print("ONE_RANK " + json.dumps(row), flush=True)


def profile_env(environ: dict[str, str]) -> dict[str, str]:
  """temoe's env profile for this GPU (what the container sets: the latency-hiding scheduler, pipelined
  collectives, ...), a variable or flag in `environ` winning, with CUDA graphs off: kernels replayed from a
  graph lose their HLO op in the trace."""
  from temoe.deploy import env  # pylint: disable=import-outside-toplevel

  arch, _ = env.detect_arch()
  out = env.environment(arch, environ)
  out["XLA_FLAGS"] = f"{out.get('XLA_FLAGS', '')} --xla_gpu_enable_command_buffer=".strip()
  return out


def run_depth(args, overrides: list[str], depth: int, workdir: str) -> dict:
  """One depth in a fresh process: its row, or {"error": ...}."""
  rundir = os.path.join(workdir, f"depth{depth}")
  env = {k: v for k, v in os.environ.items() if k not in PARENT_ONLY}
  env["PYTHONUNBUFFERED"] = "1"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "plugin"), env.get("PYTHONPATH", "")) if p)
  if args.cpu:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}".strip()
  else:
    env.update(profile_env(env))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {MOCK_XLA_FLAGS}".strip()
  cmd = [sys.executable, __file__, args.config, "--devices", str(args.devices), "--slices", str(args.slices),
         "--steps", str(args.steps), "--skip", str(args.skip), "--worker", f"{depth}:{rundir}", *overrides]
  if args.cpu:
    cmd.append("--cpu")
  if args.gpu:
    cmd += ["--gpu", args.gpu]
  env["PYTHONFAULTHANDLER"] = "1"  # a worker stopped at the timeout prints every thread's stack
  settings = f".{hashlib.sha1(' '.join(overrides).encode()).hexdigest()[:8]}" if overrides else ""  # one log a run
  log = pathlib.Path(args.out) / f"one_rank.{pathlib.Path(args.config).stem}.{args.devices}{settings}.depth{depth}.log"
  start = time.monotonic()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  try:
    output, _ = proc.communicate(timeout=args.timeout)
    timed_out = False
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGABRT)  # faulthandler's stacks say where it was
    try:
      output, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      proc.kill()
      output, _ = proc.communicate()
    timed_out = True
  wall = round(time.monotonic() - start, 1)
  lines = [l for l in output.splitlines() if "[NO-OP]" not in l]
  log.parent.mkdir(parents=True, exist_ok=True)
  log.write_text("\n".join(lines) + "\n")
  rows = [json.loads(l.split(" ", 1)[1]) for l in lines if l.startswith("ONE_RANK ")]
  if timed_out:
    return {"depth": depth, "error": f"timed out after {args.timeout}s", "wall_s": wall, "log": log.name}
  if proc.returncode or not rows:
    lines = [l for l in lines if l.strip()]
    why = [l for l in lines if l.startswith("temoe")][-2:] or [l for l in lines if "rror" in l][-3:] or lines[-5:]
    return {"depth": depth, "error": " | ".join(why)[-1500:], "wall_s": wall, "log": log.name}
  return {**rows[-1], "wall_s": wall}


def extrapolate(a: dict, b: dict, full: int) -> dict:
  """The full-depth run from two depths: each figure f at depth a plus (full - a) marginal layers (f_b - f_a)/(b - a)."""
  da, db = a["depth"], b["depth"]

  def at_full(x, y):
    return None if x is None or y is None else x + (full - da) * (y - x) / (db - da)

  stages = {s: at_full(a["stages_ms"].get(s, 0.0), b["stages_ms"].get(s, 0.0)) for s in STAGES}
  collectives = []
  by_kind = {(c["kind"], c["async"]): c for c in a["collectives"]}
  for c in b["collectives"]:
    x = by_kind.get((c["kind"], c["async"]), {"count": 0, "overlapped_ms": 0.0, "ops_between": 0})
    priced = c["overlapped_ms"] is not None and x["overlapped_ms"] is not None
    collectives.append({"kind": c["kind"], "async": c["async"],
                        "overlapped_ms": at_full(x["overlapped_ms"], c["overlapped_ms"]),
                        "count": round(at_full(x["count"], c["count"])),
                        "per_moe_layer": {"count": (c["count"] - x["count"]) / (db - da),
                                          "overlapped_ms": (c["overlapped_ms"] - x["overlapped_ms"]) / (db - da)
                                          if priced else None}})
  return {"step_ms": at_full(a["step_ms"], b["step_ms"]), "stages_ms": stages, "collectives": collectives,
          "marginal_moe_layer_ms": (b["step_ms"] - a["step_ms"]) / (db - da)}


def run(args, overrides: list[str]) -> dict:
  a, b, full, dense = depths_of(args.config, overrides, args.layers, args.devices, args.slices)
  workdir = tempfile.mkdtemp(prefix="one_rank-")
  measured = [run_depth(args, overrides, d, workdir) for d in (a, b)]
  config = os.path.relpath(os.path.abspath(args.config), ROOT)
  flags = (os.environ.get("XLA_FLAGS", "") if args.cpu else
           f"{profile_env(dict(os.environ)).get('XLA_FLAGS', '')} {MOCK_XLA_FLAGS}".strip())
  entry = {"config": config, "devices": args.devices, "slices": args.slices, "overrides": overrides,
           "mock_topology": None if args.cpu else topology(args.devices, args.slices),
           "routing_counts": "exchanged (host devices)" if args.cpu else
           "every peer's taken as this rank's own (integer all-gathers return the local operand per peer: "
           "own_counts_for_peers); mocked collectives move no data",
           "platform": "cpu (host devices)" if args.cpu else "gpu (mocked NCCL)",
           "mock_changes": [] if args.cpu else MOCK_NOTES,
           "command": " ".join(["python", "bench/one_rank.py", *sys.argv[1:]]), "xla_flags": flags,
           "measured": measured,
           "depth": {"measured_layers": [a, b], "full_layers": full, "dense_layers": dense,
                     "note": f"measured at {a} and {b} decoder layers; full depth {full} extrapolated by the marginal "
                             "MoE decoder layer (t_b - t_a) / (b - a)"}}
  errors = [m for m in measured if "error" in m]
  if errors:
    entry["error"] = "; ".join(f"depth {m['depth']}: {m['error']}" for m in errors)
    entry["layout"] = None
    return entry
  entry.update(extrapolate(measured[0], measured[1], full))
  entry["layout"] = measured[1]["layout"]
  entry["peak_hbm_gib"] = measured[1]["peak_hbm_gib"]
  entry["peak_hbm_note"] = f"measured at {b} layers (not extrapolated: the peak is one layer's working set on top of " \
                           "the resident state, which grows by one layer's weights and optimizer state a layer)"
  return entry


def merge(path: pathlib.Path, entry: dict) -> dict:
  """OUT/one_rank.json with `entry` in place of the run of the same config, devices, slices and settings."""
  data = json.loads(path.read_text()) if path.exists() else {"runs": []}
  key = (entry["config"], entry["devices"], entry["slices"], entry["overrides"], entry["platform"])
  data["runs"] = [r for r in data["runs"]
                  if (r["config"], r["devices"], r.get("slices"), r.get("overrides"), r.get("platform")) != key]
  data["runs"].append(entry)
  return data


def report(entry: dict) -> list[str]:
  """The run as lines: per-rank step and stages at full depth, peak HBM, the collectives' schedule."""
  head = (f"one rank of {entry['config']} on {entry['devices']} devices ({entry['slices']} slices), "
          f"{entry['platform']}")
  if "error" in entry:
    return [head, f"  not measured: {entry['error']}"]
  depth = entry["depth"]
  lines = [head, f"  layout {entry['layout']}; {depth['note']}",
           f"  step {entry['step_ms']:.1f} ms per rank (network mocked: free), marginal MoE layer "
           f"{entry['marginal_moe_layer_ms']:.2f} ms"]
  lines += [f"    {s:<12} {entry['stages_ms'][s]:10.2f} ms" for s in STAGES]
  if entry.get("peak_hbm_gib") is not None:
    lines.append(f"  peak HBM {entry['peak_hbm_gib']:.2f} GiB ({entry['peak_hbm_note']})")
  for c in entry["collectives"]:
    over = "n/a" if c["overlapped_ms"] is None else f"{c['overlapped_ms']:.2f} ms"
    lines.append(f"  {c['kind']:<18} {'async' if c['async'] else 'sync ':<5} x{c['count']:<5} compute between "
                 f"start and done: {over}")
  return lines


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--worker" not in argv and "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the parent only reads configs: the GPU is the workers'
    PARENT_ONLY.add("XLA_PYTHON_CLIENT_PREALLOCATE")
  try:
    args, overrides = parse(argv)
    if args.worker:
      depth, rundir = args.worker.split(":", 1)
      worker(args, overrides, int(depth), rundir)
      return 0
    if not args.cpu and not have_gpu():
      raise Refused("no GPU here: the mocked job needs one real GPU (or pass --cpu for host devices, tiny configs)")
    entry = run(args, overrides)
  except Refused as exc:
    print(f"one_rank: {exc}", file=sys.stderr)
    return 2
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / "one_rank.json"
  path.write_text(json.dumps(merge(path, entry), indent=1) + "\n")
  print("\n".join(report(entry)))
  print(f"wrote {path}")
  return 1 if "error" in entry else 0


if __name__ == "__main__":
  sys.exit(main())
