"""Checks a `temoe train` run before MaxText starts, where MaxText's own failure comes late or obscure.

- An output directory this process cannot write: MaxText fails inside TensorBoard's writer after
  building the model, or, with TensorBoard and checkpoints off, trains and keeps nothing.
- A latest checkpoint Orbax cannot read (truncated or missing files, bad metadata): MaxText's
  restore ends in Orbax's "incompatible handler" error followed by the whole abstract state tree.

Each check raises `PreflightError` (a `TemoeConfigError`, so `temoe train` prints one line and
exits 2) naming what to do. They read what MaxText would read, with MaxText's and Orbax's own
functions, and write nothing but the run directory MaxText would create anyway.
"""

from __future__ import annotations

from temoe import recipes


class PreflightError(recipes.TemoeConfigError):
  """A run that would fail in MaxText later, and less clearly."""


def check(maxtext_args: list[str]):
  """Builds the run's config as MaxText will (temoe registered) and checks it; returns the config."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  config = pyconfig.initialize(["temoe train", *maxtext_args], log_config=False)  # MaxText logs it once, itself
  check_output_dir(config.base_output_directory, config.run_name)
  if config.enable_checkpointing:
    check_latest_checkpoint(config.checkpoint_dir)
  return config


def check_output_dir(base_output_directory: str, run_name: str) -> None:
  """The run directory exists or can be made, and takes a file (MaxText's own probe)."""
  import os  # pylint: disable=import-outside-toplevel

  from maxtext.utils import gcs_utils  # pylint: disable=import-outside-toplevel

  run_dir = os.path.join(base_output_directory, run_name)
  try:
    gcs_utils.mkdir_and_check_permissions(run_dir)
  except Exception as exc:  # pylint: disable=broad-exception-caught
    raise PreflightError(
        f"base_output_directory={base_output_directory} is not writable by this process "
        f"({type(exc).__name__}: {exc}); pass a directory it can create and write."
    ) from exc


def finalized_steps(checkpoint_dir: str) -> list[int]:
  """Committed checkpoint steps, ascending, as Orbax lists them (in-flight saves excluded)."""
  from etils import epath  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import path as ocp_path  # pylint: disable=import-outside-toplevel

  return sorted(ocp_path.step.checkpoint_steps(checkpoint_dir)) if epath.Path(checkpoint_dir).exists() else []


def check_latest_checkpoint(checkpoint_dir: str) -> int | None:
  """The step MaxText will restore, if any, after checking Orbax can read it."""
  steps = finalized_steps(checkpoint_dir)
  if not steps:
    return None
  step_dir = f"{checkpoint_dir.rstrip('/')}/{steps[-1]}"
  problem = unreadable(step_dir)
  if problem:
    earlier = f"the one before it is step {steps[-2]}" if len(steps) > 1 else "there is no earlier one"
    raise PreflightError(
        f"the latest checkpoint {step_dir}, which MaxText would restore, cannot be read: {problem}. "
        f"Move that step directory away to resume from an earlier checkpoint ({earlier}), "
        "or pass a new run_name to start afresh."
    )
  return steps[-1]


def unreadable(step_dir: str) -> str | None:
  """Why MaxText could not restore the checkpoint in `step_dir`, or None.

  Reads what the restore reads: for OCDBT storage (MaxText's default) the database index and the
  last byte of every stored chunk (a truncated or missing data file fails there, at one small read
  per chunk rather than a full restore), then the train state's tree metadata through Orbax's
  PyTreeHandler (its `checkpointables_metadata` would log the error and return None), then the
  Grain iterator's state files.
  """
  import asyncio  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel

  from etils import epath  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import v1 as ocp  # pylint: disable=import-outside-toplevel

  items = epath.Path(step_dir) / "items"
  if not items.exists():
    return "it has no items/ (the train state)"
  if (items / "manifest.ocdbt").exists() or any(items.glob("ocdbt.process_*")):
    problem = unreadable_chunk(str(items))
    if problem:
      return problem
  try:
    asyncio.run(ocp.handlers.PyTreeHandler().metadata(items))
  except Exception as exc:  # pylint: disable=broad-exception-caught
    return f"Orbax cannot read the train state's metadata (items/): {type(exc).__name__}: {first_line(exc)}"
  iterator = epath.Path(step_dir) / "iter"
  for state in sorted(iterator.glob("*.json")) if iterator.exists() else []:
    try:
      json.loads(state.read_text())
    except ValueError as exc:
      return f"the Grain iterator state iter/{state.name} is not JSON ({first_line(exc)})"
  return None


def unreadable_chunk(ocdbt_dir: str) -> str | None:
  """What of the OCDBT database in `ocdbt_dir` cannot be read: its index, or a chunk's bytes."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  spec = {"driver": "ocdbt", "base": ocdbt_dir if "://" in ocdbt_dir else f"file://{ocdbt_dir}"}
  try:
    store = ts.KvStore.open(spec).result()
    keys = store.list().result()
  except Exception as exc:  # pylint: disable=broad-exception-caught
    return f"its OCDBT index (items/manifest.ocdbt): {first_line(exc)}"
  if not keys:
    return "its OCDBT index (items/manifest.ocdbt) is missing or lists no chunks"
  reads = [(key, store.read(key, byte_range=slice(-1, None))) for key in keys]  # all in flight at once
  for key, read in reads:
    try:
      read.result()
    except Exception as exc:  # pylint: disable=broad-exception-caught
      return f"stored chunk {key.decode()}: {first_line(exc)}"
  return None


def first_line(exc: BaseException) -> str:
  """The message's first line, without TensorStore's spec dump."""
  text = str(exc).strip().split(" [tensorstore_spec=")[0]
  return text.splitlines()[0][:300] if text else type(exc).__name__
