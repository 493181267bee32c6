"""Forks one child per case from a process that imported MaxText once (tests/config_check.py --batch,
tests/plan_measure.py): each child runs its cases before any JAX backend exists (its own device count and
backend), sends its lines back through a pipe and leaves without the parent's exit handlers."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, TextIO


def assert_no_backend() -> None:
  """A child forked after a JAX backend exists would inherit its threads and devices."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

  assert not xla_bridge._backends, "a JAX backend exists before the fork"  # pylint: disable=protected-access


def fork(body: Callable[[TextIO], int | None]) -> tuple[int, int]:
  """(pid, read end of its pipe) of a child that runs `body(pipe)` and exits with its code (1 and the traceback on
  stderr if it raises)."""
  assert_no_backend()
  read, write = os.pipe()
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    os.close(read)
    code = 1
    try:
      with os.fdopen(write, "w", encoding="utf-8") as out:
        code = body(out) or 0
    except BaseException:  # pylint: disable=broad-exception-caught
      traceback.print_exc()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)  # pylint: disable=protected-access  (not the parent's exit handlers)
  os.close(write)
  return pid, read


def collect(pid: int, read: int) -> tuple[str, int]:
  """What the child sent and its exit status (os.waitpid's)."""
  with os.fdopen(read, encoding="utf-8") as got:
    text = got.read()
  return text, os.waitpid(pid, 0)[1]
