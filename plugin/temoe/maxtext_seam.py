"""Everything that touches MaxText internals, in one place, guarded by the MaxText version.

Four seams, each the one function that decides the behaviour temoe changes:

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
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import typing
from importlib import metadata
from typing import Any

import pydantic

from temoe import __version__, options

MAXTEXT_VERSION = "0.2.5"
"""The MaxText release whose internals these seams were written against."""

LIFTED_TE_MOE_RESTRICTIONS = {"routed_bias_update_rate": 0.0, "norm_topk_prob": False}
"""MaxText rejects these with te_moe_block=true because TE's moe() lacks them; temoe's block has them."""


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
  for field in ("te_moe_block", "te_gmm_quantization", *LIFTED_TE_MOE_RESTRICTIONS):
    if field not in types.MaxTextConfig.model_fields:
      missing.append(f"MaxTextConfig.{field}")
  if not callable(getattr(moe.RoutedMoE, "_te_moe_block", None)):
    missing.append("RoutedMoE._te_moe_block")
  if not callable(getattr(max_utils, "maybe_bootstrap_te_moe", None)):
    missing.append("max_utils.maybe_bootstrap_te_moe")
  from maxtext.common import metric_logger  # pylint: disable=import-outside-toplevel

  if not callable(getattr(metric_logger, "record_activation_metrics", None)):
    missing.append("metric_logger.record_activation_metrics")
  if missing:
    raise TemoeSeamError(f"MaxText {installed} lacks the seams temoe hooks: {', '.join(missing)}.")


@functools.cache
def temoe_config_class():
  """MaxText's config class with temoe's flags; built lazily so importing temoe imports no MaxText."""
  _, types, _, _ = _maxtext_modules()
  model_names = typing.Literal[typing.get_args(types.MaxTextConfig.model_fields["model_name"].annotation) + options.MODELS]

  class TemoeConfig(types.MaxTextConfig):
    """MaxText's config, with te_gmm_quantization widened to temoe's recipes and te_moe_backend."""

    te_gmm_quantization: str = pydantic.Field(
        "", description=f"Recipe of temoe's grouped GEMMs with te_moe_block=true: {', '.join(options.RECIPES)}."
    )
    model_name: model_names = pydantic.Field(
        "default", description="MaxText's model names and temoe's (configs/models/<name>.yml beside the run config)."
    )
    te_moe_backend: str = pydantic.Field(
        "auto", description="temoe MoE backend: auto (te on a GPU with Transformer Engine, else xla), te, xla."
    )
    te_moe_check_finite: bool = pydantic.Field(
        False, description="Stop the step, naming the MoE layer, on a NaN/Inf in its output or incoming gradient."
    )

    @pydantic.field_validator("te_gmm_quantization", mode="before")
    @classmethod
    def _known_recipe(cls, value: Any) -> str:
      value = "" if value is None else str(getattr(value, "value", value))
      return value if value == "" else options.check_recipe(value)

    @pydantic.field_validator("te_moe_backend", mode="before")
    @classmethod
    def _known_backend(cls, value: Any) -> str:
      return options.check_backend(str(value))

    @pydantic.model_validator(mode="wrap")
    @classmethod
    def _temoe_validate(cls, data: Any, handler):
      lifted = {}
      if isinstance(data, dict) and pydantic.TypeAdapter(bool).validate_python(data.get("te_moe_block", False)):
        data = dict(data)
        for key, neutral in LIFTED_TE_MOE_RESTRICTIONS.items():
          if key in data:
            lifted[key] = data[key]
            data[key] = neutral
      model = handler(data)  # MaxText's whole validation, with the lifted keys at neutral values
      for key, value in lifted.items():
        setattr(model, key, pydantic.TypeAdapter(type(LIFTED_TE_MOE_RESTRICTIONS[key])).validate_python(value))
      if model.te_moe_block:
        _validate_temoe(model, types)
      return model

  return TemoeConfig


def _validate_temoe(model, types) -> None:
  """temoe's checks for te_moe_block=true, before anything compiles."""
  if model.routed_bias_update_rate > 0.0 and model.decoder_block not in (
      types.DecoderBlockType.DEEPSEEK,
      types.DecoderBlockType.DEEPSEEK4,
  ):
    raise ValueError("Loss-free load balancing is only supported for the DeepSeek decoder block.")
  from temoe import platform  # pylint: disable=import-outside-toplevel

  options.resolve_backend(model.te_moe_backend, model.te_gmm_quantization, platform.detect())


def describe_block(config, mesh) -> str:
  """One line saying which temoe backend and recipe compute the MoE layers of this run."""
  from temoe import platform  # pylint: disable=import-outside-toplevel

  plat = platform.detect()
  backend = options.resolve_backend(config.te_moe_backend, config.te_gmm_quantization, plat)
  why = "" if backend == "te" else f": reference backend, {plat.describe()}" if not plat.te_usable else ""
  return (
      f"temoe {__version__}: te_moe_block=true -> temoe MoE block, backend {backend}{why}, "
      f"recipe {config.te_gmm_quantization}, {mesh.devices.size} device(s), no NCCL-EP bootstrap."
  )


def _temoe_block(self, inputs, gate_kernel, wi_kernel, wo_kernel, w0_bias, w1_bias, wo_bias, out_sharding=None):
  """Replaces RoutedMoE._te_moe_block: the same arguments, computed by temoe's block."""
  del gate_kernel  # temoe routes through the layer's own GateLogit (its dtype, score function and bias)
  from temoe.moe import block  # pylint: disable=import-outside-toplevel

  return block.run(self, inputs, wi_kernel, wo_kernel, w0_bias, w1_bias, wo_bias, out_sharding)


def use_packaged_assets() -> None:
  """Points MaxText at the assets its pip wheel ships (tokenizers), not at a source checkout's path.

  MaxText 0.2.5 derives MAXTEXT_ASSETS_ROOT from a repo layout a pip install lacks; its
  environment variable of that name is the documented override, read once at import.
  """
  if "MAXTEXT_ASSETS_ROOT" in os.environ or "maxtext.utils.globals" in sys.modules:
    return
  spec = importlib.util.find_spec("maxtext")
  for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
    if os.path.isdir(os.path.join(root, "assets", "tokenizers")):
      os.environ["MAXTEXT_ASSETS_ROOT"] = os.path.join(root, "assets")
      return


_installed: dict[str, Any] = {}


def install() -> None:
  """Installs the four seams once; a second call changes nothing."""
  if _installed:
    return
  use_packaged_assets()
  check_maxtext()
  pyconfig, _, moe, max_utils = _maxtext_modules()
  from maxtext.utils import max_logging  # pylint: disable=import-outside-toplevel

  config_class = temoe_config_class()
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
    from temoe import metrics  # pylint: disable=import-outside-toplevel

    metrics.record(output_metrics, intermediate_outputs, config)

  _installed.update(
      initialize=original_initialize, te_moe_block=moe.RoutedMoE._te_moe_block, bootstrap=original_bootstrap
  )
  pyconfig.initialize = initialize
  moe.RoutedMoE._te_moe_block = _temoe_block  # pylint: disable=protected-access
  max_utils.maybe_bootstrap_te_moe = maybe_bootstrap_te_moe
  metric_logger.record_activation_metrics = record_activation_metrics
  train_module = sys.modules.get("maxtext.trainers.pre_train.train")  # imported it by name already
  if train_module is not None:
    train_module.record_activation_metrics = record_activation_metrics


def is_installed() -> bool:
  return bool(_installed)
