"""temoe's config schema: MaxText's pydantic `MaxTextConfig`, subclassed.

MaxText's `pyconfig.initialize(argv, config_class=...)` accepts a subclass; temoe's widens
`te_gmm_quantization` to temoe's recipes and `model_name` to temoe's model shapes, adds
`te_moe_backend` and `te_moe_check_finite`, and lifts the two te_moe_block restrictions MaxText
has only because TE's moe() lacks the features. MaxText's own validation still runs, and temoe's
checks for te_moe_block=true run right after it: before anything compiles.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

import pydantic

from temoe import recipes


def _maxtext_types():
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  return types


LIFTED_TE_MOE_RESTRICTIONS = {"routed_bias_update_rate": 0.0, "norm_topk_prob": False}
"""MaxText rejects these with te_moe_block=true because TE's moe() lacks them; temoe's block has them."""



@functools.cache
def temoe_config_class():
  """MaxText's config class with temoe's flags; built lazily so importing temoe imports no MaxText."""
  types = _maxtext_types()
  model_names = typing.Literal[typing.get_args(types.MaxTextConfig.model_fields["model_name"].annotation) + recipes.MODELS]

  class TemoeConfig(types.MaxTextConfig):
    """MaxText's config, with te_gmm_quantization widened to temoe's recipes and te_moe_backend."""

    te_gmm_quantization: str = pydantic.Field(
        "", description=f"Recipe of temoe's grouped GEMMs with te_moe_block=true: {', '.join(recipes.RECIPES)}."
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
      return value if value == "" else recipes.check_recipe(value)

    @pydantic.field_validator("te_moe_backend", mode="before")
    @classmethod
    def _known_backend(cls, value: Any) -> str:
      return recipes.check_backend(str(value))

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
  from temoe import hardware  # pylint: disable=import-outside-toplevel

  recipes.resolve_backend(model.te_moe_backend, model.te_gmm_quantization, hardware.detect())


