"""Every host batch's token ids checked on their way to the devices (`temoe.run.tokens.BatchCheck`).

MaxText 0.2.5's `multihost_dataloading._form_global_array(path, array, mesh)` is the one function
each leaf of a host batch passes through as a numpy array, right before `jax.device_put`; wrapped,
the `inputs` leaf is checked first (the targets are the same ids shifted). A bad batch raises
`TokenError` inside MaxText's data-loading guard, which stops the run; `temoe.maxtext.failures`
keeps the last finished step and prints the error as the run's one line.
"""

from __future__ import annotations

import functools

_installed: dict = {}


def install(config) -> None:
  """Checks the batches of the run `config` describes (a later call replaces the check)."""
  from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

  from temoe.run import tokens  # pylint: disable=import-outside-toplevel

  _installed["check"] = tokens.BatchCheck(config)
  if "original" in _installed:
    return
  original = multihost_dataloading._form_global_array  # pylint: disable=protected-access

  @functools.wraps(original)
  def _form_global_array(path, array, global_mesh):
    if path and getattr(path[-1], "key", None) == "inputs":
      from temoe.maxtext import failures  # pylint: disable=import-outside-toplevel

      _installed["check"](array, failures.progress.get("step"))
    return original(path, array, global_mesh)

  _installed["original"] = original
  multihost_dataloading._form_global_array = _form_global_array  # pylint: disable=protected-access


def check():
  """The installed BatchCheck (its `seconds` and `batches` say what it cost), or None."""
  return _installed.get("check")


def missing_seams() -> list[str]:
  from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

  return [] if callable(getattr(multihost_dataloading, "_form_global_array", None)) else [
      "multihost_dataloading._form_global_array"]
