"""Every host batch's token ids checked on their way to the devices (`temoe.run.tokens.BatchCheck`).

MaxText 0.2.5's `multihost_dataloading._form_global_array(path, array, mesh)` is the one function
each leaf of a host batch passes through as a numpy array, right before `jax.device_put`, leaf by leaf in
the batch dict's key order (`inputs`, `inputs_position`, `inputs_segmentation`, `targets`, ...); wrapped,
the `inputs` leaf is kept and checked when its segmentation arrives (the targets are the same ids shifted),
at the positions that hold data: the pad id MaxText fills short rows and a partial last batch with (-1 for
its default tokenizer) is no token id. A bad batch raises
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
    key = getattr(path[-1], "key", None) if path else None
    if key == "inputs":
      if "inputs" in _installed:  # the batch before ended on its inputs
        check_inputs(_installed.pop("inputs"), None)
      _installed["inputs"] = array
    elif "inputs" in _installed and key != "inputs_position":  # no segmentation in this batch: check all ids
      check_inputs(_installed.pop("inputs"), array if key == "inputs_segmentation" else None)
    return original(path, array, global_mesh)

  _installed["original"] = original
  multihost_dataloading._form_global_array = _form_global_array  # pylint: disable=protected-access


def check_inputs(inputs, segmentation) -> None:
  from temoe.maxtext import failures  # pylint: disable=import-outside-toplevel

  _installed["check"](inputs, failures.progress.get("step"), segmentation)


def check():
  """The installed BatchCheck (its `seconds` and `batches` say what it cost), or None."""
  return _installed.get("check")


def missing_seams() -> list[str]:
  from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

  return [] if callable(getattr(multihost_dataloading, "_form_global_array", None)) else [
      "multihost_dataloading._form_global_array"]
