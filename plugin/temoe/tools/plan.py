"""`temoe plan <config.yml> [key=value ...]`: per-device HBM estimate of a training run, and whether
it fits, before anything is launched. Exit code 0: fits; 1: does not fit; 2: bad input.

The config is built by MaxText's pyconfig exactly as `temoe train` builds it, for the device count
of the target (MaxText's internal_compile_num_devices sets it without the devices), and estimated by
`temoe.tools.hbm` on an abstract mesh: nothing is compiled or allocated, so a GPU run plans on a laptop.
Without a GPU here, temoe's recipe checks see the GPU named by --gpu (an H200 unless told).
"""

from __future__ import annotations

import argparse
import os
import sys

from temoe import hardware, oneline
from temoe.tools.planner import (  # noqa: F401  (re-exported: callers plan through this module)
    MAX_DEVICES, MAX_HBM_GIB, STAND_IN_CUBLAS, STATELESS_TE_QUANTIZATION, TOLERANCE, Plan, PlanInputError,
    abstract_mesh, build_config, explicit_devices, make_plan, mesh_split, platform_seen_as, target)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = oneline.ArgumentParser(prog="temoe plan", description=__doc__.splitlines()[0])
  parser.add_argument("config", help="MaxText config YAML (as for temoe train)")
  parser.add_argument("--hbm-gib", type=float, help="device memory to fit in (default: this GPU's, else --gpu's)")
  parser.add_argument("--devices", type=int, help="devices of the run (default: the config's explicit mesh, or here)")
  parser.add_argument("--slices", type=int, help="slices of the run (MaxText's num_slices; a GPU node is one)")
  parser.add_argument("--gpu", choices=sorted(hardware.GPUS), default="h200", help="target GPU when this host has none")
  parser.add_argument("--sweep", action="store_true", help="plan every layout of --devices and --slices (tensor, "
                      "pipeline, expert, FSDP, data parallelism; exchange, chunks) and rank those that fit by predicted "
                      "tokens/s (temoe.tools.sweep)")
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if "=" not in a or a.startswith("-")]
  if bad:
    raise PlanInputError(f"unknown arguments {' '.join(bad)}; pass MaxText settings as key=value")
  if not args.config.endswith((".yml", ".yaml")) or not os.path.isfile(args.config):
    why = "no .yml" if not args.config.endswith((".yml", ".yaml")) else "no such file"
    raise PlanInputError(f"{args.config} is not a config YAML file ({why})")
  from temoe.run import inputs  # pylint: disable=import-outside-toplevel

  try:
    inputs.check_config_file(args.config)
    inputs.check_settings(rest, "temoe plan <config.yml> [key=value ...] [--devices N] [--slices N]")
  except inputs.InputError as exc:
    raise PlanInputError(str(exc)) from exc
  if args.hbm_gib is not None and not 0 < args.hbm_gib <= MAX_HBM_GIB:
    raise PlanInputError(f"--hbm-gib={args.hbm_gib} must be a positive number of GiB, finite and at most {MAX_HBM_GIB:g}")
  for flag in ("devices", "slices"):
    if getattr(args, flag) is not None and not 1 <= getattr(args, flag) <= MAX_DEVICES:
      raise PlanInputError(f"--{flag}={getattr(args, flag)} must be at least 1 and at most {MAX_DEVICES:,}")
  if args.sweep and not args.devices:
    raise PlanInputError("--sweep plans layouts of a job: pass its --devices N (and --slices S)")
  if args.slices:
    rest.append(f"num_slices={args.slices}")
  return args, rest


def table(p: Plan) -> str:
  """The estimate as a table, in GiB (MiB below 1 GiB) per device."""
  config, mesh, est = p.config, p.mesh, p.estimate
  unit, size = ("GiB", 2**30) if est.peak >= 2**30 else ("MiB", 2**20)
  axes = " ".join(f"{k}={v}" for k, v in dict(mesh.shape).items() if v > 1) or "no parallel axes"
  block = f"MaxText's MoE ({'grouped GEMM' if p.backend == 'gmm' else 'ragged_dot'})"
  if config.te_moe_block:
    block = f"temoe {p.backend} backend, {config.te_gmm_quantization}"
  rows = [("component", f"{unit}/device", "")]
  rows += [(part.name, f"{part.bytes / size:.2f}", part.note) for part in est.resident]
  rows += [(part.name + (" <- peak" if part is est.transient else ""), f"{part.bytes / size:.2f}", part.note)
           for part in est.layers]
  rows += [("peak estimate", f"{est.peak / size:.2f}", "resident rows + the largest transient (<- peak)")]
  if est.host:
    rows += [("(on host, not HBM)", f"{est.host / size:.2f}", "state MaxText offloads to pinned host memory")]
  rows += [("device HBM", f"{p.hbm_gib * 2**30 / size:.2f}", p.hbm_source)]
  width = max(len(r[0]) for r in rows)
  head = (f"temoe plan: {config.model_name}, {mesh.size} device(s) ({axes}), {block}, "
          f"batch {config.per_device_batch_size}/device x {config.max_target_length} tokens, "
          f"remat {config.remat_policy}")
  lines = [head] + [f"  note: {n}" for n in p.notes] + [f"  {name:<{width}}  {value:>10}  {note}" for name, value, note in rows]
  if config.te_moe_block:
    from temoe.tools import exchange_volume  # pylint: disable=import-outside-toplevel

    lines += exchange_volume.summary_lines(config, mesh)
  return "\n".join(lines)


@oneline.guarded("temoe plan")
def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # planning on a GPU takes none of its memory
  try:
    args, overrides = parse(argv)
    from temoe.maxtext import failures  # pylint: disable=import-outside-toplevel

    failures.install_quiet_config_errors()
    if args.sweep:
      from temoe.tools import sweep  # pylint: disable=import-outside-toplevel

      rows = sweep.run(args.config, overrides, args.devices, args.slices or 1, args.gpu, args.hbm_gib, dict(os.environ))
      print("\n".join(sweep.table(rows, args.devices, args.slices or 1)))
      return 0 if any(r.fits for r in rows) else 1
    p = make_plan(args.config, overrides, args.devices, args.gpu, args.hbm_gib)
  except SystemExit as exc:  # argparse: usage already printed
    return 2 if exc.code else 0
  except Exception as exc:  # pylint: disable=broad-exception-caught
    from temoe import cli  # pylint: disable=import-outside-toplevel

    message = str(exc) if isinstance(exc, PlanInputError) else cli.config_error_message(exc)
    if message is None:
      raise
    if "only one slice available" in message or "does not match the product" in message:
      message += " The config is for a larger job: pass its --devices N and --slices N (a GPU node is one slice)."
    print(f"temoe plan: {message}", file=sys.stderr)
    return 2
  if not p.hbm_gib:
    print("temoe plan: cannot read this GPU's memory; pass --hbm-gib", file=sys.stderr)
    return 2
  print(table(p))
  peak = p.estimate.peak / 2**30
  fits = peak <= p.hbm_gib
  verdict = "fits" if fits else "does not fit"
  print(f"{verdict}: {peak:.2f} GiB estimated of {p.hbm_gib:.2f} GiB ({peak / p.hbm_gib:.0%})")
  from temoe.tools import shardings  # pylint: disable=import-outside-toplevel

  unshardable = shardings.refusal(shardings.indivisible(p.estimate.state))
  if unshardable:
    print(f"does not start: {unshardable}; pick parallelisms whose products divide it (temoe plan --sweep skips "
          "such layouts)")
  print("\n".join(step_lines(p)))
  return 0 if fits and not unshardable else 1


def step_lines(p: Plan) -> list[str]:
  """The step-time table (temoe.tools.step_model) for a GPU run; one line why not for a CPU one."""
  if not str(p.config.hardware).startswith("gpu"):
    return [f"step time: not predicted for hardware={p.config.hardware} (the step model prices GPUs)"]
  from temoe.tools import one_rank, step_model  # pylint: disable=import-outside-toplevel

  ici, dcn = mesh_split(p.config, p.mesh.size)
  job = step_model.job_of(p.config, ici, dcn, p.config.num_slices, p.backend, p.quantization, p.estimate)
  lines = step_model.plan_lines(job, p.gpu, dict(os.environ))
  measured = one_rank.find(job, one_rank.load())
  if measured:  # this layout ran on one GPU (bench/one_rank.py): its compute and the schedule's overlap
    calib = step_model.cal.calibration_for(p.gpu)
    modelled = step_model.predict(job, calib, step_model.xla_flags_for(calib.gpu, dict(os.environ))[1])
    lines += ["  with this layout's one-rank measurement (bench/results/one_rank.json):"]
    lines += step_model.table_lines(one_rank.apply(modelled, measured))[1:]
  return lines


if __name__ == "__main__":
  sys.exit(main())
