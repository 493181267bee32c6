"""MaxText's RoutedMoE, seen by temoe's MoE core: the frozen context built from the layer and its
config, and the call that replaces `RoutedMoE._te_moe_block` (route with MaxText's router, compute
with temoe's block, sow what MaxText's train step reads)."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from temoe import hardware, recipes
from temoe.maxtext import introspect, metrics, router
from temoe.moe import block
from temoe.moe.context import MoEContext
from temoe.moe.routing import Routing

LAYER_ATTRIBUTES = (
    "config", "mesh", "dtype", "num_experts", "num_experts_per_tok", "gate", "get_topk", "load_balance_loss",
    "is_hash_routing", "should_update_load_balance", "apply_ffn_activation", "get_expert_parallelism_size",
    "_expert_parallelism_name", "_logical_to_mesh_axes", "sow",
)
"""What temoe reads of a RoutedMoE instance (here and in temoe.maxtext.router); seams.check_maxtext
verifies each exists on MaxText's class or is assigned by its constructor."""

_ordinals: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


def layer_name(layer) -> str:
  """MoE layers in the order they are first traced; a scanned stack is traced once, as one."""
  if layer.config.scan_layers:
    return "the scanned MoE layers (scan_layers=true traces them as one; rerun with scan_layers=false to name it)"
  ordinal = _ordinals.setdefault(layer, len(_ordinals))
  return f"MoE layer {ordinal} (in call order)"


def kernel_for(cfg) -> str:
  """The expert kernel this process runs for `cfg`, or a TemoeConfigError naming what to change."""
  return recipes.resolve_backend(cfg.te_moe_backend, str(cfg.te_gmm_quantization), hardware.detect(),
                                 recipes.model_shape(cfg))


def context(layer) -> MoEContext:
  """The MoE core's view of MaxText RoutedMoE `layer`."""
  cfg = layer.config
  kernel = kernel_for(cfg)
  recipe = str(cfg.te_gmm_quantization)
  mesh = layer.mesh
  multi = mesh is not None and mesh.size > 1
  return MoEContext(
      num_experts=layer.num_experts,
      top_k=layer.num_experts_per_tok,
      dtype=layer.dtype,
      recipe=recipe,
      kernel=kernel,
      align=recipes.row_alignment(recipe, kernel),
      activation=layer.apply_ffn_activation,
      float32_weight_sum=cfg.float32_weight_sum,
      mesh=mesh if multi else None,
      token_spec=layer._logical_to_mesh_axes(("activation_batch", "activation_norm_length", None)) if multi else None,  # pylint: disable=protected-access
      ep_axis=layer._expert_parallelism_name,  # pylint: disable=protected-access
      ep_size=layer.get_expert_parallelism_size() if mesh is not None else 1,
      buffer_factor=cfg.ragged_buffer_factor,
      exchange=cfg.te_moe_exchange,
      ep_node_size=cfg.te_moe_ep_node_size,
      chunks=cfg.te_moe_chunks,
      check_finite=cfg.te_moe_check_finite,
      name=layer_name(layer) if cfg.te_moe_check_finite else "MoE layer",
      fp8_weights=fp8_weights(cfg),
  )


def fp8_weights(cfg) -> str:
  """Where the expert weights' FP8 copies live for the backward: as te_moe_fp8_weights says, or "device"
  where MaxText wraps the layer in no jax.checkpoint at all (remat_policy none, unscanned), since then the
  forward's copies are kept anyway and casting the weights again would be a pass for nothing."""
  if not introspect.checkpointed(cfg):
    return "device"
  return str(cfg.te_moe_fp8_weights)


def te_moe_block(layer, inputs, wi, wo, w0_bias=None, w1_bias=None, wo_bias=None, out_sharding=None):
  """Computes MaxText RoutedMoE `layer` on `inputs` (batch, seq, emb) with temoe.

  Returns MaxText's (output, load-balance loss or None, None): the third slot, where MaxText's
  TE block returns receive counts for the decoder layer to sow, is sown here instead, so every
  decoder block (DeepSeek, Mixtral, ...) gets the same metrics.
  """
  ctx = context(layer)
  with jax.named_scope("temoe_router"):
    routing = router.route(layer, inputs)
  out, stats = block.apply(ctx, inputs, routing.experts, routing.weights, wi, wo, (w0_bias, w1_bias, wo_bias))
  if out_sharding is not None:
    out = jax.lax.with_sharding_constraint(out, out_sharding)
  sow_step_outputs(layer, stats, routing)
  if metrics.enabled(layer.config):
    metrics.sow(layer, routing.experts, routing.scores, 1.0 - stats["real"] / jnp.maximum(stats["padded"], 1))
  return out, routing.lb_loss, None


def sow_step_outputs(layer, stats, routing: Routing) -> None:
  """Sows what MaxText's train step reads for te_moe_block, and the routed-bias update."""
  layer.sow(nnx.Intermediate, "te_moe_total_recv_tokens", stats["received"].astype(jnp.int32))
  layer.sow(nnx.Intermediate, "te_moe_recv_capacity_per_rank", stats["capacity"].astype(jnp.int32))
  layer.sow(nnx.Intermediate, "te_moe_capacity_overflow", stats["overflow"])
  if routing.bias_update is not None:
    layer.sow(nnx.Intermediate, "moe_bias_updates", routing.bias_update)
