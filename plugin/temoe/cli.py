"""`temoe` command line. `temoe train <config.yml> key=value ...` takes exactly MaxText's arguments
and runs MaxText's own trainer after `register()`; every other subcommand lives in its own module
(`temoe.<module>.main(argv) -> exit code`), imported only when called.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

from temoe import exits, oneline
from temoe.run import pygc

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


def config_or_message(argv: list[str]):
  """(MaxText's config for `argv`, None), or (None, the one line) for a bad config; MaxText's error block
  is not printed. Other errors are raised."""
  from temoe.maxtext import failures, introspect  # pylint: disable=import-outside-toplevel

  failures.install_quiet_config_errors()
  try:
    return introspect.initialize_config(argv), None
  except Exception as exc:  # pylint: disable=broad-exception-caught
    message = config_error_message(exc)
    if message is None:
      raise
    return None, message


GENERATOR_MASK = "generator didn't stop after throw()"
"""What Python raises when a context manager's generator catches the exception of its block and yields again, as
Transformer Engine's does: MaxText runs the whole training loop inside it, so every GPU failure would read so."""


def unmasked(exc: BaseException) -> BaseException:
  """The exception a context manager's generator hid (GENERATOR_MASK, the block's own one as its context)."""
  while isinstance(exc, RuntimeError) and str(exc) == GENERATOR_MASK and exc.__context__ is not None:
    exc = exc.__context__
  return exc


def training_failure(exc: BaseException) -> tuple[str, int, bool]:
  """(the one line for an exception raised while MaxText trained, the exit code, whether it is one temoe
  does not know, so its traceback is what a bug report needs)."""
  from temoe.maxtext import checkpointing, failures  # pylint: disable=import-outside-toplevel

  exc = unmasked(exc)
  for link in oneline.chain(exc):
    if isinstance(link, failures.TrainingStopped):
      return str(link), link.exit_code, False
  step = failures.progress.get("step")
  where = f"at step {step} of {failures.progress['steps']}" if step is not None else "before its first step"
  err = checkpointing.write_error(exc)
  if err is not None:
    code = exits.REQUEUE if failures.is_transient(err) else exits.NEEDS_PERSON
    return (f"training failed {where}: a write failed ({err.strerror}{': ' + str(err.filename) if err.filename else ''})",
            code, False)
  if any(str(link).startswith("Requested training up to step") for link in oneline.chain(exc)):  # MaxText's own
    return f"the run has finished: {oneline.first_line(exc).split(': ', 1)[1].split(' Did you mean')[0]}", exits.DONE, False
  peer = lost_peer(exc)
  if peer:
    return (f"training failed {where}: {peer} (a lost peer or link; exit {exits.REQUEUE}: a requeue resumes from the "
            "latest checkpoint)", exits.REQUEUE, False)
  return f"training failed {where}: {oneline.first_line(exc)}", exits.FAILED, True


LOST_PEER = ("DEADLINE_EXCEEDED", "UNAVAILABLE:", "Connection reset by peer", "Connection closed by peer",
             "heartbeat timeout", "detected fatal errors", "Gloo")
"""What JAX's coordination service, gRPC and the CPU collectives say when another process of the job is gone."""


def lost_peer(exc: BaseException) -> str | None:
  """The first line of the error in `exc`'s chain that says a peer process or link was lost, or None."""
  for link in oneline.chain(exc):
    if any(marker in str(link) for marker in LOST_PEER):
      return oneline.first_line(link)
  return None


def train(maxtext_args: list[str]) -> int:
  """Runs MaxText's pre-training loop with temoe registered; the exit code is `temoe.exits`'s."""
  if not maxtext_args or not maxtext_args[0].endswith((".yml", ".yaml")):
    print(f"temoe: usage: {TRAIN_USAGE}", file=sys.stderr)
    return exits.NEEDS_PERSON
  import temoe.maxtext  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import  (MaxText's asset root, first)
  from temoe.run import preemption, preflight  # pylint: disable=import-outside-toplevel

  preemption.install()  # a SIGTERM/SIGINT from here to the first step stops at once; later, after a step
  preemption.on_exit(preflight.release)
  try:
    return run_training(maxtext_args)
  finally:
    preemption.uninstall()


def run_training(maxtext_args: list[str]) -> int:
  """`train` past its usage check, with temoe's SIGTERM/SIGINT handling installed."""
  import temoe  # pylint: disable=import-outside-toplevel
  from temoe.run import distributed, inputs, preflight  # pylint: disable=import-outside-toplevel

  try:
    inputs.check_config_file(maxtext_args[0])
    inputs.check_settings(maxtext_args[1:], TRAIN_USAGE)
  except inputs.InputError as exc:
    print(f"temoe: {exc}", file=sys.stderr)
    return exits.NEEDS_PERSON
  maxtext_args, named = inputs.with_stable_run_name(maxtext_args, dict(os.environ))
  if named:
    print(named, flush=True)
  distributed.maybe_initialize()  # a multi-task srun step: join jax.distributed before MaxText starts
  try:
    temoe.register()
    from temoe.maxtext import batches, failures  # pylint: disable=import-outside-toplevel

    failures.install_quiet_config_errors()
    failures.install_train_loop()
    pygc.freeze_imports()  # MaxText, JAX and temoe are imported: what they made lives as long as the process
    config = preflight.check(maxtext_args, lock_run=True)  # values, data, disk, lock, latest checkpoint: before compiling
    batches.install(config)  # every batch's token ids, on the host
    from temoe.run import tokens  # pylint: disable=import-outside-toplevel

    note = tokens.long_rows_note(config)  # rows longer than max_target_length: what MaxText does with them, once
    if note:
      print(note, flush=True)
  except preflight.RunFinished as exc:
    return stop_before_training(str(exc), exits.DONE, distributed.FINISHED)
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    message = config_error_message(exc)
    if message is None:
      oneline.print_traceback(exc)
    return stop_before_training(message or oneline.first_line(exc), exits.NEEDS_PERSON, distributed.FAILED)
  try:
    distributed.agree_before_training(distributed.OK)  # a jax.distributed job: every process's preflight passed
  except distributed.PeerStopped as exc:
    return stop_before_training(str(exc), exits.DONE if exc.kind == distributed.FINISHED else exits.NEEDS_PERSON)
  oneline.quiet_background_errors()
  try:
    from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

    introspect.train(["temoe train", *maxtext_args])
  except SystemExit as exc:
    code = int(exc.code or 0) if not isinstance(exc.code, str) else exits.FAILED
    if code:
      oneline.quiet_after_last_line()
      print(f"temoe: training exited with code {code}{': ' + exc.code if isinstance(exc.code, str) else ''}",
            file=sys.stderr, flush=True)
      oneline.exit_promptly(code)
    return code
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    line, code, unknown = training_failure(exc)
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)  # Orbax's
    oneline.print_traceback(exc)
    if unknown:
      line += f" ({oneline.DEBUG_HINT})"
    oneline.quiet_after_last_line()
    print(f"temoe: {line}", file=sys.stderr, flush=True)
    oneline.exit_promptly(code)  # Orbax's threads of a failed save must not hold the exit
    if lost_peer(exc):  # jax.distributed's shutdown at exit would wait for the lost peer, then abort
      preflight.release()
      sys.stdout.flush()
      os._exit(code)  # pylint: disable=protected-access
    return code
  finally:
    preflight.release()
  return exits.DONE


def stop_before_training(line: str, code: int, kind: str | None = None) -> int:
  """Ends a `temoe train` before MaxText trains: the run lock released, one line, and (`kind` given: this
  process's own preflight ended so) its peers told."""
  from temoe.run import distributed, preflight  # pylint: disable=import-outside-toplevel

  preflight.release()
  print(f"temoe: {line}", file=sys.stderr, flush=True)
  if kind is not None:
    distributed.agree_before_training(kind, line)
  oneline.exit_promptly(code)  # after the peers were told
  return code


def usage() -> str:
  lines = ["usage: temoe <command> [args]   (temoe --debug <command> ... or TEMOE_DEBUG=1: print tracebacks)", "", "  train     run MaxText's trainer with temoe: temoe train <config.yml> key=value ..."]
  lines += [f"  {name:<9} {doc}" for name, (_, doc) in SUBCOMMANDS.items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  """`temoe [--debug] <command> ...`; --debug (anywhere) sets TEMOE_DEBUG=1: tracebacks are printed."""
  if argv is None:  # the `temoe` program (console script or python -m temoe.cli)
    oneline.as_program()
    pygc.configure()
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--debug" in argv:
    argv.remove("--debug")
    os.environ[oneline.DEBUG_ENV] = "1"
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(usage())
    if not argv:
      print(f"temoe: no command given; valid commands: train, {', '.join(SUBCOMMANDS)}", file=sys.stderr)
    return exits.DONE if argv else exits.NEEDS_PERSON
  command, rest = argv[0], argv[1:]
  if command == "train":  # everything after `train` belongs to MaxText, untouched
    return oneline.guarded("temoe")(train)(rest)
  if command not in SUBCOMMANDS:
    print(f"temoe: unknown command {command!r}; valid commands: train, {', '.join(SUBCOMMANDS)}", file=sys.stderr)
    return exits.NEEDS_PERSON
  return int(oneline.guarded(f"temoe {command}")(lambda: importlib.import_module(SUBCOMMANDS[command][0]).main(rest))()
             or 0)


if __name__ == "__main__":
  sys.exit(main())
