"""What a user passes to `temoe train` (and plan, profile): the config YAML chain and key=value settings.

MaxText reads these late and loudly: a missing YAML becomes a `src/<path>` it never had, an empty
one or one without `base_config` a KeyError, a misspelled key a 45 KB list of every field. These
checks read the same files by the same rules (`base_config` relative to the YAML, then MaxText's
own configs folder) and raise `InputError` with one line naming the fix.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re

from temoe import recipes


class InputError(recipes.TemoeConfigError):
  """An argument or config file MaxText would fail on later, and less clearly."""


def maxtext_configs_dir() -> str:
  """MaxText's packaged configs folder (where `base_config: base.yml` is found), without importing it."""
  spec = importlib.util.find_spec("maxtext")
  roots = list(spec.submodule_search_locations or []) if spec else []
  return os.path.join(roots[0], "configs") if roots else ""


def check_config_file(path: str, child: str | None = None) -> None:
  """The YAML at `path` and every `base_config` below it exist, parse, and are mappings."""
  import yaml  # pylint: disable=import-outside-toplevel

  named = f"base_config of {child}" if child else "config"
  if not os.path.exists(path):
    raise InputError(f"{named} {path} does not exist; pass the path of a MaxText config YAML.")
  if not os.path.isfile(path):
    raise InputError(f"{named} {path} is not a file; pass the path of a MaxText config YAML.")
  try:
    with open(path, encoding="utf-8") as f:
      data = yaml.load(f, Loader=unique_keys_loader())  # noqa: S506 (a SafeLoader subclass)
  except (OSError, UnicodeDecodeError) as exc:
    raise InputError(f"{named} {path} cannot be read: {exc}") from exc
  except DuplicateKey as exc:
    raise InputError(f"{named} {path} sets {exc.key!r} twice (lines {exc.first} and {exc.line}); MaxText refuses a "
                     "repeated key: keep one of them.") from exc
  except yaml.YAMLError as exc:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    raise InputError(f"{named} {path} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from exc
  if data is None:
    raise InputError(f"{named} {path} is empty; a MaxText config needs at least `base_config: base.yml`.")
  if not isinstance(data, dict):
    raise InputError(f"{named} {path} holds a YAML {type(data).__name__}, not a mapping of MaxText keys.")
  base = data.get("base_config")
  if base is None:
    if os.path.realpath(os.path.dirname(path)) == os.path.realpath(maxtext_configs_dir()):
      return  # MaxText's own base.yml (or a sibling of it) ends the chain
    raise InputError(f"{named} {path} has no base_config; add `base_config: base.yml` (MaxText's defaults).")
  if os.path.isabs(str(base)):
    parent = str(base)
  else:
    parent = os.path.join(os.path.dirname(path), str(base))
    if not os.path.isfile(parent):
      parent = os.path.join(maxtext_configs_dir(), str(base))
  if not os.path.isfile(parent):
    raise InputError(
        f"base_config: {base} of {path} is neither beside it nor in MaxText's configs ({maxtext_configs_dir()})."
    )
  if child is not None and os.path.realpath(parent) == os.path.realpath(child):
    raise InputError(f"base_config of {path} points back to {child}.")
  check_config_file(parent, child=path)


class DuplicateKey(Exception):
  """A mapping key written twice in a YAML file (OmegaConf, which MaxText reads YAML with, refuses it late)."""

  def __init__(self, key, first: int, line: int):
    super().__init__(f"duplicate key {key!r} at lines {first} and {line}")
    self.key, self.first, self.line = key, first, line


def unique_keys_loader():
  """yaml's SafeLoader, refusing a mapping that repeats a key (PyYAML keeps the last one without a word)."""
  import yaml  # pylint: disable=import-outside-toplevel

  class Loader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
    def construct_mapping(self, node, deep=False):
      seen = {}
      for key_node, _ in node.value:
        key = self.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if isinstance(key, str) and key in seen:
          raise DuplicateKey(key, seen[key], line)
        if isinstance(key, str):
          seen[key] = line
      return super().construct_mapping(node, deep)

  return Loader


SETTING = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=")


def check_settings(settings: list[str], usage: str) -> None:
  """Every argument after the YAML is MaxText's `key=value`, and every boolean key gets a boolean."""
  for arg in settings:
    if not SETTING.match(arg):
      raise InputError(f"{arg!r} is not a key=value setting; usage: {usage}")
  fields = config_fields()
  for arg in settings:
    key, value = arg.split("=", 1)
    if key.split(".")[0] not in fields:  # OmegaConf nests `a.b=1` under key a
      raise InputError(unknown_key_message(key, fields))
    if fields[key].annotation is bool and value.strip().lower() not in BOOLEANS:
      raise InputError(f"{key}={value} is not a boolean; valid choices: true, false.")
    check_number(key, value, fields[key].annotation)


POSITIVE = ("steps", "per_device_batch_size", "max_target_length", "gradient_accumulation_steps")
"""Keys whose values must be greater than 0 (MaxText lets 0 and negatives through, and JAX fails late
or, in `temoe plan` and the FLOP count, computes nonsense)."""


def check_number(key: str, value: str, annotation) -> None:
  """A number for an int/float key is finite, and positive for the POSITIVE keys."""
  import math  # pylint: disable=import-outside-toplevel
  import typing  # pylint: disable=import-outside-toplevel

  kinds = set(typing.get_args(annotation)) | {annotation}
  if not kinds & {int, float}:
    return
  try:
    number = float(value)
  except ValueError:
    return  # MaxText's own validation names a value that is no number
  if not math.isfinite(number):
    raise InputError(f"{key}={value} is not a finite number.")
  if key in POSITIVE and not number > 0:
    raise InputError(f"{key}={value} must be greater than 0.")


BOOLEANS = {"true", "false", "1", "0", "yes", "no", "on", "off", "t", "f", "y", "n"}
"""What pydantic (after OmegaConf) reads as a boolean."""


def config_fields() -> dict:
  """Every key `temoe train` accepts: MaxText's config fields (nested models too) and temoe's."""
  from temoe.maxtext import config as temoe_config  # pylint: disable=import-outside-toplevel

  fields, todo = {}, [temoe_config.temoe_config_class().model_fields]
  while todo:
    for name, info in todo.pop().items():
      fields.setdefault(name, info)
      nested = getattr(info.annotation, "model_fields", None)
      if nested:
        todo.append(nested)
  return fields


def unknown_key_message(key: str, fields) -> str:
  near = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.6)
  hint = f"did you mean {', '.join(near)}?" if near else "see MaxText's configs/base.yml for its keys."
  return f"unknown config key {key!r}; {hint}"


UNKNOWN_KEY = re.compile(r"^'([^']+)' not in '")


def unknown_key(exc: BaseException) -> str | None:
  """The one line for MaxText's own unknown-key error (a key in a YAML), or None."""
  match = UNKNOWN_KEY.match(str(exc)) if isinstance(exc, ValueError) else None
  return unknown_key_message(match.group(1), config_fields()) if match else None


def configured(maxtext_args: list[str], key: str):
  """The value of `key` a `temoe train <config.yml> key=value ...` sets: its last key=value argument, else the
  YAML chain's (a config's own value over its base_config's), else None. Call after check_config_file."""
  import yaml  # pylint: disable=import-outside-toplevel

  for arg in reversed(maxtext_args[1:]):
    if arg.startswith(f"{key}="):
      return arg.split("=", 1)[1]
  path, seen = maxtext_args[0], set()
  while path and os.path.isfile(path) and os.path.realpath(path) not in seen:
    seen.add(os.path.realpath(path))
    with open(path, encoding="utf-8") as f:
      data = yaml.safe_load(f) or {}
    if key in data:
      return data[key]
    base = data.get("base_config")
    if base is None:
      return None
    beside = os.path.join(os.path.dirname(path), str(base))
    path = str(base) if os.path.isabs(str(base)) else beside if os.path.isfile(beside) else os.path.join(
        maxtext_configs_dir(), str(base))
  return None


def requeue_run_name(env: dict) -> tuple[str, str] | None:
  """(run_name, why) for a run that a scheduler may requeue and that names no run: the same on every attempt
  and in every process of the job, so a requeue resumes from the checkpoints (MaxText's own default, the
  model name and the minute it started, differs from attempt to attempt and between the job's processes), or
  None when no scheduler requeues it. Kubernetes JobSet: MaxText already takes JOBSET_NAME."""
  if env.get("JOBSET_NAME"):
    return env["JOBSET_NAME"], "JOBSET_NAME, as MaxText takes it"
  job = env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID")
  if job:
    return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}", "the Slurm array job and task"
  if env.get("SLURM_JOB_ID"):
    return f"slurm-{env['SLURM_JOB_ID']}", "SLURM_JOB_ID"
  return None


def with_stable_run_name(maxtext_args: list[str], env: dict) -> tuple[list[str], str | None]:
  """(the arguments, a line to print): an empty run_name under a scheduler that requeues becomes that
  job's stable name (`requeue_run_name`); otherwise the arguments as they are and no line."""
  if configured(maxtext_args, "run_name"):
    return maxtext_args, None
  stable = requeue_run_name(env)
  if stable is None:
    return maxtext_args, None
  name, why = stable
  return [*maxtext_args, f"run_name={name}"], (
      f"temoe: run_name is empty; this job runs as run_name={name} (from {why}), the same on every requeue, so a "
      "requeued job resumes from its checkpoints; pass run_name=... to choose another.")
