"""Faults while a run trains or resumes, and what `temoe train` does about them: the exit code and its
last line. Each row is asserted by the e2e test that provokes it (`check(name, ...)`); README's table
of them is `render_table()` (tests/unit/test_exit_codes.py keeps it in step)."""

from __future__ import annotations

import re

from temoe import exits

FAULTS = {  # name -> (what happens, exit code, excerpts of the last line (in order; a tuple: one of them), the test)
    "data runs out": (
        "the training data holds 5 batches and a partial one (4 of 8 rows), steps=8", exits.NEEDS_PERSON,
        "training stopped at step 6 of 8: the training data ran out (grain_train_files has fewer batches than steps "
        "asks for); checkpoint step 5 saved", "e2e/test_failures.py"),
    "NaN state": ("learning_rate=1e30: the train state goes NaN", exits.NEEDS_PERSON,
                  ("the train state after step ", " has NaN/Inf values (in ",
                   "so it was not checkpointed; the latest checkpoint (step {good}) is the last good one"),
                  "e2e/test_failures.py"),
    "NaN loss": ("learning_rate=1e30, checkpointing off: MaxText's abort_on_nan_loss", exits.NEEDS_PERSON,
                 ("training stopped at step ", ": the loss is nan (MaxText's abort_on_nan_loss); no checkpoint "
                  "(checkpointing is off)"), "e2e/test_failures.py"),
    "run held by another temoe train": (
        "process 0 of a jax.distributed pair finds the run lock held by a live process", exits.NEEDS_PERSON,
        ("is in use by another temoe train (pid ",), "e2e/test_preflight_agreement.py"),
    "a peer's preflight failed": (
        "process 1 of that pair, whose own preflight passed", exits.NEEDS_PERSON,
        ("process 0 of 2 stopped before training: ", "is in use by another temoe train (pid "),
        "e2e/test_preflight_agreement.py"),
    "full disk": ("a checkpoint fills the filesystem", exits.NEEDS_PERSON,
                  ("the checkpoint of step ", ": No space left on device; nothing of it is listed as a step (the latest "
                   "committed one is step 0)"), "e2e/test_failures.py"),
    "SIGTERM before the first step": (
        "SIGTERM while the model is set up or compiled", exits.REQUEUE,
        "SIGTERM before the first step: nothing new to checkpoint, stopping now (exit 75: requeue", "e2e/test_preemption.py"),
    "SIGTERM while training": (
        "SIGTERM during a step, a synchronous or an asynchronous save", exits.REQUEUE,
        "training stopped after step {step} of 32: SIGTERM (preemption or a stop request); checkpoint step {step} "
        "saved. Exit 75 (requeue)", "e2e/test_preemption.py"),
    "SIGTERM to one of two processes": (
        "SIGTERM to process 1 of a jax.distributed pair", exits.REQUEUE,
        "training stopped after step {step} of 32: a SIGTERM or SIGINT to a process of the job (preemption or a stop "
        "request); checkpoint step {step} saved", "e2e/test_preemption.py"),
    "finished run started again": (
        "a requeue of a run whose last step is checkpointed", exits.DONE,
        "has finished: its latest checkpoint is step 5, the last of steps=6; nothing to do", "e2e/test_reliability.py"),
    "flipped bytes, no checksum records": (
        "4 KiB inverted in a chunk of the latest step where it decodes to a NaN/Inf, no temoe-checksums/", exits.NEEDS_PERSON,
        ("cannot be restored: it restored with NaN/Inf in ", "; the newest earlier step that restores intact is 0: "
         "pass te_resume_step=0 to resume from it"), "e2e/test_reliability.py"),
    "chunk overwritten with 0xFF, no checksum records": (
        "half the largest chunk of the latest step overwritten with 0xFF", exits.NEEDS_PERSON,
        # which damaged entry Tensorstore's parallel reads report first varies: one whose digest fails, or one
        # whose compressed frame starts inside the 0xFF (both name the damage)
        ("cannot be restored: ValueError: ", ("DATA_LOSS: ", "FAILED_PRECONDITION: "),
         ("Digest mismatch", "ZSTD_decompressStream() failed"), "the newest earlier step that restores intact is 0"),
        "e2e/test_reliability.py"),
    "another model shape": (
        "resumed with base_moe_mlp_dim=48 instead of 32", exits.NEEDS_PERSON,
        "does not fit this config: parameter params/params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi is "
        "(16, 2, 64, 64) in the checkpoint and (16, 2, 64, 96) in this config", "e2e/test_reliability.py"),
    "checkpoint directory turned read-only mid-run": (
        "checkpoints/ remounted read-only after the first save, asynchronous saves on", exits.NEEDS_PERSON,
        ("the checkpoint of step ", "could not be written to ", ": Read-only file system; nothing of it is listed as a "
         "step"), "e2e/test_reliability.py"),
    "read-only checkpoint directory": (
        "that run started again, its checkpoints/ still read-only", exits.NEEDS_PERSON,
        "the checkpoint directory {dir} is not a writable directory (Read-only file system)", "e2e/test_reliability.py"),
}


NOT_A_LOG = re.compile(r"^(temoe|Traceback|\w+(Error|Exception|Warning)\b)")
"""A line after temoe's last one that is not jax.distributed's C++ shutdown log (absl records, which
it writes after Python is done, and their continuation lines)."""


def check(name: str, code: int, log: str, jax_shutdown: bool = False, **values) -> str:
  """Asserts that a run's exit code and last line are the ones FAULTS[name] lists; returns the line.
  With `jax_shutdown` (a jax.distributed run), its C++ shutdown log may follow the line, nothing else."""
  _, want_code, excerpts, _ = FAULTS[name]
  lines = [line for line in log.strip().splitlines() if line.startswith("temoe: ")]
  assert code == want_code, f"{name}: exit {code}, not {want_code}\n{log[-3000:]}"
  after = log.strip().splitlines()
  after = after[len(after) - after[::-1].index(lines[-1]):] if lines else after
  late = [line for line in after if not jax_shutdown or NOT_A_LOG.match(line)]  # log records and their lines pass
  assert lines and not late, f"{name}: the last line is not temoe's\n{log[-3000:]}"
  rest = lines[-1]
  for excerpt in (excerpts,) if isinstance(excerpts, str) else excerpts:
    choices = [e.format(**values) for e in ((excerpt,) if isinstance(excerpt, str) else excerpt)]
    found = [c for c in choices if c in rest]
    assert found, f"{name}: {lines[-1]!r} lacks {' or '.join(map(repr, choices))} (in this order)"
    rest = rest[rest.index(found[0]) + len(found[0]):]
  assert "Traceback" not in log, f"{name}: a traceback\n{log[-3000:]}"
  return lines[-1]


def render_table() -> str:
  """README's table of faults: what happened, the exit code, the line (placeholders as <...>)."""
  lines = ["| fault | exit | the last line (excerpt) |", "|---|---|---|"]
  for name, (what, code, excerpts, _) in FAULTS.items():
    cell = " … ".join(e if isinstance(e, str) else " / ".join(e) for e in ((excerpts,) if isinstance(excerpts, str)
                                                                      else excerpts))
    cell = cell.replace("{", "<").replace("}", ">").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    lines.append(f"| {name}: {what} | {code} | {cell} |")
  return "\n".join(lines) + "\n"
