"""What temoe adds to MaxText 0.2.5's checkpoints: no non-finite state saved or restored, checksums,
one-line write and restore errors.

MaxText's `checkpointing.save_checkpoint` is the one function every save goes through, called
only when a step is due, and `load_state_if_possible` the one every restore goes through, before
the first step. Wrapped:

- The state is checked finite first (one jitted reduction per save); a NaN/Inf state is never
  committed, so the latest checkpoint stays the last good one, and the run stops naming both.
- Once a step is committed (at once for a synchronous save, at the next save or at
  `wait_until_finished` for an asynchronous one), each process records its files' checksums
  (`temoe.run.checksums`), in a background thread; preflight verifies them before a restore.
- A failed write (a full disk, a quota, a read-only mount), raised at once or from Orbax's
  background commit, stops the run with one line; Orbax commits a step by renaming its
  temporary directory, so nothing half-written is ever listed as a step.
- A restore of this run's checkpoint that fails (a digest mismatch, an unreadable chunk, a
  parameter of another shape) or yields values no saved state holds (flipped bytes with no
  checksum records to catch them: a NaN/Inf anywhere, or a negative Adam second moment, which
  would turn the next step NaN) stops the run before the first step, naming the step, the path,
  the cause and the newest earlier step that restores intact (`te_resume_step=N` resumes from
  it). Damage that decodes to plausible finite values is caught only by the checksum records.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import os

from temoe import exits
from temoe.maxtext import failures
from temoe.oneline import first_line, root_cause

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
      f"listed as a step (the latest committed one is {failures.latest(config.checkpoint_dir)}). Free space or fix the "
      "mount, then run again with the same run_name to resume.", write_exit_code(err)
  )


def write_exit_code(err: OSError) -> int:
  """A full, read-only or forbidden disk needs a person; an I/O error may pass on a retry."""
  return exits.REQUEUE if err.errno in failures.TRANSIENT_ERRNOS else exits.NEEDS_PERSON


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


SECOND_MOMENT = "nu"
"""optax's name for Adam's second moment (adam, adamw, lamb, ...): a running mean of squares, never below 0."""


def impossible_values(tree, limit: int = 3) -> str | None:
  """What in a restored train state no save could have written, or None: the paths (a/b/c) of the first
  `limit` floating leaves holding a NaN/Inf, and of those under opt_state holding a negative second moment."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  leaves = [(path_name(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)]
  if not leaves:
    return None
  moments = tuple(is_second_moment(name) for name, _ in leaves)
  finite, nonnegative = jax.device_get(_leaves_check_fn(moments)(tuple(leaf for _, leaf in leaves)))
  nonfinite = [name for (name, _), ok in zip(leaves, finite) if not ok][:limit]
  negative = [name for (name, _), ok, is_moment in zip(leaves, nonnegative, moments) if is_moment and not ok][:limit]
  found = ([f"NaN/Inf in {', '.join(nonfinite)}"] if nonfinite else []) + (
      [f"a negative Adam second moment in {', '.join(negative)}"] if negative else [])
  return " and ".join(found) or None


def is_second_moment(name: str) -> bool:
  parts = name.split("/")
  return "opt_state" in parts and SECOND_MOMENT in parts


@functools.cache
def _leaves_check_fn(moments: tuple[bool, ...]):
  """One jitted pass: per leaf, (all finite, all >= 0 where it is a second moment)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def check(leaves):
    finite = jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])
    nonnegative = jnp.stack([jnp.all(x >= 0) if moment else jnp.bool_(True) for x, moment in zip(leaves, moments)])
    return finite, nonnegative

  return jax.jit(check)


def path_name(path) -> str:
  name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
  return name.removesuffix("/value")  # an NNX variable's array


class RestoreFailed(failures.TrainingStopped):
  """This run's checkpoint could not be restored as saved; raised before the first step."""


def restore_failed(manager, step: int, cause: str, verify, transient: bool = False) -> RestoreFailed:
  """The one line for a damaged latest checkpoint: the step, its path, why, and what restores instead."""
  from temoe.run import preflight  # pylint: disable=import-outside-toplevel

  directory = str(manager.directory)
  good = None
  for earlier in reversed([s for s in preflight.finalized_steps(directory) if s < step][-VERIFY_EARLIER:]):
    if preflight.step_problem(directory, earlier) is None and verify(earlier) is None:
      good = earlier
      break
  if good is None:
    what = "no earlier step restores intact: pass a new run_name to start afresh"
  else:
    what = (f"the newest earlier step that restores intact is {good}: pass te_resume_step={good} to resume from it "
            f"(later steps are moved to {preflight.SET_ASIDE}/), or a new run_name to start afresh")
  code = exits.REQUEUE if transient else exits.NEEDS_PERSON
  return RestoreFailed(f"the checkpoint of step {step} at {directory.rstrip('/')}/{step}, which this run would resume "
                       f"from, cannot be restored: {cause}; {what}.", code)


VERIFY_EARLIER = 3
"""Earlier steps restored in full (newest first) to find one that restores intact, at most."""


def shape_mismatch(directory: str, step: int, target) -> str | None:
  """The first parameter whose stored shape differs from what this config builds: 'name: checkpoint
  (a, b), this config (c, d)', from Orbax's metadata of the step (nothing restored), or None."""
  import asyncio  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import v1 as ocp  # pylint: disable=import-outside-toplevel

  try:
    stored = asyncio.run(ocp.handlers.PyTreeHandler().metadata(epath.Path(directory) / str(step) / "items"))
  except Exception:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    return None
  stored_shapes = {path_name(p): tuple(getattr(leaf, "shape", ()) or ())
                   for p, leaf in jax.tree_util.tree_flatten_with_path(stored)[0] if hasattr(leaf, "shape")}
  leaves = [(path_name(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]
            if hasattr(leaf, "dtype") and jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)]
  # parameters and optimizer moments (an RNG key is stored as its raw uint32 words), the parameters first
  for name, leaf in sorted(leaves, key=lambda item: "opt_state" in item[0]):
    want = tuple(leaf.shape)
    have = stored_shapes.get(name)
    if have is not None and have != want:
      return f"parameter {name} is {have} in the checkpoint and {want} in this config (another model shape?)"
  return None


def install_restore(checkpointing) -> None:
  """Wraps MaxText's load_state_if_possible: a restore of this run's checkpoint that fails or yields
  impossible values stops before the first step with one line."""
  original_load = checkpointing.load_state_if_possible

  @functools.wraps(original_load)
  def load_state_if_possible(checkpoint_manager, data_iterator, *args, **kwargs):
    step = checkpointing.latest_step(checkpoint_manager) if checkpoint_manager is not None else None
    if kwargs.get("step", -1) >= 0:
      step = kwargs["step"]
    if step is None:
      return original_load(checkpoint_manager, data_iterator, *args, **kwargs)

    def verify(earlier: int) -> str | None:
      """Why step `earlier` does not restore intact (its Grain iterator left alone), or None."""
      try:
        restored, _ = original_load(checkpoint_manager, None, *args, **{**kwargs, "step": earlier})
      except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
        return first_line(root_cause(exc))
      return impossible_values(restored.get("items") if isinstance(restored, dict) else restored)

    try:
      restored, params = original_load(checkpoint_manager, data_iterator, *args, **kwargs)
    except Exception as exc:  # pylint: disable=broad-exception-caught
      target = kwargs.get("abstract_unboxed_pre_state", args[3] if len(args) > 3 else None)
      mismatch = shape_mismatch(str(checkpoint_manager.directory), step, checkpoint_dict(target))
      if mismatch:
        raise RestoreFailed(f"the checkpoint of step {step} at {str(checkpoint_manager.directory).rstrip('/')}/{step} "
                            f"does not fit this config: {mismatch}; train this config under a new run_name, or "
                            "resume with the settings the run was started with.") from exc
      raise restore_failed(checkpoint_manager, step, first_line(root_cause(exc)), verify,
                           failures.is_transient(exc)) from exc
    bad = impossible_values(restored.get("items") if isinstance(restored, dict) else restored)
    if bad:
      cause = (f"it restored with {bad} (its files changed after the save, or it was saved so by a run without "
               "temoe's finite check)")
      raise restore_failed(checkpoint_manager, step, cause, verify)
    return restored, params

  _installed["load"] = original_load
  checkpointing.load_state_if_possible = load_state_if_possible


def checkpoint_dict(abstract_state):
  """The restore target in the layout MaxText stores (its Linen on-disk dict for an NNX state)."""
  from maxtext.common import train_state_nnx  # pylint: disable=import-outside-toplevel

  try:
    return train_state_nnx.to_checkpoint_dict(abstract_state)
  except Exception:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    return abstract_state


def install() -> None:
  """Wraps MaxText's save_checkpoint, wait_until_finished and load_state_if_possible (once)."""
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
          f"checkpointed; the latest checkpoint ({failures.latest(config.checkpoint_dir)}) is the last good one: rerun "
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
          "the same run_name to resume.", write_exit_code(err)
      ) from exc
    for directory in list(_pending):
      record_committed(directory, wait=True)

  _installed.update(save=original_save, wait=original_wait)
  checkpointing.save_checkpoint = save_checkpoint
  checkpointing.wait_until_finished = wait_until_finished
  install_restore(checkpointing)


def missing_seams() -> list[str]:
  """The MaxText functions this module (and `failures`) hook that the installed MaxText lacks."""
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  missing = [f"checkpointing.{name}" for name in ("save_checkpoint", "wait_until_finished", "maybe_save_checkpoint",
                                                  "load_state_if_possible", "latest_step")
             if not callable(getattr(checkpointing, name, None))]
  return missing + failures.missing_seams()
