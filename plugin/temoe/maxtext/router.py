"""Routing: which experts each token goes to, with what weight, and the router's side outputs.

The reference router is MaxText's own (its `GateLogit`, `get_topk`, load-balance losses and
loss-free bias update), called on the layer temoe serves: sigmoid/softmax scores, routed bias,
group-limited top-k, routed_scaling_factor, top-k normalisation and the aux-loss choice mean
exactly what they mean in MaxText's native block, and one checkpoint serves both blocks.

Three places where MaxText's te_moe_block path would otherwise change the math, and how temoe
keeps native's:
- `per_expert_scale` (Gemma4-style): MaxText already folds it into `wo` before calling the TE
  block, so the top-k weights are taken without it (native applies it once, to the weights).
- `moe_use_megatron_seq_aux_loss`: MaxText's `uses_megatron_seq_aux_loss` says False whenever
  te_moe_block=true; temoe asks it about the native block and computes that loss with MaxText's
  `megatron_seq_aux_loss`. `uses_megatron_seq_aux_loss` below is the same answer for the train
  step, which sums that loss over layers (the seam installs it).
- gradient accumulation: native emits raw expert counts per microbatch so the train step takes
  one sign over the whole batch; so does temoe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from maxtext.layers import moe as maxtext_moe

from temoe.moe.routing import Routing

_maxtext_uses_megatron_seq_aux_loss = maxtext_moe.uses_megatron_seq_aux_loss
"""MaxText's own decision, captured before any seam replaces the module attribute."""


class _AsNativeBlock:
  """A config view reading te_moe_block=false: what MaxText decides for its native block."""

  def __init__(self, config):
    self._config = config

  def __getattr__(self, name):
    return False if name == "te_moe_block" else getattr(self._config, name)


def uses_megatron_seq_aux_loss(config) -> bool:
  """MaxText's `uses_megatron_seq_aux_loss`, answered as for the native block: temoe's block
  computes the Megatron seq aux loss whenever native would, so the train step must sum it too."""
  return bool(_maxtext_uses_megatron_seq_aux_loss(_AsNativeBlock(config)))


uses_megatron_seq_aux_loss.__wrapped__ = _maxtext_uses_megatron_seq_aux_loss


class _WithoutExpertScale:
  """The layer as `get_topk` reads it, minus `per_expert_scale`, which `wo` already carries."""

  per_expert_scale = None

  def __init__(self, layer):
    self._layer = layer

  def __getattr__(self, name):
    return getattr(self._layer, name)


def top_k(layer, gate_logits, pre_bias_logits):
  """MaxText's `get_topk` on `layer`: weights and expert ids, per_expert_scale left to `wo`."""
  if getattr(layer, "per_expert_scale", None) is None:
    return layer.get_topk(gate_logits, pre_bias_logits)
  return maxtext_moe.RoutedMoE.get_topk(_WithoutExpertScale(layer), gate_logits, pre_bias_logits)


def aux_loss(layer, experts, gate_logits, pre_bias_logits):
  """The load-balance loss native computes for `layer`'s config, or None when it computes none."""
  cfg = layer.config
  if cfg.load_balance_loss_weight <= 0.0 or layer.is_hash_routing:
    return None
  # As MaxText: the aux losses see the scores before the routed bias, so the bias gets no gradient.
  scores = pre_bias_logits if pre_bias_logits is not None else gate_logits
  if uses_megatron_seq_aux_loss(cfg):
    return layer.megatron_seq_aux_loss(scores)
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(layer.dtype)
  return layer.load_balance_loss(experts, probs)


def bias_update(layer, experts):
  """The loss-free balancing signal native emits: the sign update, or raw counts under
  gradient accumulation (the train step sums them over microbatches before one sign)."""
  cfg = layer.config
  if not layer.should_update_load_balance():
    return None
  if getattr(cfg, "gradient_accumulation_steps", 1) > 1:
    return maxtext_moe.calculate_expert_counts(experts, cfg.num_experts)
  return maxtext_moe.calculate_load_balance_updates(experts, cfg.num_experts, cfg.routed_bias_update_rate)


def route(layer, inputs: jax.Array) -> Routing:
  """Routes `inputs` (batch, seq, emb) with the MaxText semantics of `layer` (a RoutedMoE)."""
  gate_logits, pre_bias_logits = layer.gate(inputs)
  weights, experts = top_k(layer, gate_logits, pre_bias_logits)
  return Routing(
      experts=experts.astype(jnp.int32),
      weights=weights,
      lb_loss=aux_loss(layer, experts, gate_logits, pre_bias_logits),
      bias_update=bias_update(layer, experts),
      scores=jax.lax.stop_gradient(
          pre_bias_logits if pre_bias_logits is not None else jax.nn.softmax(gate_logits.astype(jnp.float32), -1)
      ),
  )
