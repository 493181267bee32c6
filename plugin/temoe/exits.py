"""The exit codes of `temoe train`, which the launchers act on (one source: the templates are rendered
with these numbers, README's table is `table()`).

A scheduler that requeues every non-zero exit loops on a problem only a person can fix (bad input,
data that ran out, a full disk): each of those refuses again on every attempt. So only `REQUEUE`
means "run me again": the run stopped for a reason a retry can fix, after saving what it had.
"""

from __future__ import annotations

DONE = 0
"""Every asked step ran (or MaxText's target_eval_loss was reached), or the run had already finished."""

FAILED = 1
"""An error temoe does not know (a bug to report): neither retried nor blamed on the input."""

NEEDS_PERSON = 2
"""Bad input or a state only a person can fix: the same command would fail the same way again."""

REQUEUE = 75
"""A fault a retry can fix (preemption, transient I/O, a lost peer), after the last finished step was
checkpointed: requeue with the same run_name and it resumes. 75 is sysexits' EX_TEMPFAIL."""

MEANINGS = {
    DONE: ("done", "every step ran; a finished run started again says so in one line"),
    REQUEUE: ("requeue", "SIGTERM/SIGINT (preemption) after a synchronous checkpoint, a transient I/O error, a "
              "lost peer: the launchers requeue it, at most --max-restarts times"),
    NEEDS_PERSON: ("needs a person", "bad input or data, data that ran out, a read-only or full disk, a damaged "
                   "checkpoint, a shape mismatch, a NaN/Inf state: never requeued"),
    FAILED: ("failed", "an error temoe does not recognise (report it with the traceback TEMOE_DEBUG=1 prints): "
             "never requeued"),
}


def table() -> str:
  """README's exit-code table."""
  lines = ["| exit | meaning | when |", "|---|---|---|"]
  lines += [f"| {code} | {name} | {when} |" for code, (name, when) in MEANINGS.items()]
  return "\n".join(lines) + "\n"
