"""`temoe profile <config.yml> [key=value ...]`: a few training steps under MaxText's own profiler
(`profiler=xplane`), and the step time split into attention, router, dispatch, experts (grouped
GEMMs), combine, collectives, dense (GEMMs outside those: MLPs, shared experts, logits), optimizer,
other and idle, read from the trace.

Each device op in the trace names its HLO instruction; the HLO module stored in the trace (read with
xprof) gives the instruction's opcode and its JAX op_name, which holds the named scopes of the code
that emitted it. Collectives are classified by opcode; everything else by the innermost temoe scope
in its op_name: temoe_router/_dispatch/_experts/_combine (the MoE block's own), and, in the
profiling process only, the same names around MaxText's native MoE methods (GateLogit, get_topk,
permute, unpermute, the rest of sparse_matmul) plus temoe_attention (its attention layers) and
temoe_optimizer (gradient clipping, optimizer update): MaxText 0.2.5 names no scopes there. The
persistent compilation cache is off for the run: its key ignores op metadata, so a cached
executable would carry names from another compile.
Ops that overlap (CPU threads, GPU streams) share their time; collectives count only while no
compute op runs (exposed communication), so the categories add up to the device's step time.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile

from temoe import oneline
from temoe.maxtext import scopes
from temoe.tools import flops

SCOPES = {
    "temoe_attention": "attention",
    "temoe_router": "router",
    "temoe_dispatch": "dispatch",
    "temoe_experts": "experts",
    "temoe_combine": "combine",
    "temoe_optimizer": "optimizer",
}
CATEGORIES = ("attention", "router", "dispatch", "experts", "combine", "collectives", "dense", "optimizer", "other",
              "idle")
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Async XLA Ops", "Steps", "Framework Ops", "Framework Name Scope",
                 "XLA TraceMe")
"""Timelines xprof derives from the kernels (copies of their time): left out where a trace holds them."""
CONTAINERS = ("while", "conditional", "call")
"""Control flow whose events span the ops it runs (on other threads too): their time is the children's."""
COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_SCOPE = re.compile(r"\b(" + "|".join(SCOPES) + r")\b")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_GEMM_TARGET = re.compile(r"gemm|matmul", re.I)  # cuBLAS(Lt) GEMMs, TE's te_gemm_ffi
_GEMM_FUSION = re.compile(r"__triton_gemm|__cudnn\$fusion|__cublas")


def classify(op_name: str, opcode: str, hlo_op: str = "") -> str:
  """Category of one HLO instruction: collectives by opcode (or name), else its innermost scope;
  unscoped GEMMs (opcode `dot`, `custom-call:<GEMM target>`, `fusion:gemm`) are `dense`."""
  for kind in (opcode, re.sub(r"\.\d+$", "", hlo_op)):
    if kind.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
      return "collectives"
  scopes = _SCOPE.findall(op_name)
  if scopes:
    return SCOPES[scopes[-1]]
  kind, _, target = opcode.partition(":")
  if kind == "dot" or (kind == "custom-call" and _GEMM_TARGET.search(target)) or (kind == "fusion" and target == "gemm"):
    return "dense"
  return "other"


def hlo_instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
  """instruction name -> (opcode, op_name) from an HLO module's text (with metadata); custom calls'
  opcodes carry their target (`custom-call:__cublas$gemm`), GEMM fusions read `fusion:gemm`."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      meta, opcode = _OP_NAME.search(line), m.group(2)
      if opcode == "custom-call":
        target = _TARGET.search(line)
        opcode = f"custom-call:{target.group(1) if target else ''}"
      elif opcode == "fusion" and _GEMM_FUSION.search(line):
        opcode = "fusion:gemm"
      out[m.group(1)] = (opcode, meta.group(1) if meta else "")
  return out


def hlo_modules(xplane: str) -> dict[str, dict[str, tuple[str, str]]]:
  """'module(program_id)' -> its instructions, for the HLO modules xprof finds in the trace.

  xprof writes each module as <module>(<id>).hlo_proto.pb beside the trace it reads, and two traces
  of one program share those names: it reads the trace through a link in a folder of its own, so a
  trace beside another (two runs' traces brought back into one folder) is read with its own modules."""
  from xprof.convert import raw_to_tool_data  # pylint: disable=import-outside-toplevel

  alone = os.path.join(tempfile.mkdtemp(prefix="temoe-trace-"), os.path.basename(xplane))
  os.symlink(os.path.abspath(xplane), alone)
  xplane = alone
  raw_to_tool_data.xspace_to_tool_names([xplane])
  out = {}
  for path in glob.glob(os.path.join(os.path.dirname(xplane), "*.hlo_proto.pb")):
    name = os.path.basename(path).removesuffix(".hlo_proto.pb")
    options = {"module_name": name, "type": "long_txt", "node_name": "", "show_metadata": 1}
    text, _ = raw_to_tool_data.xspace_to_tool_data([xplane], "graph_viewer", {"graph_viewer_options": options})
    out[name] = hlo_instructions(text.decode() if isinstance(text, bytes) else text or "")
  return out


def device_ops(xplane: str) -> dict[str, list[tuple]]:
  """device -> [(start_ns, end_ns, line, module, program_id, run_id, hlo_op)] of the XLA ops.

  GPU traces: the /device:GPU:n planes (kernels; the host's thunk launches are left out).
  CPU traces: the /host:CPU plane's thunks, one device per `device_ordinal`.
  """
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel

  planes = list(ProfileData.from_file(xplane).planes)
  gpus = [p for p in planes if p.name.startswith("/device:GPU")]
  out = collections.defaultdict(list)
  for plane in gpus or [p for p in planes if p.name == "/host:CPU"]:
    for i, line in enumerate(plane.lines):
      if line.name in DERIVED_LINES:
        continue
      for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" in stats and "hlo_module" in stats:
          device = plane.name if gpus else f"cpu:{stats.get('device_ordinal', 0)}"
          program = stats.get("program_id")
          out[device].append((event.start_ns, event.end_ns, f"{plane.name}#{i}", str(stats["hlo_module"]),
                              None if program is None else str(program), stats.get("run_id"), str(stats["hlo_op"])))
  return out


def progress(items, desc: str):
  """tqdm where installed, else a plain stderr counter (long traces, many plots)."""
  try:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel

    yield from tqdm(items, desc=desc, file=sys.stderr)
  except ImportError:
    for i, item in enumerate(items):
      print(f"\r{desc}: {i + 1}/{len(items)}", end="", file=sys.stderr, flush=True)
      yield item
    print(file=sys.stderr)


def _leaf_segments(events):
  """Cuts events nested on one line (a thunk around its children): only the innermost one runs."""
  out, stack = [], []  # stack entries: [resume time, end, key]

  def close(upto):
    while stack and stack[-1][1] <= upto:
      resume, end, key = stack.pop()
      if end > resume:
        out.append((resume, end, key))
      if stack:
        stack[-1][0] = max(stack[-1][0], end)

  for start, end, key in sorted(events, key=lambda e: (e[0], -e[1])):
    close(start)
    if stack:
      if start > stack[-1][0]:
        out.append((stack[-1][0], start, stack[-1][2]))
      stack[-1][0] = max(stack[-1][0], start)
    stack.append([start, end, key])
  close(float("inf"))
  return out


def attribute(segments, is_collective) -> dict:
  """Time (ns) per key over all lines: concurrent compute shares an instant equally; collectives
  get an instant only when no compute runs; instants with nothing running are idle."""
  points = sorted([(s, 1, k) for s, _, k in segments] + [(e, -1, k) for _, e, k in segments], key=lambda p: p[:2])
  active, spent, last = collections.Counter(), collections.defaultdict(float), None
  for t, delta, key in points:
    if last is not None and t > last and active:
      compute = [k for k in active if not is_collective(k)]
      share = compute or list(active)
      weight = sum(active[k] for k in share)
      for k in share:
        spent[k] += (t - last) * active[k] / weight
    active[key] += delta
    if active[key] == 0:
      del active[key]
    last = t
  return spent


def _device_breakdown(ops, modules, steps):
  """(steps, ns per step by category and by op, op -> (category, op_name, found in HLO)) for one device."""
  n = len({op[5] for op in ops if op[5] is not None}) or steps or 1
  info, lines = {}, collections.defaultdict(list)
  for start, end, line, mod, program, _, hlo_op in ops:
    hlo = modules.get(f"{mod}({program})") or next((v for k, v in modules.items() if k.startswith(mod + "(")), {})
    opcode, op_name = hlo.get(hlo_op, ("", ""))
    if opcode not in CONTAINERS:
      info[(mod, hlo_op)] = (classify(op_name, opcode, hlo_op), op_name, hlo_op in hlo)
      lines[line].append((start, end, (mod, hlo_op)))
  segments = [seg for events in lines.values() for seg in _leaf_segments(events)]
  spent = {k: ns / n for k, ns in attribute(segments, lambda k: info[k][0] == "collectives").items()}
  totals = collections.defaultdict(float)
  for key, ns in spent.items():
    totals[info[key][0]] += ns
    totals["unmatched"] += 0.0 if info[key][2] else ns
  totals["idle"] = (max(op[1] for op in ops) - min(op[0] for op in ops)) / n - sum(spent.values())
  totals["collectives_total"] = sum(e - s for s, e, k in segments if info[k][0] == "collectives") / n
  return n, totals, spent, info


def breakdown(xplane: str, steps: int | None = None, module: str = "train_step", modules: dict | None = None) -> dict:
  """Per-step ms by category (averaged over devices), from one .xplane.pb of a training run; the HLO modules
  from the trace (xprof), or `modules` (name -> hlo_instructions, e.g. from XLA's dump: dumped_modules)."""
  modules, per_device = hlo_modules(xplane) if modules is None else modules, device_ops(xplane)
  names = collections.Counter(op[3] for ops in per_device.values() for op in ops)
  wanted = {m for m in names if module in m} or ({names.most_common(1)[0][0]} if names else set())
  totals, top, info, seen = collections.defaultdict(float), collections.defaultdict(float), {}, []
  for ops in progress(list(per_device.values()), "temoe profile: devices"):
    ops = [op for op in ops if op[3] in wanted]
    if ops:
      n, device_totals, spent, device_info = _device_breakdown(ops, modules, steps)
      seen.append(n)
      info.update(device_info)
      for key, ns in device_totals.items():
        totals[key] += ns / 1e6
      for key, ns in spent.items():
        top[key] += ns / 1e6
  devices = max(len(seen), 1)
  ms = {c: totals[c] / devices for c in CATEGORIES}
  step_ms = sum(ms.values())
  return {
      "trace": xplane,
      "modules": sorted(wanted),
      "devices": len(seen),
      "steps": seen[0] if seen else 0,
      "step_ms": step_ms,
      "ms_per_step": ms,
      "share": {c: (v / step_ms if step_ms else 0.0) for c, v in ms.items()},
      "idle_fraction": ms["idle"] / step_ms if step_ms else 0.0,  # GPU idle / step time
      "collectives_total_ms": totals["collectives_total"] / devices,  # exposed or hidden under compute
      "unmatched_ms": totals["unmatched"] / devices,  # ops whose HLO instruction the trace did not hold
      "top_ops": [
          {"hlo_op": k[1], "category": info[k][0], "ms_per_step": v / devices, "op_name": info[k][1]}
          for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:20]
      ],
  }


def dumped_hlo(dump_dir: str, module: str = "train_step") -> str:
  """The optimized HLO text of the largest module named like `module` in an XLA dump (--xla_dump_to with
  --xla_dump_hlo_as_text): what ran, scheduled, with op_name metadata."""
  found = [f for f in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")) if module in os.path.basename(f)]
  if not found:
    raise FileNotFoundError(f"temoe profile: no optimized HLO of a {module} module under {dump_dir}")
  with open(max(found, key=os.path.getsize), encoding="utf-8") as f:
    return f.read()


def dumped_modules(dump_dir: str, module: str = "train_step") -> dict[str, dict[str, tuple[str, str]]]:
  """breakdown's `modules` from an XLA dump instead of the trace (where xprof is not installed)."""
  text = dumped_hlo(dump_dir, module)
  name = re.search(r"^HloModule\s+([^\s,]+)", text, re.M)
  return {f"{name.group(1) if name else module}(dump)": hlo_instructions(text)}


def dump_flags(dump_dir: str, module: str = "train_step") -> str:
  """XLA_FLAGS that dump the optimized HLO of the modules named like `module` as text into `dump_dir`."""
  return f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*{module}.*"


def op_ms(xplane: str, steps: int | None = None, module: str = "train_step", modules: dict | None = None) -> dict:
  """HLO instruction name -> its device time per step on the trace's first device (containers left out: their
  events span their children), summed over its runs: what tools.hlo_schedule prices overlap with."""
  per_device = device_ops(xplane)
  device = min((d for d, ops in per_device.items() if any(module in op[3] for op in ops)), default=None)
  if device is None:
    return {}
  ops = [op for op in per_device[device] if module in op[3]]
  n = len({op[5] for op in ops if op[5] is not None}) or steps or 1
  skip = {name for insts in (modules or {}).values() for name, (opcode, _) in insts.items() if opcode in CONTAINERS}
  lines = collections.defaultdict(list)
  for start, end, line, _, _, _, hlo_op in ops:
    if hlo_op not in skip:
      lines[line].append((start, end, hlo_op))
  out = collections.defaultdict(float)
  for events in lines.values():
    for start, end, hlo_op in _leaf_segments(events):
      out[hlo_op] += (end - start) / n / 1e6
  return dict(out)


def latest_trace(path: str) -> str:
  """The newest .xplane.pb at or under `path` (a run directory, a profile directory, or the file)."""
  if path.endswith(".xplane.pb"):
    return path
  found = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
  if not found:
    raise FileNotFoundError(f"temoe profile: no .xplane.pb under {path}")
  return max(found, key=os.path.getmtime)


def table(result: dict) -> str:
  lines = [f"{'category':<12} {'ms/step':>10} {'share':>7}"]
  for c in CATEGORIES:
    lines.append(f"{c:<12} {result['ms_per_step'][c]:>10.3f} {100 * result['share'][c]:>6.1f}%")
  lines.append(f"{'step':<12} {result['step_ms']:>10.3f} {100.0:>6.1f}%")
  return "\n".join(lines)


def _maxtext_step_ms(metrics_file: str, first: int, count: int) -> float | None:
  if not os.path.exists(metrics_file):
    return None
  rows = [json.loads(line) for line in open(metrics_file, encoding="utf-8") if line.strip()]
  times = [r["perf/step_time_seconds"] for r in rows if first <= r["step"] < first + count]
  return 1e3 * statistics.median(times) if times else None


def profile_run(config: str, overrides: list[str], out: str, skip: int, steps: int, gpu: str | None,
                hlo_dir: str | None = None) -> dict:
  """Trains `skip + steps` steps of `config` in this process with the last `steps` traced; with `hlo_dir`,
  XLA dumps the step's optimized HLO there and the breakdown reads its instructions from it (no xprof)."""
  from temoe import cli  # pylint: disable=import-outside-toplevel
  from temoe import hardware  # pylint: disable=import-outside-toplevel

  out = os.path.abspath(out)
  os.makedirs(out, exist_ok=True)  # MaxText opens metrics_file in it without creating it
  args = [config, *overrides, f"base_output_directory={os.path.dirname(out)}", f"run_name={os.path.basename(out)}",
          "profiler=xplane", f"skip_first_n_steps_for_profiler={skip}", f"profiler_steps={steps}",
          f"steps={skip + steps}", "profile_cleanly=true", f"metrics_file={os.path.join(out, 'metrics.jsonl')}"]
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_enable_command_buffer" not in flags:  # kernels replayed from CUDA graphs may lose their HLO op
    flags = f"{flags} --xla_gpu_enable_command_buffer="
  if hlo_dir:
    flags = f"{flags} {dump_flags(hlo_dir)}"
  os.environ["XLA_FLAGS"] = flags.strip()
  import jax  # pylint: disable=import-outside-toplevel

  jax.config.update("jax_enable_compilation_cache", False)  # its key ignores op metadata: scopes would be lost
  scopes.scope_maxtext()
  rc = cli.train(args)
  if rc:
    raise SystemExit(rc)
  result = breakdown(latest_trace(out), steps, modules=dumped_modules(hlo_dir) if hlo_dir else None)
  result["maxtext_step_ms"] = _maxtext_step_ms(os.path.join(out, "metrics.jsonl"), skip, steps)
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  count = flops.summary(introspect.initialize_config(["profile", *args]), hardware.detect().device_kind, gpu)
  achieved = count["model_tflops_per_step_per_device"] / (result["step_ms"] / 1e3)
  count["model_tflops_per_s_per_device"] = achieved
  count["mfu"] = achieved / count["peak_tflops"] if count["peak_tflops"] else None
  result.update(command=" ".join(["temoe", "profile", config, *overrides]), flops=count)
  return result


def argument_problem(args) -> str | None:
  """Why `temoe profile` cannot run with these arguments (one line), or None; before MaxText starts."""
  if args.steps < 1 or args.skip < 0:
    return f"--steps={args.steps} must be at least 1 and --skip={args.skip} at least 0"
  if args.trace:
    return None if os.path.exists(args.trace) else f"--trace {args.trace} does not exist"
  if not args.config or not args.config.endswith((".yml", ".yaml")):
    return None  # usage
  from temoe.run import inputs  # pylint: disable=import-outside-toplevel

  try:
    inputs.check_config_file(args.config)
    inputs.check_settings(args.overrides, "temoe profile <config.yml> [key=value ...] [--steps N] [--skip N]")
  except inputs.InputError as exc:
    return str(exc)
  return None


def main(argv: list[str] | None = None) -> int:
  parser = oneline.ArgumentParser(prog="temoe profile", description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("config", nargs="?", help="MaxText config (.yml); or use --trace")
  parser.add_argument("overrides", nargs="*", help="MaxText key=value overrides")
  parser.add_argument("--out", default=None, help="run directory (default runs/profile-<config>)")
  parser.add_argument("--skip", type=int, default=3, help="steps before the trace (compilation, warm-up)")
  parser.add_argument("--steps", type=int, default=3, help="steps traced")
  parser.add_argument("--gpu", choices=sorted(k.lower() for k in flops.PEAK_TFLOPS),
                      help="peak table row for MFU (default: from the device)")
  parser.add_argument("--trace", help="only analyse this run directory or .xplane.pb")
  args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
  problem = argument_problem(args)
  if problem:
    print(f"temoe profile: {problem}", file=sys.stderr)
    return 2
  if args.trace:
    try:
      trace = latest_trace(args.trace)
      result = breakdown(trace, args.steps)
    except FileNotFoundError as exc:
      print(str(exc), file=sys.stderr)
      return 2
    except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
      oneline.print_traceback(exc)
      print(f"temoe profile: --trace {trace} is not a profile JAX can read ({oneline.first_line(exc, 200)})",
            file=sys.stderr)
      return 2
    out = args.out or os.path.dirname(trace)
  elif args.config and args.config.endswith((".yml", ".yaml")):
    name = os.path.splitext(os.path.basename(args.config))[0]
    out = args.out or os.path.join("runs", f"profile-{name}")
    result = profile_run(args.config, args.overrides, out, args.skip, args.steps, args.gpu)
  else:
    parser.print_usage(sys.stderr)
    return 2
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "profile.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print(f"temoe profile: {result['steps']} step(s) of {', '.join(result['modules'])} on {result['devices']} device(s)")
  print(table(result))
  if result["unmatched_ms"] > 0.05 * result["step_ms"]:
    print(f"warning: {result['unmatched_ms']:.3f} ms/step of ops had no HLO instruction in the trace: counted as other")
  if "flops" in result:
    f = result["flops"]
    mfu = f"{100 * f['mfu']:.1f}% of {f['gpu']} peak {f['peak_tflops']:.0f}" if f["mfu"] is not None else "n/a"
    print(f"model TFLOP/s/device {f['model_tflops_per_s_per_device']:.4g}, MFU {mfu}")
  print(f"wrote {os.path.join(out, 'profile.json')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
