"""Checks a `temoe train` run before MaxText starts, where MaxText's own failure comes late or obscure.

- An output directory this process cannot write: MaxText fails inside TensorBoard's writer after
  building the model, or, with TensorBoard and checkpoints off, trains and keeps nothing.
- A latest checkpoint Orbax cannot read (truncated or missing files, bad metadata): MaxText's
  restore ends in Orbax's "incompatible handler" error followed by the whole abstract state tree.

- Values that pass MaxText's config validation and fail later inside JAX (batch, sequence length,
  experts per token, routing groups, a mesh that does not span the devices, steps), a run_name
  that leaves base_output_directory, a metrics_file that cannot be written, unreadable data.
- A mesh whose axes do not split some parameter evenly (`temoe.tools.shardings`), which JAX refuses in
  MaxText's first compile.
- Less free disk than one checkpoint of this train state (its size as `temoe plan` computes it,
  from MaxText's abstract state), and a second run holding the run directory (`temoe.run.lock`).
- A latest checkpoint whose files differ from the checksums recorded at save (`temoe.run.checksums`),
  or whose Grain iterator state is missing; with `te_resume_step=N`, step N instead, the later
  steps moved aside (`set_aside`).
- Token ids outside [0, vocab_size), nulls, wrong types, short rows (`temoe.run.tokens`).
- A checkpoint or TensorBoard directory that is not a writable directory.
- A run that already finished (its latest checkpoint is its last step): `RunFinished`, exit 0.

Each check raises `PreflightError` (a `TemoeConfigError`, so `temoe train` prints one line and
exits 2) naming what to do. They read what MaxText would read, with MaxText's and Orbax's own
functions, and write nothing but the run directory MaxText would create anyway (and its lock).
"""

from __future__ import annotations

import os
import tempfile

from temoe import oneline, recipes


class PreflightError(recipes.TemoeConfigError):
  """A run that would fail in MaxText later, and less clearly."""


class RunFinished(Exception):
  """The run asked for has already run all its steps (a requeue of a finished job): nothing to do."""


_held: list = []  # the run lock check(lock_run=True) took, until release()


def check(maxtext_args: list[str], lock_run: bool = False):
  """Builds the run's config as MaxText will (temoe registered) and checks it; returns the config.

  With `lock_run`, takes the run directory's lock (`release()` gives it back) before the checks
  that read the run's checkpoints.
  """
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel
  from temoe.run import datacheck, lock, preemption, tokens  # pylint: disable=import-outside-toplevel

  config = introspect.initialize_config(["temoe train", *maxtext_args], log_config=False)  # MaxText logs it once, itself
  check_values(config)
  check_run_name(config.run_name)
  check_output_dir(config.base_output_directory, config.run_name)
  check_metrics_file(config.metrics_file)
  check_tensorboard_dir(config)
  datacheck.check(config)
  tokens.check(config)
  if lock_run:
    held = lock.acquire(os.path.join(config.base_output_directory, config.run_name))
    if held is not None:
      _held.append(held)
  latest = None
  if config.enable_checkpointing:
    check_writable_dir(config.checkpoint_dir, "the checkpoint directory")
    iterator = config.dataset_type == "grain"
    if config.te_resume_step >= 0 and not resumed_before(config.checkpoint_dir, config.te_resume_step):
      latest = resume_from(config.checkpoint_dir, config.te_resume_step, iterator, move=lock_run)
    else:
      latest = check_latest_checkpoint(config.checkpoint_dir, expect_iterator=iterator)
    if latest is not None and latest + 1 >= config.steps:
      raise RunFinished(
          f"run {os.path.join(config.base_output_directory, config.run_name)} has finished: its latest checkpoint is "
          f"step {latest}, the last of steps={config.steps}; nothing to do (pass steps > {latest + 1} to train on, or "
          "another run_name to start afresh)."
      )
    check_disk_space(config)
  preemption.sync_from(latest + 1 if latest is not None else 0)
  return config


def release() -> None:
  """Gives back the run lock check() took, if any."""
  while _held:
    _held.pop().release()


def check_values(config) -> None:
  """Values MaxText's validation lets through and JAX fails on later, after compiling."""
  check_numbers(config)
  check_mesh(config)
  check_shardings(config)


def check_numbers(config) -> None:
  """Sizes and counts that must be positive, and the MoE routing numbers, whatever set them (YAML or argument)."""
  from temoe.run import inputs  # pylint: disable=import-outside-toplevel

  for key in inputs.POSITIVE:
    value = getattr(config, key)
    if not 0 < value < float("inf"):
      raise PreflightError(f"{key}={value} must be greater than 0 (and finite).")
  check_periods(config)
  if config.num_experts > 1:
    if not 1 <= config.num_experts_per_tok <= config.num_experts:
      raise PreflightError(
          f"num_experts_per_tok={config.num_experts_per_tok} must be between 1 and num_experts={config.num_experts}."
      )
    groups = config.n_routing_groups
    if groups > 0 and config.num_experts % groups:
      raise PreflightError(
          f"num_experts={config.num_experts} is not divisible by n_routing_groups={groups}; pass a divisor "
          "of num_experts, or n_routing_groups=-1 for no group routing."
      )
    if groups > 0 and not 0 < config.topk_routing_group <= groups:
      raise PreflightError(
          f"topk_routing_group={config.topk_routing_group} must be between 1 and n_routing_groups={groups}."
      )
    if groups > 0 and config.num_experts_per_tok > (config.num_experts // groups) * config.topk_routing_group:
      raise PreflightError(
          f"num_experts_per_tok={config.num_experts_per_tok} exceeds the experts of the topk_routing_group="
          f"{config.topk_routing_group} groups picked ({config.num_experts // groups} each)."
      )


PERIODS = {  # key -> (when MaxText 0.2.5 divides by it or counts with it, what it counts)
    "log_period": (lambda c: True, "MaxText writes metrics every log_period steps"),
    "checkpoint_period": (lambda c: c.enable_checkpointing,
                          "MaxText saves every checkpoint_period steps; pass enable_checkpointing=false for none"),
    "local_checkpoint_period": (
        lambda c: c.enable_emergency_checkpoint or c.enable_multi_tier_checkpointing,
        "the emergency / multi-tier checkpoints are saved every local_checkpoint_period steps"),
    "profiler_steps": (lambda c: bool(c.profiler), "the steps MaxText's profiler traces"),
    "num_epoch": (lambda c: c.dataset_type == "grain", "the passes over grain_train_files"),
    "max_num_checkpoints_to_keep": (
        lambda c: c.enable_checkpointing and c.max_num_checkpoints_to_keep is not None,
        "the checkpoints Orbax keeps; leave it unset (None) to keep all"),
}
"""Counts and periods that must be at least 1 where MaxText uses them: 0 divides by zero after the model is
built (log_period, checkpoint_period), a negative one saves or checks almost never, or fails in the input
pipeline. learning_rate_schedule_steps is checked beside them (-1: as long as steps)."""


def check_periods(config) -> None:
  """Each PERIODS key MaxText will use is an integer >= 1; one line naming the key and the valid range."""
  for key, (used, what) in PERIODS.items():
    value = getattr(config, key, None)
    if value is None or not used(config):
      continue
    if not (isinstance(value, int) and value >= 1):
      raise PreflightError(f"{key}={value} must be a whole number of at least 1 ({what}).")
  schedule = getattr(config, "learning_rate_schedule_steps", -1)
  if schedule != -1 and not (isinstance(schedule, int) and schedule >= 1):
    raise PreflightError(f"learning_rate_schedule_steps={schedule} must be -1 (the schedule as long as steps) or a "
                         "whole number of at least 1.")


def check_mesh(config) -> None:
  """The mesh spans this job's devices, and the batch splits over them (MaxText's own checks, early)."""
  import jax  # pylint: disable=import-outside-toplevel
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  axes = [f"{kind}_{axis}_parallelism={value}" for kind, values in (("ici", config.ici_parallelism),
          ("dcn", config.dcn_parallelism)) for axis, value in zip(config.mesh_axes, values) if value != 1]
  try:
    introspect.device_mesh(config)
  except (AssertionError, ValueError) as exc:
    if (why := slices_unfit(config, jax.devices())):
      raise PreflightError(why) from exc
    raise PreflightError(
        f"the mesh ({', '.join(axes) or 'all axes 1'}) does not fit the {jax.device_count()} device(s) of this job: "
        f"{str(exc).split(chr(10))[0].strip()}; make the product of the ici_*/dcn_* parallelisms match, or leave one -1."
    ) from exc
  devices = jax.device_count()
  if config.dataset_type != "synthetic" and int(config.global_batch_size_to_load) % devices:
    raise PreflightError(
        f"the global batch of {config.global_batch_size_to_load} sequences (per_device_batch_size="
        f"{config.per_device_batch_size} x {devices} devices) does not split evenly over the {devices} devices; "
        "pick a per_device_batch_size that makes it a multiple."
    )


def slices_unfit(config, devices) -> str | None:
  """Why MaxText's mesh of `num_slices` slices cannot be laid over `devices`, if slices are the reason: the
  count does not divide them, or they report no slice (MaxText's hybrid mesh reads each device's slice_index)."""
  slices = int(getattr(config, "num_slices", 1) or 1)
  if slices <= 1:
    return None
  if len(devices) % slices:
    return (f"num_slices={slices} does not divide this job's {len(devices)} device(s) (each slice, a node of a "
            "multi-node job, holds as many); set num_slices=-1 (MaxText counts the slices) or a divisor.")
  if not all(hasattr(d, "slice_index") for d in devices):
    return (f"num_slices={slices}, but this job's {len(devices)} {devices[0].platform} device(s) report no slice "
            "(slice_index): slices are the nodes of a multi-node GPU job started with jax.distributed, or of JAX's "
            "mock GPU topology; set num_slices=-1 (MaxText counts the slices) or 1.")
  return None


def check_shardings(config) -> None:
  """Every parameter and optimizer leaf splits evenly over the mesh axes MaxText shards it on: JAX refuses an
  uneven split of a jit's outputs (IndivisibleError) in MaxText's first compile, where on a GPU Transformer Engine's
  context manager hides it as "generator didn't stop after throw()"; read off MaxText's abstract state."""
  import jax  # pylint: disable=import-outside-toplevel

  from temoe.tools import hbm, planner, shardings  # pylint: disable=import-outside-toplevel

  if jax.device_count() == 1:
    return
  mesh = planner.abstract_mesh(config, jax.device_count())
  found = shardings.indivisible(hbm.abstract_state(config, mesh))
  if found:
    axes = " ".join(f"{a}={n}" for a, n in dict(mesh.shape).items() if n > 1)
    raise PreflightError(f"{shardings.refusal(found)}; the mesh ({axes}) cannot hold this model: choose parallelisms "
                         "whose products divide these dimensions (`temoe plan --sweep` ranks only such layouts).")


def check_run_name(run_name: str) -> None:
  """One directory under base_output_directory: no separator, no `..`."""
  if not run_name or os.sep in run_name or (os.altsep and os.altsep in run_name) or run_name in (".", ".."):
    raise PreflightError(
        f"run_name={run_name!r} must be one directory name (no '/', not '.' or '..'): "
        "runs live directly under base_output_directory."
    )


def check_metrics_file(metrics_file: str) -> None:
  """MaxText appends to metrics_file after step 0; check it can, before compiling. A file not there yet is
  not created: every process of a job may check the same path at once, so the check creates a file of its
  own beside it instead (creating and removing the shared name raced: one process removed what another had
  just created and then failed to remove)."""
  if not metrics_file or "://" in metrics_file:
    return
  try:
    if os.path.isdir(metrics_file):
      raise IsADirectoryError(21, "Is a directory")
    if os.path.exists(metrics_file):
      with open(metrics_file, "a", encoding="utf-8"):
        pass
    else:
      parent = os.path.dirname(os.path.abspath(metrics_file))
      os.makedirs(parent, exist_ok=True)
      with tempfile.NamedTemporaryFile(dir=parent, prefix=".temoe-write-check-"):
        pass
  except OSError as exc:
    raise PreflightError(
        f"metrics_file={metrics_file} cannot be written ({exc.strerror or exc}); pass a file path this process can "
        "write, or metrics_file='' for none."
    ) from exc


DISK_MARGIN = 1.1
"""Free space asked for beyond one checkpoint (OCDBT indexes, the Grain state, metrics)."""


def checkpoint_bytes(config) -> int:
  """Bytes of one checkpoint of this run: MaxText's abstract train state (what `temoe plan` sizes), summed."""
  import jax  # pylint: disable=import-outside-toplevel

  from temoe.tools import hbm  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.AbstractMesh(tuple(1 for _ in config.mesh_axes), tuple(config.mesh_axes))
  state = hbm.abstract_state(config, mesh)
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(state))


def free_bytes(path: str) -> int:
  """Free bytes (for this user) on the filesystem that holds, or will hold, `path`."""
  probe = os.path.abspath(path)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  stat = os.statvfs(probe)
  return stat.f_bavail * stat.f_frsize


def check_disk_space(config) -> None:
  """Room for one more checkpoint where MaxText writes them (local filesystems)."""
  if "://" in config.checkpoint_dir:
    return
  need = int(checkpoint_bytes(config) * DISK_MARGIN)
  free = free_bytes(config.checkpoint_dir)
  if free < need:
    raise PreflightError(
        f"{config.checkpoint_dir} has {free / 2**20:,.1f} MiB free, less than one checkpoint of this run "
        f"({need / 2**20:,.1f} MiB with a {DISK_MARGIN - 1:.0%} margin); free space, point base_output_directory "
        "elsewhere, or pass enable_checkpointing=false."
    )


def check_output_dir(base_output_directory: str, run_name: str) -> None:
  """The run directory exists or can be made, and takes a file (MaxText's own probe)."""
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  run_dir = os.path.join(base_output_directory, run_name)
  try:
    introspect.make_writable_dir(run_dir)
  except Exception as exc:  # pylint: disable=broad-exception-caught
    raise PreflightError(
        f"base_output_directory={base_output_directory} is not writable by this process "
        f"({type(exc).__name__}: {exc}); pass a directory it can create and write."
    ) from exc


def check_writable_dir(path: str, what: str) -> None:
  """`path` (local) is, or can be made as, a directory this process can create files in: a probe file
  is made and removed in it, or in the nearest directory above it that exists (nothing is left)."""
  if "://" in path:
    return
  local = os.path.normpath(path)  # "a-file/" would not exist, and makedirs would then fail with EEXIST
  existing = local
  while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  try:
    if not os.path.isdir(existing):
      raise NotADirectoryError(20, "Not a directory")
    with tempfile.NamedTemporaryFile(dir=existing, prefix=".temoe-probe-"):  # a name of its own: hosts share disks
      pass
  except OSError as exc:
    raise PreflightError(
        f"{what} {path} is not a writable directory ({exc.strerror or exc}); fix its permissions or mount, or point "
        "base_output_directory elsewhere."
    ) from exc


def check_tensorboard_dir(config) -> None:
  """MaxText's TensorBoard writer makes tensorboard_dir after the model is built; a file there fails it."""
  if config.enable_tensorboard and config.tensorboard_dir:
    check_writable_dir(config.tensorboard_dir, "tensorboard_dir")


SET_ASIDE = "temoe-set-aside"
"""Where `te_resume_step` moves the steps after the one resumed from (beside checkpoints/, in the run)."""


def resume_from(checkpoint_dir: str, step: int, expect_iterator: bool, move: bool) -> int:
  """Checks committed step `step` and, if `move`, sets every later step aside so MaxText restores it."""
  steps = finalized_steps(checkpoint_dir)
  if step not in steps:
    raise PreflightError(
        f"te_resume_step={step}: {checkpoint_dir} has no committed step {step}; its steps: "
        f"{', '.join(map(str, steps)) or 'none'}."
    )
  problem = step_problem(checkpoint_dir, step, expect_iterator)
  if problem:
    raise PreflightError(f"te_resume_step={step}: checkpoint {checkpoint_dir.rstrip('/')}/{step} cannot be read: "
                         f"{problem}; {newest_verified_hint(checkpoint_dir, step, expect_iterator)}")
  later = [s for s in steps if s > step]
  if move:
    where = set_aside(checkpoint_dir, later)
    with open(os.path.join(os.path.dirname(where), f"resumed-from-{step}"), "w", encoding="utf-8") as f:
      f.write(f"{os.path.basename(where)}\n")  # done once: a requeue with the same arguments resumes from the latest
  return step


def resumed_before(checkpoint_dir: str, step: int) -> bool:
  """Whether `te_resume_step=step` was applied to this run already (it then resumes from its latest)."""
  return os.path.exists(os.path.join(os.path.dirname(os.path.normpath(checkpoint_dir)), SET_ASIDE,
                                     f"resumed-from-{step}"))


def set_aside(checkpoint_dir: str, steps: list[int]) -> str:
  """Moves committed steps (and their checksum records) out of the checkpoint directory; returns where."""
  import datetime  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel

  from temoe.run import checksums  # pylint: disable=import-outside-toplevel

  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  where = os.path.join(os.path.dirname(os.path.normpath(checkpoint_dir)), SET_ASIDE, stamp)
  os.makedirs(where, exist_ok=True)
  if not steps:
    return where
  records = checksums.records_dir(checkpoint_dir)
  for step in steps:
    shutil.move(os.path.join(checkpoint_dir, str(step)), os.path.join(where, str(step)))
    for name in os.listdir(records) if os.path.isdir(records) else []:
      if name.startswith(f"{step}.process_"):
        shutil.move(os.path.join(records, name), os.path.join(where, name))
  print(f"temoe: te_resume_step: moved checkpoint step(s) {', '.join(map(str, steps))} to {where}", flush=True)
  return where


def step_problem(checkpoint_dir: str, step: int, expect_iterator: bool = False) -> str | None:
  """Why committed step `step` cannot be restored as saved (unreadable, or unlike its checksums), or None."""
  from temoe.run import checksums  # pylint: disable=import-outside-toplevel

  problem = unreadable(f"{checkpoint_dir.rstrip('/')}/{step}", expect_iterator)
  if problem is None and "://" not in checkpoint_dir:
    changed = checksums.mismatch(checkpoint_dir, step)
    problem = f"{changed} (checksums recorded at save)" if changed else None
  return problem


def newest_verified(checkpoint_dir: str, below: int, expect_iterator: bool = False) -> int | None:
  """The newest committed step before `below` that reads and matches its checksums, or None."""
  for step in reversed([s for s in finalized_steps(checkpoint_dir) if s < below]):
    if step_problem(checkpoint_dir, step, expect_iterator) is None:
      return step
  return None


def newest_verified_hint(checkpoint_dir: str, below: int, expect_iterator: bool = False) -> str:
  """What to do instead: resume from the newest earlier step that verifies, or start afresh."""
  good = newest_verified(checkpoint_dir, below, expect_iterator)
  if good is None:
    return "no earlier step verifies: pass a new run_name to start afresh."
  return (f"the newest earlier step that verifies is {good}: pass te_resume_step={good} to resume from it (later steps "
          f"are moved to {SET_ASIDE}/), or a new run_name to start afresh.")


def finalized_steps(checkpoint_dir: str) -> list[int]:
  """Committed checkpoint steps, ascending, as Orbax lists them (in-flight saves excluded)."""
  from etils import epath  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import path as ocp_path  # pylint: disable=import-outside-toplevel

  return sorted(ocp_path.step.checkpoint_steps(checkpoint_dir)) if epath.Path(checkpoint_dir).exists() else []


def check_latest_checkpoint(checkpoint_dir: str, expect_iterator: bool = False) -> int | None:
  """The step MaxText will restore, if any, after checking Orbax can read it and it is what was saved."""
  steps = finalized_steps(checkpoint_dir)
  if not steps:
    return None
  problem = step_problem(checkpoint_dir, steps[-1], expect_iterator)
  if problem:
    raise PreflightError(
        f"the latest checkpoint {checkpoint_dir.rstrip('/')}/{steps[-1]}, which MaxText would restore, cannot be read: "
        f"{problem}; {newest_verified_hint(checkpoint_dir, steps[-1], expect_iterator)}"
    )
  return steps[-1]


def unreadable(step_dir: str, expect_iterator: bool = False) -> str | None:
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
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    return f"Orbax cannot read the train state's metadata (items/): {type(exc).__name__}: {first_line(exc)}"
  iterator = epath.Path(step_dir) / "iter"
  if expect_iterator and not (iterator.exists() and any(iterator.iterdir())):
    return "it has no Grain iterator state (iter/), so the data would restart from its beginning"
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
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    return f"its OCDBT index (items/manifest.ocdbt): {first_line(exc)}"
  if not keys:
    return "its OCDBT index (items/manifest.ocdbt) is missing or lists no chunks"
  reads = [(key, store.read(key, byte_range=slice(-1, None))) for key in keys]  # all in flight at once
  for key, read in reads:
    try:
      read.result()
    except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
      return f"stored chunk {key.decode()}: {first_line(exc)}"
  return None


def first_line(exc: BaseException) -> str:
  """The message's first line, without TensorStore's spec dump."""
  return oneline.first_line(exc, 300).removeprefix(f"{type(exc).__name__}: ")
