"""A process that imports temoe and MaxText once (~9 CPU-s a training process would pay again), then forks one
`temoe train` per request: each run is still a process of its own (its pid, signals, exit code, JAX backend and
device count, environment, working directory, log file), forked before any JAX backend or thread exists.

Protocol (JSON lines): once its imports are done it says {"ready": pid, "cpu_s": what they cost}; a request {"id",
"args", "env", "cwd", "log"} on stdin is answered {"id", "pid"} (with "code": the child runs that program as
`python -c code args` would, instead of `temoe`'s; with "err": its stderr goes to that file, not to the log); each
child's end is reported {"pid", "code", "cpu_s"} (Popen's returncode: negative for a signal; the child's user+system
CPU seconds, its own and its waited-for children's, from wait4's rusage: they are the server's children, not the
test's, so the test's own CPU count would miss them). EOF on stdin ends the server.
tests/runs.py starts the session's training runs through it. Variables JAX reads when it is imported (JAX_*
config defaults) are the server's, but for JAX_PLATFORMS, set again in the child; those read when a run starts
(XLA_FLAGS, SLURM_*, JAX_COORDINATOR_ADDRESS, M_*, TEMOE_*) are the run's own.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import select
import sys

PRELOAD = ("temoe.cli", "temoe.maxtext", "temoe.run.preflight", "temoe.run.preemption", "maxtext.configs.pyconfig",
           "maxtext.trainers.pre_train.train")


def run_child(request: dict) -> None:
  """In the forked child: becomes `python -m temoe.cli <args>` (or `python -c <code> <args>`) with the request's
  environment and log; exits as that program does (sys.exit, so the interpreter shuts down as a fresh process's
  would)."""
  from temoe import cli  # pylint: disable=import-outside-toplevel

  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  if "JAX_PLATFORMS" in os.environ:  # read when JAX was imported: the run's own setting, before its backend exists
    import jax  # pylint: disable=import-outside-toplevel

    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
  log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if "err" in request else log
  null = os.open(os.devnull, os.O_RDONLY)
  for fd, target in ((null, 0), (log, 1), (err, 2)):
    os.dup2(fd, target)
  for fd in {log, err, null}:
    os.close(fd)
  if "code" in request:
    sys.argv = ["-c", *request["args"]]
    exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
    sys.exit(0)
  sys.argv = [cli.__file__, *request["args"]]
  sys.exit(cli.main())


def reap() -> None:
  while True:
    try:
      pid, status, usage = os.wait4(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    print(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status),
                      "cpu_s": usage.ru_utime + usage.ru_stime}), flush=True)


def serve() -> None:
  from temoe.run import pygc  # pylint: disable=import-outside-toplevel

  pygc.configure()  # the collector's settings `temoe train` runs with, for the imports too
  for name in PRELOAD:
    importlib.import_module(name)
  pygc.freeze_imports()  # no child walks them again
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

  assert not xla_bridge._backends, "a JAX backend exists before the fork"  # pylint: disable=protected-access
  usage = resource.getrusage(resource.RUSAGE_SELF)  # the imports' cost, counted once, in the test that started it
  print(json.dumps({"ready": os.getpid(), "cpu_s": usage.ru_utime + usage.ru_stime}), flush=True)
  pending = b""
  while True:
    if select.select([0], [], [], 0.01)[0]:
      data = os.read(0, 1 << 16)
      if not data:
        return
      pending += data
      while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
          run_child(request)  # never returns: SystemExit ends the child
        print(json.dumps({"id": request["id"], "pid": pid}), flush=True)
    reap()


if __name__ == "__main__":
  serve()
