"""docs/guides/reliability.md states the exit-code contract and the faults table exactly as the code and the
tests have them: `temoe.exits.table()` and `faults.render_table()` (each fault's row is asserted by its e2e test)."""

from __future__ import annotations

import contextlib

import pathlib

import pytest

import faults
from temoe import exits

GUIDE = "docs/guides/reliability.md"
PAGE = (pathlib.Path(__file__).resolve().parents[2] / GUIDE).read_text(encoding="utf-8")


def test_the_reliability_guide_has_the_exit_code_contract():
  assert exits.table() in PAGE, f"{GUIDE}'s exit-code table drifted from temoe.exits: paste exits.table()"
  assert sorted(exits.MEANINGS) == sorted({exits.DONE, exits.FAILED, exits.NEEDS_PERSON, exits.REQUEUE})


def test_the_reliability_guide_faults_table_is_the_tests_table():
  assert faults.render_table() in PAGE, f"{GUIDE}'s faults table drifted from tests/faults.py: paste render_table()"


def test_every_fault_names_an_existing_test_that_checks_it():
  tests = pathlib.Path(__file__).resolve().parents[1]
  for name, (_, _, _, where) in faults.FAULTS.items():
    assert f'"{name}"' in (tests / where).read_text(encoding="utf-8"), f"{where} does not check the fault {name!r}"


def test_an_unexpected_error_is_one_line_and_debug_prints_its_traceback(capsys, monkeypatch):
  from temoe import oneline  # pylint: disable=import-outside-toplevel

  @oneline.guarded("temoe thing")
  def broken(argv):
    raise KeyError(argv[0])

  monkeypatch.delenv(oneline.DEBUG_ENV, raising=False)
  assert broken(["x"]) == exits.NEEDS_PERSON
  err = capsys.readouterr().err
  assert err == f"temoe thing: KeyError: 'x' ({oneline.DEBUG_HINT})\n"
  monkeypatch.setenv(oneline.DEBUG_ENV, "1")
  assert broken(["x"]) == exits.NEEDS_PERSON
  err = capsys.readouterr().err
  assert err.startswith("Traceback (most recent call last):") and err.endswith(f"({oneline.DEBUG_HINT})\n")


def test_debug_anywhere_on_the_command_line_turns_tracebacks_on(capsys, monkeypatch):
  import os  # pylint: disable=import-outside-toplevel

  from temoe import cli, oneline  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv(oneline.DEBUG_ENV, "0")  # monkeypatch puts back what was there after the test, --debug's too
  assert cli.main(["nothere", "--debug"]) == exits.NEEDS_PERSON
  assert os.environ[oneline.DEBUG_ENV] == "1"  # child processes (temoe profile's) see it too
  assert capsys.readouterr().err.startswith("temoe: unknown command 'nothere'")
  assert cli.main([]) == exits.NEEDS_PERSON and "temoe: no command given" in capsys.readouterr().err


def test_train_gives_the_signals_back_when_it_returns():
  """`temoe profile` trains in-process and goes on: Ctrl-C must interrupt it again afterwards."""
  import signal  # pylint: disable=import-outside-toplevel

  from conftest import SMOKE  # pylint: disable=import-outside-toplevel
  from temoe import cli  # pylint: disable=import-outside-toplevel

  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  assert cli.main(["train", SMOKE, "steps=0"]) == exits.NEEDS_PERSON
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_lost_peer_is_requeued_and_an_unknown_error_is_not():
  """The message is the one a jax.distributed pair's survivor got when its peer was SIGKILLed mid-step."""
  from temoe import cli  # pylint: disable=import-outside-toplevel

  lost = RuntimeError("UNKNOWN: Gloo AllGather failed: [external/gloo/transport/tcp/pair.cc:547] Connection closed "
                      "by peer [127.0.0.1]:5512")
  line, code, unknown = cli.training_failure(lost)
  assert code == exits.REQUEUE and not unknown and "a lost peer or link" in line
  line, code, unknown = cli.training_failure(ZeroDivisionError("division by zero"))
  assert code == exits.FAILED and unknown and line.endswith("ZeroDivisionError: division by zero")
  line, code, _ = cli.training_failure(OSError(28, "No space left on device", "/ckpt"))
  assert code == exits.NEEDS_PERSON and "a write failed (No space left on device: /ckpt)" in line


def test_a_context_manager_that_swallows_the_failure_does_not_hide_it():
  """Transformer Engine's context manager (MaxText trains inside it on GPUs) catches its block's exception and yields
  again, so Python raises "generator didn't stop after throw()"; the line names the block's own exception (an H200
  run's IndivisibleError read as that RuntimeError before)."""

  from temoe import cli  # pylint: disable=import-outside-toplevel

  @contextlib.contextmanager
  def swallowing():
    try:
      yield
    except Exception:  # pylint: disable=broad-exception-caught
      yield

  try:
    with swallowing():
      raise ValueError("IndivisibleError stand-in: dimension 0 (512) does not split 1024 ways")
  except RuntimeError as exc:
    masked = exc
  assert str(masked) == cli.GENERATOR_MASK
  line, code, unknown = cli.training_failure(masked)
  assert line.endswith("ValueError: IndivisibleError stand-in: dimension 0 (512) does not split 1024 ways")
  assert code == exits.FAILED and unknown
  lone = RuntimeError(cli.GENERATOR_MASK)  # nothing under it: said as it is
  assert cli.training_failure(lone)[0].endswith(f"RuntimeError: {cli.GENERATOR_MASK}")


TASK_LOGS_AT_EXIT = """
import asyncio, logging, sys
from temoe import oneline
logging.basicConfig(stream=sys.stderr)
async def write():
  raise OSError(28, "No space left on device")
loop = asyncio.new_event_loop()
task = loop.create_task(write())
loop.run_until_complete(asyncio.sleep(0.01))  # done, its exception never retrieved, still referenced
if sys.argv[1] == "quiet":
  oneline.quiet_after_last_line()
print("temoe: the checkpoint could not be written", file=sys.stderr, flush=True)
del task, loop  # collected after the line, as Orbax's pending writes are at exit
"""


def test_nothing_is_logged_after_the_last_line(tmp_path):
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  env = {k: v for k, v in os.environ.items() if k != "TEMOE_DEBUG"}
  run = lambda mode: subprocess.run([sys.executable, "-c", TASK_LOGS_AT_EXIT, mode], capture_output=True,
                                    text=True, env=env, check=True).stderr.strip().splitlines()
  assert "Task exception was never retrieved" in "\n".join(run("loud"))  # the echo this guards against
  assert run("quiet")[-1] == "temoe: the checkpoint could not be written"


HELD_AT_EXIT = """
import sys, threading
from temoe import oneline
if sys.argv[1] == "program":
  oneline.as_program()
threading.Thread(target=threading.Event().wait, name="a save that never returns").start()  # not a daemon
print("temoe: the checkpoint could not be written", file=sys.stderr, flush=True)
oneline.exit_promptly(2, grace_s=0.5)
sys.exit(2)  # Python's shutdown now waits for that thread
"""


def test_a_failed_program_exits_with_its_code_though_a_thread_never_ends():
  """Orbax's save threads blocked in a key-value get held a failed run ~290 s after its line; the bound ends the
  `temoe` program with the line's code. A caller that runs temoe in-process is left alone (not a program)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  done = subprocess.run([sys.executable, "-c", HELD_AT_EXIT, "program"], capture_output=True, text=True, timeout=120)
  assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == "temoe: the checkpoint could not be written"
  with pytest.raises(subprocess.TimeoutExpired):
    subprocess.run([sys.executable, "-c", HELD_AT_EXIT, "caller"], capture_output=True, text=True, timeout=2)
