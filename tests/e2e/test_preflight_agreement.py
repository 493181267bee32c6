"""A preflight that fails in one process of a jax.distributed job stops every process before training,
each with one line: the failing process says why, its peers name it and its reason."""

from __future__ import annotations

import faults
import runs
from temoe import exits
from temoe.run import lock


def test_a_preflight_failure_in_one_process_stops_its_peer_with_its_reason(tmp_path, smoke_data):
  """The run lock is the job's first process's alone, so a live holder fails process 0's preflight only."""
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  lock.write(str(run_dir / lock.LOCK_NAME), lock.holder_info())  # this test's process: alive, on this host
  procs = runs.start_group(tmp_path, smoke_data, "run", "held.jsonl", "steps=4")
  ends = [runs.finish(proc, tmp_path, f"held.jsonl.{rank}") for rank, proc in enumerate(procs)]
  own = faults.check("run held by another temoe train", *ends[0], jax_shutdown=True)
  peer = faults.check("a peer's preflight failed", *ends[1], jax_shutdown=True)
  assert own.removeprefix("temoe: ") in peer, (own, peer)
  assert all("completed step" not in log for _, log in ends) and not (tmp_path / "held.jsonl").exists()
  assert all(code == exits.NEEDS_PERSON for code, _ in ends)
