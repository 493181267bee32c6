"""Routing: which experts each token goes to, with what weight, and the router's side outputs.

The reference router is MaxText's own (its `GateLogit`, `get_topk`, load-balance loss and
loss-free bias update), called on the layer temoe serves: sigmoid/softmax scores, routed bias,
group-limited top-k, routed_scaling_factor and top-k normalisation mean exactly what they mean in
MaxText, and one checkpoint serves both blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from maxtext.layers import moe as maxtext_moe

from temoe.moe.routing import Routing


def route(layer, inputs: jax.Array) -> Routing:
  """Routes `inputs` (batch, seq, emb) with the MaxText semantics of `layer` (a RoutedMoE)."""
  cfg = layer.config
  gate_logits, pre_bias_logits = layer.gate(inputs)
  weights, experts = layer.get_topk(gate_logits, pre_bias_logits)

  lb_loss = None
  if cfg.load_balance_loss_weight > 0.0 and not layer.is_hash_routing:
    # As MaxText: the aux loss sees the scores before the routed bias, so the bias gets no gradient.
    probs_logits = pre_bias_logits if pre_bias_logits is not None else gate_logits
    probs = jax.nn.softmax(probs_logits.astype(jnp.float32), axis=-1).astype(layer.dtype)
    lb_loss = layer.load_balance_loss(experts, probs)

  bias_update = None
  if layer.should_update_load_balance():
    bias_update = maxtext_moe.calculate_load_balance_updates(experts, cfg.num_experts, cfg.routed_bias_update_rate)

  return Routing(
      experts=experts.astype(jnp.int32),
      weights=weights,
      lb_loss=lb_loss,
      bias_update=bias_update,
      scores=jax.lax.stop_gradient(
          pre_bias_logits if pre_bias_logits is not None else jax.nn.softmax(gate_logits.astype(jnp.float32), -1)
      ),
  )
