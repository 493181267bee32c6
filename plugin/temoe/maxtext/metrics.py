"""MoE metrics cheap enough to leave on, through MaxText's own switch `record_internal_nn_metrics`.

The block sows per layer: tokens per expert (global), router entropy, and the padding fraction of
its expert buffers; MaxText's `record_activation_metrics` (which train_step calls with the step's
intermediates when the switch is on) is extended by `record` to turn them into scalars, so they
reach MaxText's metric logger, its metrics file and TensorBoard like MaxText's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

EXPERT_LOAD, ENTROPY, PADDING = "temoe_expert_load", "temoe_router_entropy", "temoe_padding_fraction"
MAX_PER_EXPERT_SCALARS = 4096
"""Per-(layer, expert) load scalars are logged only up to this many (the report's heatmap)."""


def enabled(cfg) -> bool:
  return bool(getattr(cfg, "record_internal_nn_metrics", False))


def router_entropy(scores: jax.Array) -> jax.Array:
  """Mean over tokens of the entropy (nats) of the router's scores, normalised per token."""
  probs = scores.astype(jnp.float32)
  probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
  return -jnp.mean(jnp.sum(jnp.where(probs > 0, probs * jnp.log(probs), 0.0), axis=-1))


def sow(layer, experts: jax.Array, scores: jax.Array, padding_fraction: jax.Array) -> None:
  """Sows this layer's metrics (global arrays: counts over the whole batch)."""
  counts = jnp.bincount(experts.reshape(-1), length=layer.num_experts).astype(jnp.int32)
  layer.sow(nnx.Intermediate, EXPERT_LOAD, counts)
  layer.sow(nnx.Intermediate, ENTROPY, router_entropy(scores))
  layer.sow(nnx.Intermediate, PADDING, padding_fraction.astype(jnp.float32))


def _per_layer(intermediates, key: str, width: int | None = None) -> jax.Array | None:
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  values = maxtext_utils.collect_intermediates_by_suffix(intermediates, key)
  if not values:
    return None
  flat = jnp.concatenate(values)
  return flat if width is None else flat.reshape(-1, width)


def record(output_metrics: dict, intermediates, config) -> None:
  """Adds temoe's MoE scalars (per MoE layer, and their worst/mean over layers) to `output_metrics`."""
  loads = _per_layer(intermediates, EXPERT_LOAD, config.num_experts)
  if loads is None:
    return
  scalars = output_metrics["scalar"]
  mean = jnp.maximum(jnp.mean(loads, axis=1), 1e-9)
  imbalance = jnp.max(loads, axis=1) / mean
  entropy = _per_layer(intermediates, ENTROPY)
  padding = _per_layer(intermediates, PADDING)
  for i in range(loads.shape[0]):
    scalars[f"temoe/load_max_over_mean/moe_layer_{i:03d}"] = imbalance[i]
    scalars[f"temoe/load_min/moe_layer_{i:03d}"] = jnp.min(loads[i])
    scalars[f"temoe/empty_experts/moe_layer_{i:03d}"] = jnp.sum(loads[i] == 0)
    scalars[f"temoe/router_entropy/moe_layer_{i:03d}"] = entropy[i]
    scalars[f"temoe/padding_fraction/moe_layer_{i:03d}"] = padding[i]
    if loads.size <= MAX_PER_EXPERT_SCALARS:
      for e in range(loads.shape[1]):
        scalars[f"temoe/expert_load/moe_layer_{i:03d}/expert_{e:03d}"] = loads[i, e]
  scalars["temoe/load_max_over_mean"] = jnp.max(imbalance)
  scalars["temoe/empty_experts"] = jnp.sum(loads == 0)
  scalars["temoe/router_entropy"] = jnp.mean(entropy)
  scalars["temoe/padding_fraction"] = jnp.mean(padding)
