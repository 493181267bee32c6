"""Everything that touches MaxText internals, in one place, guarded by the MaxText version.

The seams, each the one function that decides the behaviour temoe changes (README, "How it hooks
MaxText", lists them all; checkpointing.py and failures.py hold the checkpoint and failure ones):

1. `pyconfig.initialize`'s schema: MaxText accepts a subclass of its config class; temoe passes
   `TemoeConfig`, which widens `te_gmm_quantization` to temoe's recipes, adds `te_moe_backend`,
   and lifts the two te_moe_block restrictions MaxText has only because TE's moe() lacks them
   (loss-free bias updates, top-k normalisation). MaxText's own validation still runs.
2. `RoutedMoE._te_moe_block`: the method MaxText calls for `te_moe_block=true`; temoe's block
   computes there, on the parameters MaxText already made.
3. `max_utils.maybe_bootstrap_te_moe`: MaxText's NCCL-EP bootstrap for TE's block, which needs
   one device per process and >= 2 ranks; temoe's block needs no bootstrap.
4. `metric_logger.record_activation_metrics`: what MaxText's train step logs from the model's
   intermediates under `record_internal_nn_metrics=true`; temoe adds its MoE metrics.
5. `moe.uses_megatron_seq_aux_loss`: whether the train step sums the sequence-wise aux loss over
   layers; MaxText answers False for te_moe_block, temoe answers as for the native block.
`TOUCHPOINTS` / `CLASS_ATTRIBUTES` list everything else temoe calls; `check_maxtext` checks them all.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from importlib import metadata
from typing import Any

from temoe import __version__, recipes
from temoe.maxtext import assets
from temoe.maxtext import config as temoe_config

MAXTEXT_VERSION = "0.2.5"
"""The MaxText release whose internals these seams were written against."""

class TemoeSeamError(RuntimeError):
  """The installed MaxText is not one temoe can hook."""


def _maxtext_modules():
  from maxtext.configs import pyconfig, types  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils  # pylint: disable=import-outside-toplevel

  return pyconfig, types, moe, max_utils


def check_maxtext() -> None:
  """Fails with one clear message unless the installed MaxText has every seam temoe hooks."""
  try:
    installed = metadata.version("maxtext")
  except metadata.PackageNotFoundError as exc:
    raise TemoeSeamError(f"temoe needs MaxText {MAXTEXT_VERSION} (pip install maxtext=={MAXTEXT_VERSION}).") from exc
  if installed != MAXTEXT_VERSION:
    raise TemoeSeamError(
        f"temoe hooks MaxText {MAXTEXT_VERSION} internals, but maxtext {installed} is installed; "
        f"install maxtext=={MAXTEXT_VERSION}."
    )
  pyconfig, types, moe, max_utils = _maxtext_modules()
  missing = []
  if "config_class" not in inspect.signature(pyconfig.initialize).parameters:
    missing.append("pyconfig.initialize(config_class=...)")
  for field in ("te_moe_block", "te_gmm_quantization", *temoe_config.LIFTED_TE_MOE_RESTRICTIONS):
    if field not in types.MaxTextConfig.model_fields:
      missing.append(f"MaxTextConfig.{field}")
  if not callable(getattr(moe.RoutedMoE, "_te_moe_block", None)):
    missing.append("RoutedMoE._te_moe_block")
  if not callable(getattr(max_utils, "maybe_bootstrap_te_moe", None)):
    missing.append("max_utils.maybe_bootstrap_te_moe")
  from maxtext.common import metric_logger  # pylint: disable=import-outside-toplevel

  if not callable(getattr(metric_logger, "record_activation_metrics", None)):
    missing.append("metric_logger.record_activation_metrics")
  missing += missing_touchpoints()
  from temoe.maxtext import checkpointing  # pylint: disable=import-outside-toplevel

  missing += checkpointing.missing_seams()  # save_checkpoint, wait_until_finished, training_loop_iteration, ...
  from temoe.maxtext import batches  # pylint: disable=import-outside-toplevel

  missing += batches.missing_seams()
  if missing:
    raise TemoeSeamError(f"MaxText {installed} lacks the seams temoe hooks: {', '.join(missing)}.")


TOUCHPOINTS = {
    "maxtext.configs.pyconfig": ("initialize", "_load_config"),  # introspect.yaml_read_once wraps the second
    "maxtext.configs.types": ("MaxTextConfig", "DecoderBlockType"),
    "maxtext.layers.moe": ("RoutedMoE", "GateLogit", "calculate_load_balance_updates", "calculate_expert_counts",
                           "uses_megatron_seq_aux_loss"),
    "maxtext.layers.attentions": ("Attention",),
    "maxtext.layers.attention_mla": ("MLA",),
    "maxtext.layers.nnx_decoders": ("NNXDecoder",),
    "maxtext.common.metric_logger": ("record_activation_metrics",),
    "maxtext.common.train_state_nnx": ("TrainStateNNX",),
    "maxtext.utils.max_utils": ("maybe_bootstrap_te_moe", "fill_unspecified_mesh_axes"),
    "maxtext.utils.maxtext_utils": ("collect_intermediates_by_suffix", "calculate_tflops_training_per_device",
                                    "apply_gradient_clipping", "create_device_mesh", "get_abstract_state",
                                    "create_learning_rate_schedule"),
    "maxtext.utils.model_creation_utils": ("create_nnx_abstract_model",),
    "maxtext.optimizers.optimizers": ("get_optimizer",),
    "maxtext.utils.globals": ("MAXTEXT_CONFIGS_DIR",),
    "maxtext.utils.max_logging": ("log",),
    "maxtext.utils.gcs_utils": ("mkdir_and_check_permissions",),
    "maxtext.trainers.pre_train.train": ("main",),
    "maxtext.trainers.pre_train.train_compile": ("get_shaped_inputs",),
}
"""Every MaxText module attribute temoe calls or wraps (seams, adapter, router, metrics, the offline
tools' introspection and profiling scopes); `check_maxtext` verifies each one."""

CLASS_ATTRIBUTES = {
    ("maxtext.layers.moe", "RoutedMoE"): (
        "_te_moe_block", "sparse_matmul", "permute", "local_permute", "unpermute", "get_topk",
        "load_balance_loss", "megatron_seq_aux_loss", "should_update_load_balance", "apply_ffn_activation",
        "get_expert_parallelism_size", "_logical_to_mesh_axes",
    ),
    ("maxtext.layers.moe", "GateLogit"): ("__call__",),
    ("maxtext.layers.nnx_decoders", "NNXDecoder"): ("minimal_policy", "get_remat_policy"),
    ("maxtext.common.train_state_nnx", "TrainStateNNX"): ("apply_gradients",),
}
"""Methods temoe calls or wraps on MaxText classes."""


def missing_touchpoints() -> list[str]:
  """The TOUCHPOINTS, CLASS_ATTRIBUTES and RoutedMoE instance attributes this MaxText lacks."""
  import importlib  # pylint: disable=import-outside-toplevel

  from temoe.maxtext import adapter  # pylint: disable=import-outside-toplevel

  missing = []
  for module_name, names in TOUCHPOINTS.items():
    try:
      module = importlib.import_module(module_name)
    except ImportError as exc:
      missing.append(f"{module_name} ({exc})")
      continue
    missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
  for (module_name, cls_name), names in CLASS_ATTRIBUTES.items():
    cls = getattr(importlib.import_module(module_name), cls_name, None)
    missing += [f"{cls_name}.{n}" for n in names if cls is None or not callable(getattr(cls, n, None))]
  routed = importlib.import_module("maxtext.layers.moe").RoutedMoE
  source = inspect.getsource(routed)  # instance attributes: on the class, or assigned by its methods
  missing += [
      f"RoutedMoE.{n}" for n in adapter.LAYER_ATTRIBUTES if not hasattr(routed, n) and f"self.{n} =" not in source
  ]
  return missing


def describe_block(config, mesh) -> str:
  """One line saying which temoe expert kernel and recipe compute the MoE layers of this run."""
  from temoe import hardware  # pylint: disable=import-outside-toplevel

  plat = hardware.detect()
  kernel = recipes.resolve_backend(config.te_moe_backend, config.te_gmm_quantization, plat,
                                  recipes.model_shape(config))
  why = {"xla": f": reference backend, {plat.describe()}", "mosaic": ": temoe's Pallas Mosaic GPU kernels, sync-free",
         "te": ": Transformer Engine grouped GEMM"}[kernel]
  switch = ""
  if kernel == "mosaic":
    from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel

    if os.environ.get(mosaic_tokens.ENV) is not None:  # a non-default path
      switch = f", {mosaic_tokens.ENV}={os.environ[mosaic_tokens.ENV]}"
  return (
      f"temoe {__version__}: te_moe_block=true -> temoe MoE block, backend {kernel}{why}, "
      f"recipe {config.te_gmm_quantization}{switch}, {mesh.devices.size} device(s), no NCCL-EP bootstrap."
  )


def _temoe_block(self, inputs, gate_kernel, wi_kernel, wo_kernel, w0_bias, w1_bias, wo_bias, out_sharding=None):
  """Replaces RoutedMoE._te_moe_block: the same arguments, computed by temoe's block."""
  del gate_kernel  # temoe routes through the layer's own GateLogit (its dtype, score function and bias)
  from temoe.maxtext import adapter  # pylint: disable=import-outside-toplevel

  return adapter.te_moe_block(self, inputs, wi_kernel, wo_kernel, w0_bias, w1_bias, wo_bias, out_sharding)


_installed: dict[str, Any] = {}


def install() -> None:
  """Installs the seams once; a second call changes nothing."""
  if _installed:
    return
  assets.use_packaged_assets()
  check_maxtext()
  pyconfig, _, moe, max_utils = _maxtext_modules()
  from maxtext.utils import max_logging  # pylint: disable=import-outside-toplevel

  config_class = temoe_config.temoe_config_class()
  original_initialize = pyconfig.initialize
  original_bootstrap = max_utils.maybe_bootstrap_te_moe

  @functools.wraps(original_initialize)
  def initialize(argv=None, config_class=config_class, **kwargs):
    return original_initialize(argv, config_class=config_class, **kwargs)

  def maybe_bootstrap_te_moe(config, mesh, shaped_batch):
    """temoe's block needs no eager NCCL-EP bootstrap, so MaxText's is skipped; says what runs."""
    del shaped_batch
    if config.te_moe_block:
      max_logging.log(describe_block(config, mesh))

  from maxtext.common import metric_logger  # pylint: disable=import-outside-toplevel

  original_record = metric_logger.record_activation_metrics

  @functools.wraps(original_record)
  def record_activation_metrics(output_metrics, intermediate_outputs, config):
    original_record(output_metrics, intermediate_outputs, config)
    from temoe.maxtext import metrics  # pylint: disable=import-outside-toplevel

    metrics.record(output_metrics, intermediate_outputs, config)

  from temoe.maxtext import router  # pylint: disable=import-outside-toplevel

  _installed.update(
      initialize=original_initialize, te_moe_block=moe.RoutedMoE._te_moe_block, bootstrap=original_bootstrap,
      uses_megatron_seq_aux_loss=moe.uses_megatron_seq_aux_loss,
  )
  pyconfig.initialize = initialize
  moe.RoutedMoE._te_moe_block = _temoe_block  # pylint: disable=protected-access
  # the train step sums (not averages) the sequence-wise aux loss over layers when this says so;
  # MaxText's answers False for te_moe_block, temoe's block computes that loss as the native block does
  moe.uses_megatron_seq_aux_loss = router.uses_megatron_seq_aux_loss
  max_utils.maybe_bootstrap_te_moe = maybe_bootstrap_te_moe
  metric_logger.record_activation_metrics = record_activation_metrics
  train_module = sys.modules.get("maxtext.trainers.pre_train.train")  # imported it by name already
  if train_module is not None:
    train_module.record_activation_metrics = record_activation_metrics
  from temoe.maxtext import checkpointing  # pylint: disable=import-outside-toplevel

  checkpointing.install()  # no non-finite checkpoint, checksums at save, one-line write failures


def is_installed() -> bool:
  return bool(_installed)
