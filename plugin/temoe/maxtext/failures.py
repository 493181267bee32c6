"""How a `temoe train` that fails says so: non-zero, one line, after keeping what is good.

Two MaxText 0.2.5 functions decide how failures look:

- `train.training_loop_iteration`: MaxText turns a failed or exhausted data read into
  `StopTraining`, which its loop logs as INFO and treats as success (exit 0, no final
  checkpoint). Wrapped, the step is known: a data failure saves the state of the last finished
  step (it is good: the failing step never ran) and raises `TrainingStopped`; a preemption
  (SIGTERM, already checkpointed by MaxText) too. A target loss reached stays a success.
- `pyconfig._handle_config_exception`: logs a five-line error block (and exits 2 outside
  tests) before anyone can print the error once; replaced by a plain re-raise.

`progress` tells the CLI the step any other exception happened at.
"""

from __future__ import annotations

import functools

progress: dict = {}
"""step (the one running), steps (asked), start (first of this run): set while MaxText trains."""

_installed: dict = {}


class TrainingStopped(RuntimeError):
  """Training ended short of `steps`; the message is the one line to print (exit code 1)."""


def first_line(exc: BaseException) -> str:
  text = str(exc).strip()
  return f"{type(exc).__name__}: {text.splitlines()[0][:400]}" if text else type(exc).__name__


def data_stop(exc: BaseException) -> str:
  """What went wrong with the data, from the exception MaxText's loader_exception_guard turned into StopTraining."""
  cause = exc.__cause__ or exc.__context__
  if isinstance(cause, StopIteration):
    return "the training data ran out (grain_train_files has fewer batches than steps asks for)"
  return f"the training data could not be read ({first_line(cause)})"


def stopped(exc: BaseException, jax_device_state: dict, python_vars: dict, immutable_data: dict) -> TrainingStopped | None:
  """The TrainingStopped for MaxText's StopTraining `exc`, after saving what is good; None for a success."""
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  config = immutable_data["config"]
  step, steps = int(python_vars["step"]), int(immutable_data["steps"])
  reason = str(exc)
  if reason.startswith("Target loss"):
    return None
  manager = python_vars["checkpoint_manager"]
  if "termination signal" in reason:
    what, kept = "the job received SIGTERM (preemption)", "MaxText saved a checkpoint of it"
  else:
    what = data_stop(exc)
    kept = "no checkpoint (checkpointing is off)"
    if manager is not None and step > int(immutable_data["start_step"]):
      checkpointing.maybe_save_checkpoint(manager, jax_device_state["state"], config, python_vars["data_iterator"])
      checkpointing.wait_until_finished(manager)
      kept = f"checkpoint step {step - 1} saved"
    elif manager is not None:
      kept = "nothing new to checkpoint"
  return TrainingStopped(f"training stopped at step {step} of {steps}: {what}; {kept}.")


def install_train_loop() -> None:
  """Wraps MaxText's training_loop_iteration (once)."""
  if "iteration" in _installed:
    return
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel
  from maxtext.utils import exceptions  # pylint: disable=import-outside-toplevel

  original = train.training_loop_iteration

  @functools.wraps(original)
  def training_loop_iteration(jax_device_state, python_vars, immutable_data):
    progress.update(step=int(python_vars["step"]), steps=int(immutable_data["steps"]),
                    start=int(immutable_data["start_step"]))
    try:
      return original(jax_device_state, python_vars, immutable_data)
    except exceptions.StopTraining as exc:
      failure = stopped(exc, jax_device_state, python_vars, immutable_data)
      if failure is None:
        raise
      raise failure from exc

  _installed["iteration"] = original
  train.training_loop_iteration = training_loop_iteration


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
  if not callable(getattr(train, "training_loop_iteration", None)):
    missing.append("train.training_loop_iteration")
  if not isinstance(getattr(exceptions, "StopTraining", None), type):
    missing.append("exceptions.StopTraining")
  return missing
