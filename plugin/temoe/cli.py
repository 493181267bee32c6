"""`temoe` command line. `temoe train <config.yml> key=value ...` takes exactly MaxText's arguments
and runs MaxText's own trainer after `register()`; every other subcommand lives in its own module
(`temoe.<module>.main(argv) -> exit code`), imported only when called.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "data": ("temoe.run.data", "write the learnable token stream the CPU configs train on"),
    "env": ("temoe.deploy.env", "print the environment profile (XLA flags, NCCL, CUDA, host offload) per GPU arch"),
    "doctor": ("temoe.deploy.doctor", "check GPU, Transformer Engine, cuBLAS, NCCL, MaxText and its seams"),
    "launch": ("temoe.deploy.launch", "render or submit a job: docker run, Slurm (pyxis/enroot), Kubernetes JobSet"),
    "plan": ("temoe.tools.plan", "per-device HBM estimate for a config and whether it fits, before launch"),
    "profile": ("temoe.tools.profiling", "a few steps under the JAX profiler: step time split by MoE stage"),
    "report": ("temoe.tools.report", "plots and tables of a run directory: loss, throughput, MFU, expert load"),
}
"""name -> (module with main(argv) -> int, one-line help)."""


TRAIN_USAGE = "temoe train <config.yml> [key=value ...]  (MaxText's own arguments)"


def config_error_message(exc: BaseException) -> str | None:
  """The one line a user needs from a config error (temoe's or MaxText's), or None if not one."""
  import pydantic  # pylint: disable=import-outside-toplevel

  if isinstance(exc, pydantic.ValidationError):
    return "; ".join(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}{e['msg']}" for e in exc.errors())
  from temoe import recipes  # pylint: disable=import-outside-toplevel
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel
  from temoe.run import inputs  # pylint: disable=import-outside-toplevel

  if isinstance(exc, (recipes.TemoeConfigError, seams.TemoeSeamError)):
    return str(exc)
  return inputs.unknown_key(exc)


def first_line(exc: BaseException) -> str:
  text = str(exc).strip()
  return f"{type(exc).__name__}: {text.splitlines()[0][:400]}" if text else type(exc).__name__


def chain(exc: BaseException | None):
  """`exc` and its causes/contexts, outermost first."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    yield exc
    exc = exc.__cause__ or exc.__context__


def training_failure(exc: BaseException) -> tuple[str, bool]:
  """(the one line for an exception raised while MaxText trained, whether its traceback helps)."""
  from temoe.maxtext import checkpointing, failures  # pylint: disable=import-outside-toplevel

  for link in chain(exc):
    if isinstance(link, failures.TrainingStopped):
      return str(link), False
  step = failures.progress.get("step")
  where = f"at step {step} of {failures.progress['steps']}" if step is not None else "before its first step"
  err = checkpointing.write_error(exc)
  if err is not None:
    return f"training failed {where}: a write failed ({err.strerror}{': ' + str(err.filename) if err.filename else ''})", False
  return f"training failed {where}: {first_line(exc)}", True


def train(maxtext_args: list[str]) -> int:
  """Runs MaxText's pre-training loop with temoe registered: 0 when every step ran, 1 when not, 2 on bad input."""
  if not maxtext_args or not maxtext_args[0].endswith((".yml", ".yaml")):
    print(f"usage: {TRAIN_USAGE}", file=sys.stderr)
    return 2
  import traceback  # pylint: disable=import-outside-toplevel

  import temoe  # pylint: disable=import-outside-toplevel
  import temoe.maxtext  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import  (MaxText's asset root, first)
  from temoe.run import distributed, inputs, preflight  # pylint: disable=import-outside-toplevel

  try:
    inputs.check_config_file(maxtext_args[0])
    inputs.check_settings(maxtext_args[1:], TRAIN_USAGE)
  except inputs.InputError as exc:
    print(f"temoe: {exc}", file=sys.stderr)
    return 2
  distributed.maybe_initialize()  # a multi-task srun step: join jax.distributed before MaxText starts
  try:
    temoe.register()
    from temoe.maxtext import failures  # pylint: disable=import-outside-toplevel

    failures.install_quiet_config_errors()
    failures.install_train_loop()
    preflight.check(maxtext_args, lock_run=True)  # values, data, disk, run lock, latest checkpoint: before compiling
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    preflight.release()
    print(f"temoe: {config_error_message(exc) or first_line(exc)}", file=sys.stderr)
    return 2
  try:
    from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

    introspect.train(["temoe train", *maxtext_args])
  except SystemExit as exc:
    code = int(exc.code or 0) if not isinstance(exc.code, str) else 1
    if code:
      print(f"temoe: training exited with code {code}{': ' + exc.code if isinstance(exc.code, str) else ''}",
            file=sys.stderr)
    return code
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    line, show_traceback = training_failure(exc)
    if show_traceback:
      traceback.print_exc()
    print(f"temoe: {line}", file=sys.stderr, flush=True)
    return 1
  finally:
    preflight.release()
  return 0


def usage() -> str:
  lines = ["usage: temoe <command> [args]", "", "  train     run MaxText's trainer with temoe: temoe train <config.yml> key=value ..."]
  lines += [f"  {name:<9} {doc}" for name, (_, doc) in SUBCOMMANDS.items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(usage())
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command == "train":  # everything after `train` belongs to MaxText, untouched
    return train(rest)
  if command not in SUBCOMMANDS:
    print(f"temoe: unknown command {command!r}; valid commands: train, {', '.join(SUBCOMMANDS)}", file=sys.stderr)
    return 2
  return int(importlib.import_module(SUBCOMMANDS[command][0]).main(rest) or 0)


if __name__ == "__main__":
  sys.exit(main())
