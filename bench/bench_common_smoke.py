"""--smoke runs of the benchmarks, forked: the bench process imports temoe and MaxText once and forks each run from
there (each still a process of its own: its pid, environment, JAX backend and device, exit code and output) instead
of starting a fresh interpreter per run (~12 CPU-s of imports each on the test machine's CPU). Only for --smoke: on
a GPU every run is a fresh process (bench/training_runs.py), so that its allocator peak starts from zero.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable

import training_runs

PRELOAD = ("temoe.cli", "temoe.maxtext", "temoe.maxtext.introspect", "temoe.tools.profiling", "maxtext.configs.pyconfig",
           "maxtext.trainers.pre_train.train")


def forked(target: Callable[[], int | None], env: dict, timeout: int, name: str) -> subprocess.CompletedProcess:
  """`target()` in a child forked from this process, `env` its whole environment; its exit code and output as
  subprocess.run(capture_output=True, text=True) gives them; raises subprocess.TimeoutExpired after `timeout` s."""
  for module in PRELOAD:
    importlib.import_module(module)
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

  if xla_bridge._backends:  # pylint: disable=protected-access
    raise RuntimeError("a JAX backend exists in this process: a forked run would inherit it")
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller's frames (whose atexit and finally are the parent's)
      code = 1
      try:
        os.environ.clear()
        os.environ.update(env)
        if "JAX_PLATFORMS" in env:  # read when JAX was imported: the run's own setting, before its backend exists
          import jax  # pylint: disable=import-outside-toplevel

          jax.config.update("jax_platforms", env["JAX_PLATFORMS"])
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        code = target() or 0
      except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
      except BaseException:  # noqa: BLE001  # pylint: disable=broad-exception-caught
        traceback.print_exc()
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # pylint: disable=protected-access
    deadline = time.monotonic() + timeout
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise subprocess.TimeoutExpired(name, timeout)
      time.sleep(0.05)
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(name, os.waitstatus_to_exitcode(status), out.read().decode(errors="replace"),
                                       err.read().decode(errors="replace"))


def measure(name: str, maxtext_args: list[str], steps: int, workdir: str, timeout: int, env: dict | None = None,
            loss_window: int = 0) -> dict:
  """training_runs.measure's row for a forked run of training_runs.worker (no peak on a CPU: memory_stats is None)."""
  start = time.monotonic()
  try:
    proc = forked(lambda: training_runs.worker(name, maxtext_args, steps, workdir), env or dict(os.environ), timeout,
                  f"forked run {name}")
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout}s", "wall_s": round(time.monotonic() - start, 1)}
  return training_runs.row_of(proc, name, workdir, round(time.monotonic() - start, 1), loss_window)


def cli(args: list[str], timeout: int) -> subprocess.CompletedProcess:
  """`temoe <args>` (e.g. `temoe profile ...`), forked with this process's environment."""
  from temoe import cli as temoe_cli  # pylint: disable=import-outside-toplevel

  def program() -> int:
    sys.argv = [temoe_cli.__file__, *args]
    return temoe_cli.main()  # as `python -m temoe.cli` calls it: the program itself

  return forked(program, dict(os.environ), timeout, f"forked temoe {args[0]}")
