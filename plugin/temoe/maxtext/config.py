"""temoe's config schema: MaxText's pydantic `MaxTextConfig`, subclassed.

MaxText's `pyconfig.initialize(argv, config_class=...)` accepts a subclass; temoe's widens
`te_gmm_quantization` to temoe's recipes and `model_name` to temoe's model shapes, adds
`te_moe_backend`, `te_moe_check_finite` and the run's `te_allow_short_rows` / `te_resume_step`, and lifts the two te_moe_block restrictions MaxText
has only because TE's moe() lacks the features. MaxText's own validation still runs, and temoe's
checks for te_moe_block=true run right after it: before anything compiles.
"""

from __future__ import annotations

import functools
import os
import typing
from typing import Any

import pydantic

from temoe import recipes


def _maxtext_types():
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  return types


PLACEMENTS = ("remat", "device", "offload")
"""MaxText's per-tensor remat choices (remat_policy=custom), which te_moe_fp8_weights takes too."""

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
        "auto", description="temoe expert kernel: auto (the recipe's first kernel that runs here: temoe's mosaic for bf16 on Hopper, te, else xla), te, mosaic, xla."
    )
    te_moe_exchange: str = pydantic.Field(
        "auto", description="temoe's expert-parallel exchange (temoe.moe.exchange): auto, ragged, padded, dedup, "
        "hier (dedup in two hops where the expert axis spans nodes: once per node over the scale-out network)."
    )
    te_moe_ep_node_size: int = pydantic.Field(
        8, description="With te_moe_exchange=hier: ranks of the expert axis that share a node (its NVLink domain): "
        "ici_expert_parallelism where the axis spans slices."
    )
    te_moe_chunks: int = pydantic.Field(
        1, description="temoe's routed experts in this many token chunks, each with its own exchange, so one "
        "chunk's exchange can overlap another's GEMMs (the output is the unchunked one's)."
    )
    te_moe_check_finite: bool = pydantic.Field(
        False, description="Stop the step, naming the MoE layer, on a NaN/Inf in its output or incoming gradient."
    )
    te_allow_short_rows: bool = pydantic.Field(
        False, description="With packing=false, train on token rows shorter than max_target_length (MaxText pads "
        "them; the pad id is masked from the loss). Default: temoe's preflight refuses them, naming the row."
    )
    te_moe_fp8_weights: str = pydantic.Field(
        "remat", description="With remat_policy=custom, MaxText's per-tensor choice for the expert weights' FP8 "
        "copies of temoe's kernels: remat (quantized again in the backward), device (kept), offload (to host)."
    )
    te_resume_step: int = pydantic.Field(
        -1, description="Resume from this checkpoint step of the run: temoe checks it and moves every later step "
        "to <run>/temoe-set-aside/ (nothing is deleted), so MaxText restores it. -1: MaxText's latest."
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

    @pydantic.field_validator("te_moe_fp8_weights", mode="before")
    @classmethod
    def _known_placement(cls, value: Any) -> str:
      value = str(value)
      if value not in PLACEMENTS:
        raise ValueError(f"te_moe_fp8_weights={value!r}: choose one of {', '.join(PLACEMENTS)}")
      return value

    @pydantic.field_validator("te_moe_exchange", mode="before")
    @classmethod
    def _known_exchange(cls, value: Any) -> str:
      from temoe.moe import exchange  # pylint: disable=import-outside-toplevel

      return exchange.check_choice(str(value))

    @pydantic.field_validator("te_moe_ep_node_size", mode="before")
    @classmethod
    def _known_node_size(cls, value: Any) -> int:
      from temoe.moe import exchange  # pylint: disable=import-outside-toplevel

      return exchange.check_node_size(_integer(value, "te_moe_ep_node_size", "ranks per node along the expert axis"))

    @pydantic.field_validator("te_moe_chunks", mode="before")
    @classmethod
    def _known_chunks(cls, value: Any) -> int:
      value = _integer(value, "te_moe_chunks", "token chunks of the routed experts")
      if value < 1:
        raise ValueError(f"te_moe_chunks={value}: token chunks of the routed experts, an integer >= 1 (1: unchunked)")
      return value

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
      elif model.te_moe_chunks != 1 or model.te_moe_exchange == "hier":
        raise ValueError(f"te_moe_chunks={model.te_moe_chunks}, te_moe_exchange={model.te_moe_exchange}: temoe's "
                         "block's settings; they need te_moe_block=true (or te_moe_chunks=1, te_moe_exchange=auto)")
      elif model.te_moe_fp8_weights != "remat":
        raise ValueError(f"te_moe_fp8_weights={model.te_moe_fp8_weights} places temoe's FP8 weight copies; "
                         "it needs te_moe_block=true (or te_moe_fp8_weights=remat)")
      return model

  return TemoeConfig


def _validate_temoe(model, types) -> None:
  """temoe's checks for te_moe_block=true, before anything compiles."""
  if model.routed_bias_update_rate > 0.0 and model.decoder_block not in (
      types.DecoderBlockType.DEEPSEEK,
      types.DecoderBlockType.DEEPSEEK4,
  ):
    raise ValueError("Loss-free load balancing is only supported for the DeepSeek decoder block.")
  _refuse_changed_semantics(model, types)
  check_node_boundary(model)
  check_pipeline(model)
  from temoe import hardware  # pylint: disable=import-outside-toplevel

  backend = recipes.resolve_backend(model.te_moe_backend, model.te_gmm_quantization, hardware.detect(),
                                    recipes.model_shape(model))
  place_fp8_weights(model, backend)
  from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel

  mosaic_tokens.scalings_of(os.environ.get(mosaic_tokens.ENV))  # a bad TEMOE_TOKENS_MLP: refused here


def _integer(value: Any, name: str, what: str) -> int:
  """`value` as an int, or one error naming the flag (YAML and the command line may give a string)."""
  try:
    if isinstance(value, bool) or float(value) != int(float(value)):
      raise ValueError
    return int(float(value))
  except (TypeError, ValueError):
    raise ValueError(f"{name}={value!r}: {what}, an integer") from None


def check_node_boundary(model) -> None:
  """te_moe_ep_node_size, where the config says how many ranks of the expert axis share a slice: with
  te_moe_exchange=hier a node must not straddle slices, and where the axis spans slices a node is one
  (its ici_expert_parallelism ranks). Not hier: the setting would do nothing, so only its default passes."""
  node, ici, dcn = model.te_moe_ep_node_size, model.ici_expert_parallelism, model.dcn_expert_parallelism
  if model.te_moe_exchange != "hier":
    if node != 8:
      raise ValueError(f"te_moe_ep_node_size={node} is the node boundary of te_moe_exchange=hier; it does nothing "
                       f"with te_moe_exchange={model.te_moe_exchange}: set te_moe_exchange=hier or leave it at 8")
    return
  if ici > 0 and dcn != 1 and ici != node:
    raise ValueError(f"te_moe_ep_node_size={node}: the expert axis spans slices of ici_expert_parallelism={ici} "
                     f"ranks; set te_moe_ep_node_size={ici}")
  if ici > 0 and ici % node:
    raise ValueError(f"te_moe_ep_node_size={node} does not divide ici_expert_parallelism={ici}: a node would straddle "
                     f"slices; choose a divisor of {ici}")
  if ici > 0 and dcn > 0:
    from temoe.moe import exchange  # pylint: disable=import-outside-toplevel

    exchange.check_node_size(node, ici * dcn)


def check_pipeline(model) -> None:
  """MaxText's pipeline (ici/dcn_pipeline_parallelism > 1) carries only parameters and RNG state through
  its stages and asserts so; DeepSeek's routing bias (routed_bias=true) is another kind of variable, so
  the step fails to build, with temoe's block or MaxText's own MoE alike: refused here in one line."""
  if model.using_pipeline_parallelism and model.routed_bias:
    raise ValueError("routed_bias=true under pipeline parallelism: MaxText's pipeline carries no MoE routing-bias "
                     "variable through its stages (its own MoE fails the same); set routed_bias=false "
                     "(override_model_config=true) or ici/dcn_pipeline_parallelism=1")


def place_fp8_weights(model, backend: str) -> None:
  """te_moe_fp8_weights=device|offload: adds temoe's name for the expert weights' FP8 copies
  (moe.experts.parts.FP8_WEIGHTS) to the names MaxText's custom remat policy keeps or offloads. Refused,
  in one line, where the policy is not custom or no such copies exist (they are temoe's Hopper kernels'
  for an FP8 recipe), so the flag never silently does nothing."""
  where = model.te_moe_fp8_weights
  from temoe.moe.experts import parts  # pylint: disable=import-outside-toplevel

  if model.remat_policy == "custom" and parts.FP8_SCALES not in list(model.tensors_on_device or []):
    # the weights' per-expert scales (G floats a weight): kept, the backward casts the weights again
    # from them with no second amax pass (parts.FP8_SCALES); under MaxText's named policies it recomputes them
    model.tensors_on_device = [*list(model.tensors_on_device or []), parts.FP8_SCALES]
  if where == "remat":
    return
  if model.remat_policy != "custom":
    raise ValueError(f"te_moe_fp8_weights={where} is a choice of MaxText's per-tensor policy; it needs "
                     f"remat_policy=custom (got {model.remat_policy}), or te_moe_fp8_weights=remat")
  recipe = recipes.REGISTRY[model.te_gmm_quantization]
  if backend != "mosaic" or not recipe.fp8:
    raise ValueError(f"te_moe_fp8_weights={where}: recipe {model.te_gmm_quantization} on backend {backend} keeps no "
                     "FP8 weight copies (only temoe's mosaic kernels with te_fp8_current or te_fp8_blockwise do); "
                     "use te_moe_fp8_weights=remat")
  field = "tensors_on_device" if where == "device" else "tensors_to_offload"
  names = list(getattr(model, field) or [])
  if parts.FP8_WEIGHTS not in names:
    setattr(model, field, [*names, parts.FP8_WEIGHTS])




def _refuse_changed_semantics(model, types) -> None:
  """MoE settings whose native meaning MaxText's te_moe_block path does not carry to temoe's block
  (see temoe.maxtext.moe_keys): one line naming the flag and what to use instead."""
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  if model.decoder_block == types.DecoderBlockType.GEMMA4:
    raise ValueError(
        "decoder_block=gemma4 routes on separate gate inputs, which MaxText's te_moe_block path does not "
        "pass to the MoE block; use te_moe_block=false for Gemma4."
    )
  if model.decoder_block == types.DecoderBlockType.DEEPSEEK4 and model.first_num_hash_layers > 0:
    raise ValueError(
        f"first_num_hash_layers={model.first_num_hash_layers}: hash routing needs the token ids, which "
        "MaxText's te_moe_block path does not pass; use first_num_hash_layers=0 or te_moe_block=false."
    )
  if (
      model.moe_use_megatron_seq_aux_loss
      and model.load_balance_loss_weight > 0.0
      and model.routed_score_func == "sigmoid"
      and not moe.uses_megatron_seq_aux_loss(model)
  ):
    raise ValueError(
        "moe_use_megatron_seq_aux_loss=true: this MaxText's train step would average the per-layer loss "
        "instead of summing it (temoe's seam is not installed); use moe_use_megatron_seq_aux_loss=false "
        "or te_moe_block=false."
    )
  if model.num_moe_token_chunks > 1:
    raise ValueError(
        f"num_moe_token_chunks={model.num_moe_token_chunks}: native averages the aux loss over token "
        "chunks, temoe computes it on whole sequences; use num_moe_token_chunks=1."
    )
  if model.moe_dropless_fallback is not None:
    raise ValueError(
        f"moe_dropless_fallback={model.moe_dropless_fallback!r} re-runs native's ring-of-experts dispatch, "
        "which temoe's block replaces; leave it unset (temoe reports EP overflow as te_moe_capacity_overflow)."
    )
