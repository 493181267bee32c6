"""The preflight's metrics-file check holds when every process of a job runs it on one path at the same
instant (what a resumed two-process run did: one process removed the file another had just created, then
failed on its own removal, and its peer timed out waiting for it).

The checkers are forked by this file run as a script in a fresh process: a small, single-threaded parent,
where forking is cheap and safe (pytest's worker is large and runs threads: forking it warned at every fork)."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import subprocess
import sys

PROCESSES = 8
ROUNDS = 20


def checker(path: str, barrier, failures) -> None:
  from temoe.run import preflight  # pylint: disable=import-outside-toplevel  (imported by the parent before the forks)

  barrier.wait()
  try:
    preflight.check_metrics_file(path)
  except Exception as exc:  # pylint: disable=broad-exception-caught
    failures.put(f"{type(exc).__name__}: {exc}")


def race(root: pathlib.Path) -> list[dict]:
  """ROUNDS rounds of PROCESSES checkers on one new path each: per round, the exit codes, the failures and
  what is left in the path's folder."""
  from temoe.run import preflight  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

  ctx = multiprocessing.get_context("fork")
  failures = ctx.Queue()
  rounds = []
  for round_ in range(ROUNDS):
    path = root / f"round{round_}" / "metrics.jsonl"
    barrier = ctx.Barrier(PROCESSES)
    procs = [ctx.Process(target=checker, args=(str(path), barrier, failures)) for _ in range(PROCESSES)]
    for proc in procs:
      proc.start()
    for proc in procs:
      proc.join(60)
    failed = []
    while not failures.empty():
      failed.append(failures.get())
    rounds.append({"exit_codes": [proc.exitcode for proc in procs], "failures": failed,
                   "left": sorted(os.listdir(path.parent))})
  return rounds


def test_processes_checking_one_new_metrics_file_at_once_all_pass_and_leave_nothing(tmp_path):
  from conftest import HANG_S  # pylint: disable=import-outside-toplevel

  proc = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=HANG_S,
                        cwd=os.path.dirname(os.path.abspath(__file__)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rounds = json.loads(proc.stdout.splitlines()[-1])
  assert len(rounds) == ROUNDS
  for round_, r in enumerate(rounds):
    assert r["exit_codes"] == [0] * PROCESSES, f"round {round_}: {r['exit_codes']}"
    assert not r["failures"], f"round {round_}: {r['failures']}"
    assert r["left"] == [], f"round {round_}: {r['left']}"  # the file is not created, no check file left behind


def test_an_existing_metrics_file_is_kept_as_it_is(tmp_path):
  from temoe.run import preflight  # pylint: disable=import-outside-toplevel

  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n')
  preflight.check_metrics_file(str(path))
  assert path.read_text() == '{"step": 1}\n'


if __name__ == "__main__":
  print(json.dumps(race(pathlib.Path(sys.argv[1]))), flush=True)
