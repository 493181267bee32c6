"""The preflight's metrics-file check holds when every process of a job runs it on one path at the same
instant (what a resumed two-process run did: one process removed the file another had just created, then
failed on its own removal, and its peer timed out waiting for it)."""

from __future__ import annotations

import multiprocessing
import os

from temoe.run import preflight

PROCESSES = 8
ROUNDS = 20


def checker(path: str, barrier, failures) -> None:
  barrier.wait()
  try:
    preflight.check_metrics_file(path)
  except Exception as exc:  # pylint: disable=broad-exception-caught
    failures.put(f"{type(exc).__name__}: {exc}")


def test_processes_checking_one_new_metrics_file_at_once_all_pass_and_leave_nothing(tmp_path):
  ctx = multiprocessing.get_context("fork")
  failures = ctx.Queue()
  for round_ in range(ROUNDS):
    path = tmp_path / f"round{round_}" / "metrics.jsonl"
    barrier = ctx.Barrier(PROCESSES)
    procs = [ctx.Process(target=checker, args=(str(path), barrier, failures)) for _ in range(PROCESSES)]
    for proc in procs:
      proc.start()
    for proc in procs:
      proc.join(60)
    assert all(proc.exitcode == 0 for proc in procs)
    assert failures.empty(), failures.get()
    assert os.listdir(path.parent) == []  # the file is not created, and no check file is left behind


def test_an_existing_metrics_file_is_kept_as_it_is(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n')
  preflight.check_metrics_file(str(path))
  assert path.read_text() == '{"step": 1}\n'
