"""The run lock has one holder, however many `temoe train`s start at the same instant: on a free run
directory, and on one whose lock's holder died (the takeover race)."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import jax  # noqa: F401  # imported before the forks: lock.process_rank asks it, and each child would import it
import pytest

from temoe.run import lock

PROCESSES = 12
ROUNDS = 25


def contender(run_dir: str, barrier, winners: str) -> None:
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


@pytest.mark.parametrize("start", ["free", "stale"])
def test_many_processes_starting_at_once_get_one_holder(tmp_path, start):
  context = multiprocessing.get_context("fork")
  for round_ in range(ROUNDS):
    run_dir, winners = tmp_path / f"run{round_}", tmp_path / f"winners{round_}"
    run_dir.mkdir()
    if start == "stale":  # a holder on this host that has exited
      (run_dir / lock.LOCK_NAME).write_text(json.dumps({**lock.holder_info(), "pid": 2**22 + 17}))
    barrier = context.Barrier(PROCESSES)
    procs = [context.Process(target=contender, args=(str(run_dir), barrier, str(winners))) for _ in range(PROCESSES)]
    for proc in procs:
      proc.start()
    for proc in procs:
      proc.join(60)
    assert all(proc.exitcode == 0 for proc in procs)
    holds = sorted(tuple(map(float, line.split())) for line in winners.read_text().splitlines())
    assert holds, f"round {round_}: nobody took the lock"
    overlapping = [(a, b) for a, b in zip(holds, holds[1:]) if b[0] < a[1]]
    assert not overlapping, f"round {round_}: two processes held the lock at once ({len(holds)} holds)"
    assert not (run_dir / lock.LOCK_NAME).exists()  # the holder released it
