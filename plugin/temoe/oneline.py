"""How every temoe command fails: one `temoe <command>: ...` line naming the cause, an exit code (see
`temoe.exits`), and a Python traceback only when asked for one (`temoe --debug ...` or
`TEMOE_DEBUG=1`), for a bug report. Imports nothing heavy: the launchers use it too.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

from temoe import exits

DEBUG_ENV = "TEMOE_DEBUG"
DEBUG_HINT = f"{DEBUG_ENV}=1 (or temoe --debug) prints the traceback"


def debug() -> bool:
  """Whether tracebacks are wanted (`--debug` sets the variable, so child processes see it too)."""
  return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def first_line(exc: BaseException, limit: int = 400) -> str:
  """`Type: the message's first line` (TensorStore's spec dump cut off)."""
  text = str(exc).strip().split(" [tensorstore_spec=")[0]
  return f"{type(exc).__name__}: {text.splitlines()[0][:limit]}" if text else type(exc).__name__


def chain(exc: BaseException | None):
  """`exc` and its causes/contexts, outermost first."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    yield exc
    exc = exc.__cause__ or exc.__context__


def root_cause(exc: BaseException) -> BaseException:
  """The innermost exception of `exc`'s chain (Orbax wraps TensorStore's real error, e.g. a digest mismatch)."""
  return list(chain(exc))[-1]


def quiet_background_errors() -> None:
  """Unless tracebacks are wanted: errors that background threads and C callbacks would print as
  tracebacks (Orbax's aborted commits and loads after a failure temoe reports itself) print nothing,
  and a logged error keeps its message line without the traceback."""
  if debug():
    return
  import threading  # pylint: disable=import-outside-toplevel

  import logging  # pylint: disable=import-outside-toplevel

  sys.excepthook = lambda *args: None  # C extensions' PyErr_Print in callbacks ends here
  sys.unraisablehook = lambda unraisable: None  # "Exception ignored in: <coroutine ...>" of an aborted load
  threading.excepthook = lambda args: None
  make_record = logging.getLogRecordFactory()

  def record_without_traceback(*args, **kwargs):  # asyncio's "exception was never retrieved", Orbax's errors
    record = make_record(*args, **kwargs)
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    return record

  logging.setLogRecordFactory(record_without_traceback)


def quiet_after_last_line() -> None:
  """Unless tracebacks are wanted: nothing is logged after temoe's last line. A failed run's threads and
  pending asyncio tasks (Orbax's commit, TensorStore writes) log the same failure again as they are
  collected at exit ("Task exception was never retrieved"); the line already said it."""
  if debug():
    return
  import gc  # pylint: disable=import-outside-toplevel
  import logging  # pylint: disable=import-outside-toplevel

  gc.collect()  # what is unreachable already logs now, before the line
  logging.disable(logging.CRITICAL)


EXIT_GRACE_S = 5.0
"""How long a failed `temoe train` process may run on after its last line before it exits anyway."""

_program: dict = {}


def as_program() -> None:
  """This process is the `temoe` program (its main() called from the command line), not a caller of it."""
  _program["on"] = True


def exit_promptly(code: int, grace_s: float = EXIT_GRACE_S) -> None:
  """After a failure's last line: the process exits with `code` at the latest `grace_s` seconds later, whatever
  is still running. A failed checkpoint write leaves Orbax's save threads waiting in a blocking key-value get
  that held the process about 290 s after its line (a checkpoint directory that turned read-only); the line
  was printed and the run lock released, so nothing is lost by not waiting. Only in the `temoe` program
  itself: a process that called temoe in-process goes on as it would."""
  if not _program.get("on") or _program.get("watchdog"):
    return
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  def watch():
    time.sleep(grace_s)
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # noqa: BLE001,S110  # pylint: disable=broad-exception-caught
        pass
    os._exit(code)  # pylint: disable=protected-access

  _program["watchdog"] = threading.Thread(target=watch, name="temoe-exit-watchdog", daemon=True)
  _program["watchdog"].start()


def print_traceback(exc: BaseException) -> None:
  """The traceback of `exc`, when tracebacks are wanted."""
  if debug():
    traceback.print_exception(exc, file=sys.stderr)


class ArgumentParser(argparse.ArgumentParser):
  """argparse that reports a bad argument in one line, `<prog>: <message> (see `<prog> --help`)`, exit 2."""

  def error(self, message):
    self.exit(exits.NEEDS_PERSON, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def guarded(prog: str):
  """Decorates a command's `main(argv) -> int`: an exception it did not expect ends as one line
  (`<prog>: Type: message`) and exit 2 instead of a traceback; Ctrl-C as one line and 130; argparse's
  exit becomes the return value."""

  def wrap(main):
    @functools.wraps(main)
    def run(*args, **kwargs):
      try:
        return main(*args, **kwargs)
      except SystemExit as exc:  # argparse's usage error (its one line printed) or --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else exits.NEEDS_PERSON)
      except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
      except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
        print_traceback(exc)
        print(f"{prog}: {first_line(exc)} ({DEBUG_HINT})", file=sys.stderr, flush=True)
        return exits.NEEDS_PERSON

    return run

  return wrap
