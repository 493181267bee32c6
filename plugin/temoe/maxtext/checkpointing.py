"""What temoe adds to MaxText 0.2.5's checkpoint saves: no non-finite state, checksums, one-line write errors.

MaxText's `checkpointing.save_checkpoint` is the one function every save goes through, called
only when a step is due. Wrapped:

- The state is checked finite first (one jitted reduction per save); a NaN/Inf state is never
  committed, so the latest checkpoint stays the last good one, and the run stops naming both.
- Once a step is committed (at once for a synchronous save, at the next save or at
  `wait_until_finished` for an asynchronous one), each process records its files' checksums
  (`temoe.run.checksums`), in a background thread; preflight verifies them before a restore.
- A failed write (a full disk, a quota, a read-only mount), raised at once or from Orbax's
  background commit, stops the run with one line; Orbax commits a step by renaming its
  temporary directory, so nothing half-written is ever listed as a step.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import os

from temoe.maxtext import failures

WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EFBIG}

_installed: dict = {}
_pending: dict[str, set[int]] = {}  # checkpoint_dir -> steps saved here whose checksums are not recorded yet
_hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="temoe-checksums")
_hashing: list[concurrent.futures.Future] = []


def nonfinite_parts(state) -> list[str]:
  """Top-level parts of the train state (model, optimizer) holding a NaN or Inf."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  groups: dict[str, list] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact):
      key = path[0] if path else "state"
      groups.setdefault(str(getattr(key, "key", getattr(key, "name", key))), []).append(leaf)
  flags = _all_finite(tuple(groups.values()))
  return [name for name, ok in zip(groups, jax.device_get(flags)) if not ok]


@functools.cache
def _finite_fn():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  return jax.jit(lambda groups: [jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in g])) for g in groups])


def _all_finite(groups):
  return _finite_fn()(groups)


def write_error(exc: BaseException) -> OSError | None:
  """The OSError of a failed write in `exc`'s cause/context chain, or None."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
      return exc
    text = str(exc)
    for code in WRITE_ERRNOS:  # TensorStore and Orbax re-raise errno text inside other exception types
      if os.strerror(code) in text:
        return OSError(code, os.strerror(code), getattr(exc, "filename", None))
    exc = exc.__cause__ or exc.__context__
  return None


def write_failed(step: int, config, err: OSError) -> failures.TrainingStopped:
  where = err.filename or config.checkpoint_dir
  earlier = sorted(_pending.get(config.checkpoint_dir, ()))  # asynchronous saves not committed yet
  what = f"step {earlier[0]} (an asynchronous save, found failed when saving step {step})" if earlier else f"step {step}"
  return failures.TrainingStopped(
      f"the checkpoint of {what} could not be written to {where}: {err.strerror}; nothing of it is "
      f"listed as a step (the latest committed one is {latest(config.checkpoint_dir)}). Free space or fix the "
      "mount, then run again with the same run_name to resume."
  )


def latest(checkpoint_dir: str) -> str:
  from temoe.run import preflight  # pylint: disable=import-outside-toplevel

  steps = preflight.finalized_steps(checkpoint_dir)
  return f"step {steps[-1]}" if steps else "none"


def record_committed(checkpoint_dir: str, wait: bool = False) -> None:
  """Queues checksum records for this process's saved steps that Orbax has committed since."""
  import jax  # pylint: disable=import-outside-toplevel

  from temoe.run import checksums, preflight  # pylint: disable=import-outside-toplevel

  pending = _pending.get(checkpoint_dir)
  if pending:
    committed = pending & set(preflight.finalized_steps(checkpoint_dir))
    for step in sorted(committed):
      _hashing.append(_hasher.submit(checksums.record, checkpoint_dir, step, jax.process_index()))
    pending -= committed
  if wait:
    while _hashing:
      _hashing.pop(0).result()


def install() -> None:
  """Wraps MaxText's save_checkpoint and wait_until_finished (once)."""
  if _installed:
    return
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  original_save, original_wait = checkpointing.save_checkpoint, checkpointing.wait_until_finished

  @functools.wraps(original_save)
  def save_checkpoint(checkpoint_manager, step, state, config=None, data_iterator=None, force=False):
    if config is None or not getattr(config, "enable_checkpointing", False):
      return original_save(checkpoint_manager, step, state, config, data_iterator, force)
    bad = nonfinite_parts(state)
    if bad:
      raise failures.TrainingStopped(
          f"the train state after step {step} has NaN/Inf values (in {', '.join(bad)}), so it was not "
          f"checkpointed; the latest checkpoint ({latest(config.checkpoint_dir)}) is the last good one: rerun "
          "with the same run_name to resume from it, after lowering learning_rate or fixing the data."
      )
    record_committed(config.checkpoint_dir)
    try:
      saved = original_save(checkpoint_manager, step, state, config, data_iterator, force)
    except Exception as exc:  # pylint: disable=broad-exception-caught
      err = write_error(exc)
      if err is None:
        raise
      raise write_failed(step, config, err) from exc
    if saved:
      _pending.setdefault(config.checkpoint_dir, set()).add(int(step))
      record_committed(config.checkpoint_dir)
    return saved

  @functools.wraps(original_wait)
  def wait_until_finished(checkpoint_manager):
    try:
      original_wait(checkpoint_manager)
    except Exception as exc:  # pylint: disable=broad-exception-caught
      err = write_error(exc)
      if err is None:
        raise
      step = max((s for steps in _pending.values() for s in steps), default="?")
      directory = str(getattr(checkpoint_manager, "directory", "") or next(iter(_pending), ""))
      raise failures.TrainingStopped(
          f"the checkpoint of step {step} could not be written{' to ' + directory if directory else ''}: "
          f"{err.strerror}; nothing of it is listed as a step. Free space or fix the mount, then run again with "
          "the same run_name to resume."
      ) from exc
    for directory in list(_pending):
      record_committed(directory, wait=True)

  _installed.update(save=original_save, wait=original_wait)
  checkpointing.save_checkpoint = save_checkpoint
  checkpointing.wait_until_finished = wait_until_finished


def missing_seams() -> list[str]:
  """The MaxText functions this module (and `failures`) hook that the installed MaxText lacks."""
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  missing = [f"checkpointing.{name}" for name in ("save_checkpoint", "wait_until_finished", "maybe_save_checkpoint")
             if not callable(getattr(checkpointing, name, None))]
  return missing + failures.missing_seams()
