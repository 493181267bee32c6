"""SIGTERM (what Slurm and Kubernetes send before they stop a job) loses nothing: the run finishes the
step in flight, checkpoints it synchronously (after any asynchronous save in flight), releases the
run lock, prints one line and exits 75 (requeue); started again it continues the uninterrupted run's
loss curve bit for bit. Before the first step there is nothing to save: it stops at once.

Moments, each found in the run's own log and hit the instant its line appears: during set-up and
compile (`te_moe_block=true -> temoe MoE block`), after a step (`completed step: k`), while an
asynchronous save is in flight (`Started an asynchronous checkpoint save`), inside a synchronous
save (`Waiting for step k to finish before checkpoint`). One process, and two processes joined by
jax.distributed where only one gets the signal. CI runs a few (the pair without its resume, which
needs a reference run of the pair: three two-process runs on two cores); TEMOE_PREEMPTION_TRIALS=N
runs N random moments of each kind instead, each resumed and compared.
"""

from __future__ import annotations

import os
import random
import re

import pytest

import faults
import runs
from conftest import REFERENCE_STEPS
from temoe import exits
from temoe.run import lock

STEPS, PERIOD = 32, 4
"""A stopped run's steps (the line says `of 32`); started again, the single process trains up to the session's
16-step reference (conftest's smoke_reference), which it must match: the same 32-step schedule, one program."""
MOMENTS = {  # name -> (pattern in the log, async_checkpointing)
    "compile": (r"te_moe_block=true -> temoe MoE block", "true"),
    "a step": (r"completed step: \d+,", "false"),
    "an async save": (r"Started an asynchronous checkpoint save for step", "true"),
    "a sync save": (r"Waiting for step \d+ to finish before checkpoint", "false"),
}
TRIALS = int(os.environ.get("TEMOE_PREEMPTION_TRIALS", "0"))


def random_trials(kinds: tuple[str, ...], seed: int, last: int) -> list[tuple[str, int]]:
  rng = random.Random(seed)
  return [(kind, 1 if kind == "compile" else rng.randint(1, last)) for kind in rng.choices(kinds, k=TRIALS)]


# the single process's latest moment, the 3rd save (step 8, a save every 4 steps from step 0), stops it well
# before the 16-step reference ends; the pair compares with its own 32-step reference. In CI the pair is signalled
# while the first save (step 0) is in flight: a step of the pair costs both processes ~1.5 CPU-s, and the stop in
# the midst of an asynchronous save is the same whichever save it is
ONE = random_trials(tuple(MOMENTS), 1, 3) if TRIALS else [("compile", 1), ("an async save", 2)]
TWO = random_trials(tuple(MOMENTS), 2, 6) if TRIALS else [("an async save", 1)]


def flags(async_checkpointing: str, steps: int = STEPS) -> tuple[str, ...]:
  return (f"steps={steps}", "enable_checkpointing=true", f"checkpoint_period={PERIOD}",
          f"async_checkpointing={async_checkpointing}", "enable_tensorboard=false")


def stopped_step(line: str) -> int | None:
  found = re.search(r"stopped after step (\d+) of", line)
  return int(found.group(1)) if found else None


def check_stop(tmp_path, code: int, log: str, reference: dict | None, metrics: str, name: str,
               two: bool = False) -> int | None:
  """The stop's exit code and line, the lock, the checkpoint; returns the step it saved (None: before the first)."""
  line = [l for l in log.strip().splitlines() if l.startswith("temoe: ")][-1]
  step = stopped_step(line)
  if step is None:
    faults.check("SIGTERM before the first step", code, log, jax_shutdown=two)
    assert runs.finalized_steps(tmp_path / "run" / "checkpoints") == [], f"{name}: it saved before its first step"
  else:
    faults.check("SIGTERM to one of two processes" if two else "SIGTERM while training", code, log, jax_shutdown=two,
                 step=step)
    logged = runs.losses(tmp_path / metrics)
    assert max(logged) == step, f"{name}: the last finished step is {max(logged)}, the line says {step}"
    assert runs.finalized_steps(tmp_path / "run" / "checkpoints")[-1] == step  # saved at the last finished step
    if reference is not None:
      assert max(logged) < max(reference), f"{name}: stopped after step {max(logged)}, past the reference's steps"
      assert logged == {s: reference[s] for s in logged}, f"{name}: the losses before the stop changed"
  assert not (tmp_path / "run" / lock.LOCK_NAME).exists(), f"{name}: the run lock was left behind"
  return step


@pytest.mark.parametrize("moment,nth", ONE, ids=[f"{m} {n}" for m, n in ONE])
def test_sigterm_saves_the_last_step_and_the_run_resumes_on_its_loss_curve(tmp_path, smoke_data, smoke_reference,
                                                                          moment, nth):
  pattern, async_checkpointing = MOMENTS[moment]
  proc = runs.start(tmp_path, smoke_data, "run", "first.jsonl", *flags(async_checkpointing))
  assert runs.signal_at(proc, tmp_path / "first.jsonl.log", pattern, nth), "the run ended before the moment"
  code, log = runs.finish(proc, tmp_path, "first.jsonl")
  step = check_stop(tmp_path, code, log, smoke_reference, "first.jsonl", moment)
  if step is None:
    return  # nothing was saved: starting again is a fresh run (test_train_e2e's)
  resumed, log = runs.train(tmp_path, smoke_data, "run", "resumed.jsonl", *flags(async_checkpointing, REFERENCE_STEPS))
  assert f"restoring from this run's directory step {step}" in log
  assert resumed == {s: smoke_reference[s] for s in range(step + 1, REFERENCE_STEPS)}  # exact floats


@pytest.fixture(scope="module")
def pair_reference(tmp_path_factory, smoke_data) -> dict[int, float]:
  """{step: loss} of the uninterrupted two-process run."""
  base = tmp_path_factory.mktemp("pair")
  procs = runs.start_group(base, smoke_data, "ref", "ref.jsonl", f"steps={STEPS}", "enable_checkpointing=false",
                           "enable_tensorboard=false")
  for rank, proc in enumerate(procs):
    code, log = runs.finish(proc, base, f"ref.jsonl.{rank}")
    assert code == 0, log[-3000:]
  return runs.losses(base / "ref.jsonl")


def finish_group(procs, tmp_path, metrics: str) -> list[tuple[int, str]]:
  return [runs.finish(proc, tmp_path, f"{metrics}.{rank}") for rank, proc in enumerate(procs)]


@pytest.mark.parametrize("moment,nth", TWO, ids=[f"{m} {n}" for m, n in TWO])
def test_sigterm_to_one_of_two_processes_stops_both_at_one_saved_step(tmp_path, smoke_data, request, moment, nth):
  """Only process 1 gets the signal (a Kubernetes pod deleted); JAX's preemption sync agrees on the step.
  During compile both get it (as from Slurm): JAX's handler holds it until the pair agrees after a step."""
  pair_reference = request.getfixturevalue("pair_reference") if TRIALS else None
  pattern, async_checkpointing = MOMENTS[moment]
  procs = runs.start_group(tmp_path, smoke_data, "run", "first.jsonl", *flags(async_checkpointing))
  signalled = procs if moment == "compile" else procs[1:]
  for proc in signalled:
    assert runs.signal_at(proc, tmp_path / "first.jsonl.0.log", pattern, nth), "the run ended before the moment"
  ends = finish_group(procs, tmp_path, "first.jsonl")
  steps = {check_stop(tmp_path, code, log, pair_reference, "first.jsonl", moment, two=True) for code, log in ends}
  assert len(steps) == 1, f"the processes stopped at different steps: {steps}"
  step = steps.pop()
  if step is None or pair_reference is None:
    return
  procs = runs.start_group(tmp_path, smoke_data, "run", "resumed.jsonl", *flags(async_checkpointing))
  for code, log in finish_group(procs, tmp_path, "resumed.jsonl"):
    assert code == exits.DONE and f"restoring from this run's directory step {step}" in log, log[-3000:]
  assert runs.losses(tmp_path / "resumed.jsonl") == {s: pair_reference[s] for s in range(step + 1, STEPS)}
