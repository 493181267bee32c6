"""What temoe's offline tools and the run wrapper ask of MaxText: its config, its FLOP count, its
mesh-axis filling, its abstract train state and its remat policy. Each is MaxText's own function,
called here so no module outside `temoe.maxtext` imports MaxText."""

from __future__ import annotations

import contextlib
import os
import pickle
import types


def initialize_config(argv: list[str], **kwargs):
  """MaxText's `pyconfig.initialize` with temoe registered (temoe's schema and checks)."""
  import temoe  # pylint: disable=import-outside-toplevel

  temoe.register()
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  with yaml_read_once():
    return pyconfig.initialize(argv, **kwargs)


_CHAINS: dict[str, tuple[tuple[tuple[str, int, int], ...], bytes]] = {}
"""YAML files MaxText's `_load_config` read in this process: real path -> (every file of its base_config chain as
(path, mtime_ns, size), the merged DictConfig MaxText made of them, pickled: unpickling makes a copy in a fifth of
copy.deepcopy's time, which walks OmegaConf's nodes in Python)."""


def _stamp(path: str) -> tuple[str, int, int]:
  stat = os.stat(path)
  return path, stat.st_mtime_ns, stat.st_size


def _fresh(files: tuple[tuple[str, int, int], ...]) -> bool:
  try:
    return all(_stamp(path) == (path, mtime, size) for path, mtime, size in files)
  except OSError:
    return False


@contextlib.contextmanager
def yaml_read_once():
  """MaxText's `_load_config` (a YAML file merged onto its base_config chain, a third of a config build) runs once per
  chain and process while this is open: later builds get a copy of what it returned (MaxText edits its result),
  as long as no file of the chain has changed since. A plan, a sweep or a check builds many configs of one chain."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  load = pyconfig._load_config  # pylint: disable=protected-access
  reading: list[list[tuple[str, int, int]]] = []  # the files each open (nested: base_config) call has read

  def cached(name: str):
    try:
      key = os.path.realpath(name)
      stamp = _stamp(key)
    except OSError:
      return load(name)  # MaxText's own error
    hit = _CHAINS.get(key)
    if hit is not None and _fresh(hit[0]):
      files = list(hit[0])
      result = pickle.loads(hit[1])
    else:
      reading.append([stamp])
      try:
        result = load(name)  # its base_config comes back through `cached`
      finally:
        files = reading.pop()
      _CHAINS[key] = (tuple(files), pickle.dumps(result))
    if reading:  # the file whose base_config this is
      reading[-1].extend(files)
    return result

  if getattr(load, "temoe_cached", False):  # open already (a build inside a build)
    yield
    return
  cached.temoe_cached = True
  pyconfig._load_config = cached  # pylint: disable=protected-access
  try:
    yield
  finally:
    pyconfig._load_config = load  # pylint: disable=protected-access


def read_config_chain(path: str) -> None:
  """Reads `path`'s YAML chain as a config build would (no JAX backend needed): a process that forks config builds
  reads it once for all of them."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  with yaml_read_once():
    pyconfig._load_config(path)  # pylint: disable=protected-access


def configs_dir() -> str:
  """MaxText's own configs folder (base.yml, models/)."""
  from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # pylint: disable=import-outside-toplevel

  return MAXTEXT_CONFIGS_DIR


def maxtext_tflops(config) -> float:
  """MaxText's own TFLOPs per device per training step."""
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  return maxtext_utils.calculate_tflops_training_per_device(config, log=False)[0]


def fill_mesh_axes(parallelism: list[int], devices: int, name: str) -> list[int]:
  """MaxText's filling of one -1 mesh axis ('ICI' or 'DCN') to use `devices`."""
  from maxtext.utils import max_utils  # pylint: disable=import-outside-toplevel

  return max_utils.fill_unspecified_mesh_axes(parallelism, devices, name)


def abstract_state(config, mesh):
  """MaxText's abstract train state (nnx.State of ShapeDtypeStructs with shardings), nothing allocated.

  The state as `train_compile.get_shaped_inputs` makes it, from the same MaxText calls (model, optimizer,
  `get_abstract_state` of model + optimizer), without what a plan does not read: that function's third trace of
  the train state (for its graphdef) and the shaped batch, about half of a plan's time; and, unless the optimizer
  is muon (whose dimension numbers MaxText reads off the abstract model), its trace of the model alone."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.common import train_state_nnx  # pylint: disable=import-outside-toplevel
  from maxtext.optimizers import optimizers  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, model_creation_utils  # pylint: disable=import-outside-toplevel

  if config.opt_type == "muon":  # the optimizer reads the abstract model for muon's dimension numbers only
    create_model, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  else:  # no trace of the model alone: a third of a plan's time
    create_model, model = model_creation_utils.get_nnx_create_model_fn(config, mesh), None
  tx = optimizers.get_optimizer(config, maxtext_utils.create_learning_rate_schedule(config), model, mesh=mesh)
  lora = getattr(getattr(config, "lora", None), "enable_lora", False)
  wrt = getattr(nnx, "LoRAParam", nnx.Param) if lora else nnx.Param

  def train_state():
    module = create_model()
    return train_state_nnx.TrainStateNNX(module, nnx.Optimizer(module, tx, wrt=wrt))

  state, _, _ = maxtext_utils.get_abstract_state(config, mesh, train_state, True)
  return state


def remat_policy(config):
  """MaxText's checkpoint policy for this config (None: save nothing but the layer inputs), from its
  decoder's own `get_remat_policy` on a stand-in holding just what that method reads."""
  from maxtext.layers import nnx_decoders  # pylint: disable=import-outside-toplevel

  decoder = types.SimpleNamespace(config=config, remat_policy_override=None)
  decoder.minimal_policy = lambda **kw: nnx_decoders.NNXDecoder.minimal_policy(decoder, **kw)
  return nnx_decoders.NNXDecoder.get_remat_policy(decoder)


def checkpointed(config) -> bool:
  """Whether MaxText wraps each decoder layer in jax.checkpoint: always where layers are scanned (a policy
  of None recomputes everything), and unscanned unless remat_policy is none (its decoder calls the
  layer directly then)."""
  return bool(getattr(config, "scan_layers", True)) or config.remat_policy not in ("none", None)


def train(argv: list[str]) -> None:
  """MaxText's pre-training main under absl, as `python -m maxtext.trainers.pre_train.train` runs it."""
  from absl import app  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train as maxtext_train  # pylint: disable=import-outside-toplevel

  app.run(maxtext_train.main, argv=argv)


def device_mesh(config):
  """MaxText's device mesh for `config` (its own checks that the mesh spans the devices)."""
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  return maxtext_utils.create_device_mesh(config)


def make_writable_dir(path: str) -> None:
  """MaxText's own probe: creates `path` (local or gs://) and checks a file can be written there."""
  from maxtext.utils import gcs_utils  # pylint: disable=import-outside-toplevel

  gcs_utils.mkdir_and_check_permissions(path)
