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


def config_error_message(exc: BaseException) -> str | None:
  """The one line a user needs from a config error (temoe's or MaxText's), or None if not one."""
  import pydantic  # pylint: disable=import-outside-toplevel

  if isinstance(exc, pydantic.ValidationError):
    return "; ".join(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}{e['msg']}" for e in exc.errors())
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel
  from temoe import recipes  # pylint: disable=import-outside-toplevel

  if isinstance(exc, (recipes.TemoeConfigError, seams.TemoeSeamError)):
    return str(exc)
  return None


def train(maxtext_args: list[str]) -> int:
  """Runs MaxText's pre-training loop with temoe registered."""
  if not maxtext_args or not maxtext_args[0].endswith((".yml", ".yaml")):
    print("usage: temoe train <config.yml> [key=value ...]  (MaxText's own arguments)", file=sys.stderr)
    return 2
  import temoe  # pylint: disable=import-outside-toplevel
  from temoe.run import distributed  # pylint: disable=import-outside-toplevel

  distributed.maybe_initialize()  # a multi-task srun step: join jax.distributed before MaxText starts
  try:
    temoe.register()
    from temoe.run import preflight  # pylint: disable=import-outside-toplevel

    preflight.check(maxtext_args)  # output dir writable, latest checkpoint readable, before MaxText starts
    from absl import app  # pylint: disable=import-outside-toplevel
    from maxtext.trainers.pre_train import train as maxtext_train  # pylint: disable=import-outside-toplevel

    app.run(maxtext_train.main, argv=["temoe train", *maxtext_args])
  except SystemExit as exc:
    return int(exc.code or 0) if not isinstance(exc.code, str) else 1
  except Exception as exc:  # pylint: disable=broad-exception-caught
    message = config_error_message(exc)
    if message is None:
      raise
    print(f"temoe: {message}", file=sys.stderr)
    return 2
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
