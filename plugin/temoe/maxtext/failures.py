"""How a `temoe train` that fails says so: one line, an exit code per `temoe.exits`, after keeping
what is good.

Four MaxText 0.2.5 functions decide how failures and stops look:

- `train.training_loop_iteration`: MaxText turns a failed or exhausted data read into
  `StopTraining`, which its loop logs as INFO and treats as success (exit 0, no final
  checkpoint). Wrapped, the step is known: a data failure saves the state of the last finished
  step (it is good: the failing step never ran) and raises `TrainingStopped`. After each step
  the wrapper asks `temoe.run.preemption` whether a SIGTERM/SIGINT stops the run there; if so it
  saves that step synchronously and raises `TrainingStopped` with the requeue code. A target
  loss reached stays a success.
- `checkpointing.reached_preemption`: MaxText's own stop at JAX's preemption sync point raises
  inside the step, after the step's input state was donated and before its new state and
  metrics are kept, and saves nothing unless enable_autocheckpoint; temoe answers it with False
  and stops after the step instead (above), checkpointing it whatever enable_autocheckpoint says.
- `train.get_first_step`: the step training starts at, known after the restore and before the
  compile: from there on a signal stops the run after a step (`preemption.training_starts`).
- `pyconfig._handle_config_exception`: logs a five-line error block (and exits 2 outside
  tests) before anyone can print the error once; replaced by a plain re-raise.
- `metric_logger.MetricLogger.write_metrics`: with abort_on_nan_loss / abort_on_inf_loss (on by
  default) MaxText logs one INFO line and calls sys.exit(1), temoe's code for a bug, when a
  step's loss is written; wrapped, that exit becomes `TrainingStopped` naming the step, the loss
  and the latest checkpoint (never a NaN one: `temoe.maxtext.checkpointing` refuses to save it).

`progress` tells the CLI the step any other exception happened at.
"""

from __future__ import annotations

import errno
import functools

from temoe import exits
from temoe.oneline import first_line

progress: dict = {}
"""step (the one running), steps (asked), start (first of this run): set while MaxText trains."""

_installed: dict = {}


class TrainingStopped(RuntimeError):
  """Training ended short of `steps`; the message is the one line to print, `exit_code` per temoe.exits."""

  def __init__(self, message: str, exit_code: int = exits.NEEDS_PERSON):
    super().__init__(message)
    self.exit_code = exit_code


TRANSIENT_ERRNOS = {errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTUNREACH,
                    errno.ENETUNREACH, errno.ESTALE, errno.EAGAIN}
"""OS errors a retry can fix (a storage or network hiccup), as opposed to a full or read-only disk."""


def is_transient(exc: BaseException | None) -> bool:
  while exc is not None:
    if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
      return True
    exc = exc.__cause__ or exc.__context__
  return False


def data_stop(exc: BaseException) -> tuple[str, int]:
  """(what went wrong with the data, the exit code), from the exception MaxText's loader_exception_guard
  turned into StopTraining."""
  cause = exc.__cause__ or exc.__context__
  if isinstance(cause, StopIteration):
    return "the training data ran out (grain_train_files has fewer batches than steps asks for)", exits.NEEDS_PERSON
  from temoe import recipes  # pylint: disable=import-outside-toplevel

  if isinstance(cause, recipes.TemoeConfigError):  # temoe's check of the batch (temoe.run.tokens)
    return str(cause).rstrip("."), exits.NEEDS_PERSON
  code = exits.REQUEUE if is_transient(cause) else exits.NEEDS_PERSON
  return f"the training data could not be read ({first_line(cause)})", code


def stopped(exc: BaseException, jax_device_state: dict, python_vars: dict, immutable_data: dict) -> TrainingStopped | None:
  """The TrainingStopped for MaxText's StopTraining `exc`, after saving what is good; None for a success."""
  step, steps = int(python_vars["step"]), int(immutable_data["steps"])
  reason = str(exc)
  if reason.startswith("Target loss"):
    return None
  what, code = data_stop(exc)
  manager = python_vars["checkpoint_manager"]
  kept = "no checkpoint (checkpointing is off)"
  if manager is not None and step > int(immutable_data["start_step"]):
    kept = save_last(jax_device_state, python_vars, immutable_data, step - 1)
  elif manager is not None:
    kept = "nothing new to checkpoint"
  return TrainingStopped(f"training stopped at step {step} of {steps}: {what}; {kept}.", code)


def latest(checkpoint_dir: str) -> str:
  """'step N' of the latest committed checkpoint in `checkpoint_dir`, or 'none'."""
  from temoe.run import preflight  # pylint: disable=import-outside-toplevel

  steps = preflight.finalized_steps(checkpoint_dir)
  return f"step {steps[-1]}" if steps else "none"


def save_last(jax_device_state: dict, python_vars: dict, immutable_data: dict, step: int) -> str:
  """Checkpoints the state after `step` (MaxText's final save: skipped if that step is saved already)
  and waits until it and any asynchronous save in flight are committed; says what it kept."""
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  manager = python_vars["checkpoint_manager"]
  checkpointing.maybe_save_checkpoint(manager, jax_device_state["state"], immutable_data["config"],
                                      python_vars["data_iterator"])
  checkpointing.wait_until_finished(manager)
  return f"checkpoint step {step} saved"


def preempted(jax_device_state: dict, python_vars: dict, immutable_data: dict) -> TrainingStopped:
  """Saves the step that just ran (synchronously) and says how the run stopped (exit code: requeue)."""
  from temoe.run import preemption  # pylint: disable=import-outside-toplevel

  step, steps = int(python_vars["step"]), int(immutable_data["steps"])
  kept = "no checkpoint (checkpointing is off)"
  if python_vars["checkpoint_manager"] is not None:
    kept = save_last(jax_device_state, python_vars, immutable_data, step)
  signal = preemption.received() or "a SIGTERM or SIGINT to a process of the job"  # JAX's handler took it
  return TrainingStopped(
      f"training stopped after step {step} of {steps}: {signal} (preemption or a stop request); {kept}. "
      f"Exit {exits.REQUEUE} (requeue): the same run_name resumes from it.", exits.REQUEUE)


def loss_stopped(metrics: dict, step: int, config) -> TrainingStopped | None:
  """The TrainingStopped for MaxText's abort on a NaN/Inf loss in `metrics` (step `step`), or None when
  its loss is finite (some other sys.exit)."""
  import math  # pylint: disable=import-outside-toplevel

  loss = float((metrics.get("scalar") or {}).get("learning/loss", 0.0))
  if math.isfinite(loss):
    return None
  steps = progress.get("steps", getattr(config, "steps", "?"))
  if getattr(config, "enable_checkpointing", False):
    kept = (f"the latest checkpoint ({latest(config.checkpoint_dir)}) is finite: lower learning_rate or "
            "fix the data, then rerun with the same run_name to resume from it (te_resume_step=N for an earlier one)")
  else:
    kept = "no checkpoint (checkpointing is off): lower learning_rate or fix the data, then rerun"
  flag = "abort_on_nan_loss" if math.isnan(loss) else "abort_on_inf_loss"
  return TrainingStopped(f"training stopped at step {step} of {steps}: the loss is {loss} (MaxText's {flag}); {kept}.")


def install_train_loop() -> None:
  """Wraps MaxText's training_loop_iteration, get_first_step, reached_preemption and
  MetricLogger.write_metrics (once)."""
  if "iteration" in _installed:
    return
  from maxtext.common import checkpointing, metric_logger  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel
  from maxtext.utils import exceptions  # pylint: disable=import-outside-toplevel

  from temoe.run import preemption  # pylint: disable=import-outside-toplevel

  original, original_first_step = train.training_loop_iteration, train.get_first_step

  @functools.wraps(original)
  def training_loop_iteration(jax_device_state, python_vars, immutable_data):
    step = int(python_vars["step"])
    progress.update(step=step, steps=int(immutable_data["steps"]), start=int(immutable_data["start_step"]))
    try:
      metrics = original(jax_device_state, python_vars, immutable_data)
    except exceptions.StopTraining as exc:
      failure = stopped(exc, jax_device_state, python_vars, immutable_data)
      if failure is None:
        raise
      raise failure from exc
    if preemption.due(step) and step + 1 < int(immutable_data["steps"]):  # the last step: the run just ends
      raise preempted(jax_device_state, python_vars, immutable_data)
    return metrics

  @functools.wraps(original_first_step)
  def get_first_step(*args, **kwargs):
    start = original_first_step(*args, **kwargs)
    preemption.training_starts(int(start))
    return start

  def reached_preemption(checkpoint_manager, step):
    """temoe stops a preempted run after the step (`training_loop_iteration` above), never inside it."""
    del checkpoint_manager, step
    return False

  original_write = metric_logger.MetricLogger.write_metrics

  @functools.wraps(original_write)
  def write_metrics(self, metrics, step, metric_type="train"):
    try:
      return original_write(self, metrics, step, metric_type)
    except SystemExit as exc:
      failure = loss_stopped(metrics, int(step), self.config) if metric_type == "train" and metrics else None
      if failure is None:
        raise
      raise failure from exc

  _installed.update(iteration=original, first_step=original_first_step, reached=checkpointing.reached_preemption,
                    write_metrics=original_write)
  train.training_loop_iteration = training_loop_iteration
  train.get_first_step = get_first_step
  checkpointing.reached_preemption = reached_preemption
  metric_logger.MetricLogger.write_metrics = write_metrics


def install_quiet_config_errors() -> None:
  """MaxText's config errors are raised as they are; temoe prints them once, as one line."""
  if "config" in _installed:
    return
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  def handle_config_exception(e: Exception):
    raise e

  _installed["config"] = pyconfig._handle_config_exception  # pylint: disable=protected-access
  pyconfig._handle_config_exception = handle_config_exception  # pylint: disable=protected-access


def missing_seams() -> list[str]:
  """The MaxText functions this module hooks that the installed MaxText lacks."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel
  from maxtext.utils import exceptions  # pylint: disable=import-outside-toplevel

  missing = [] if callable(getattr(pyconfig, "_handle_config_exception", None)) else ["pyconfig._handle_config_exception"]
  missing += [f"train.{name}" for name in ("training_loop_iteration", "get_first_step")
              if not callable(getattr(train, name, None))]
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  if not callable(getattr(checkpointing, "reached_preemption", None)):
    missing.append("checkpointing.reached_preemption")
  from maxtext.common import metric_logger  # pylint: disable=import-outside-toplevel

  if not callable(getattr(getattr(metric_logger, "MetricLogger", None), "write_metrics", None)):
    missing.append("metric_logger.MetricLogger.write_metrics")
  if not isinstance(getattr(exceptions, "StopTraining", None), type):
    missing.append("exceptions.StopTraining")
  return missing
