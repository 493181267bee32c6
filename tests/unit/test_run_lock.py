"""The run lock has one holder, however many `temoe train`s start at the same instant: on a free run
directory, and on one whose lock's holder died (the takeover race).

The contenders are forked by this file run as a script in a fresh process (one for both starts): a small,
single-threaded parent, where forking is cheap and safe (pytest's worker is large and runs threads)."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time

import pytest

PROCESSES = 4
"""Contenders a round: twice the CI host's cores. More do not find a race sooner: with the lock's guard removed,
rounds that saw two holders at once were 10 of 60 with 4 contenders, 5 of 60 with 12 (more forks than cores
spread their attempts out); 25 rounds miss a broken guard with odds below 1%."""
ROUNDS = 25
STARTS = ("free", "stale")


def contender(run_dir: str, barrier, winners: str) -> None:
  from temoe.run import lock  # pylint: disable=import-outside-toplevel  (imported by the parent before the forks)

  barrier.wait()
  try:
    held = lock.acquire(run_dir)
  except lock.RunLocked:
    os._exit(0)  # pylint: disable=protected-access
  start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
  time.sleep(0.1)  # hold it while the others try
  end = time.monotonic()
  held.release()
  with open(winners, "a", encoding="utf-8") as f:
    f.write(f"{start} {end}\n")
  os._exit(0)  # pylint: disable=protected-access


def race(root: pathlib.Path, start: str) -> list[dict]:
  """ROUNDS rounds of PROCESSES contenders on a fresh run directory each: per round, the contenders' exit
  codes, the holds (start, end) in order, and whether the lock file is left behind."""
  import jax  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import  (lock.process_rank asks it)

  from temoe.run import lock  # pylint: disable=import-outside-toplevel

  context = multiprocessing.get_context("fork")
  rounds = []
  for round_ in range(ROUNDS):
    run_dir, winners = root / f"{start}{round_}", root / f"{start}-winners{round_}"
    run_dir.mkdir()
    winners.touch()
    if start == "stale":  # a holder on this host that has exited
      (run_dir / lock.LOCK_NAME).write_text(json.dumps({**lock.holder_info(), "pid": 2**22 + 17}))
    barrier = context.Barrier(PROCESSES)
    procs = [context.Process(target=contender, args=(str(run_dir), barrier, str(winners))) for _ in range(PROCESSES)]
    for proc in procs:
      proc.start()
    for proc in procs:
      proc.join(60)
    rounds.append({
        "exit_codes": [proc.exitcode for proc in procs],
        "holds": sorted(tuple(map(float, line.split())) for line in winners.read_text().splitlines()),
        "left_behind": (run_dir / lock.LOCK_NAME).exists(),
    })
  return rounds


@pytest.fixture(scope="module", name="rounds")
def rounds_fixture(tmp_path_factory) -> dict:
  from conftest import HANG_S  # pylint: disable=import-outside-toplevel

  root = tmp_path_factory.mktemp("run-lock")
  proc = subprocess.run([sys.executable, __file__, str(root)], capture_output=True, text=True, timeout=HANG_S,
                        cwd=os.path.dirname(os.path.abspath(__file__)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("start", STARTS)
def test_many_processes_starting_at_once_get_one_holder(rounds, start):
  assert len(rounds[start]) == ROUNDS
  for round_, r in enumerate(rounds[start]):
    assert r["exit_codes"] == [0] * PROCESSES, f"round {round_}: {r['exit_codes']}"
    holds = r["holds"]
    assert holds, f"round {round_}: nobody took the lock"
    overlapping = [(a, b) for a, b in zip(holds, holds[1:]) if b[0] < a[1]]
    assert not overlapping, f"round {round_}: two processes held the lock at once ({len(holds)} holds)"
    assert not r["left_behind"], f"round {round_}: the holder did not release it"


if __name__ == "__main__":
  print(json.dumps({start: race(pathlib.Path(sys.argv[1]), start) for start in STARTS}), flush=True)
