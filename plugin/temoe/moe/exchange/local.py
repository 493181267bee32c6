"""No exchange: this device holds every expert its tokens are routed to."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from temoe.moe import dispatch


def run(ctx, x, expert_ids, weights, mlp, tokens_mlp=None):
  """`tokens_mlp(x, plan, weights) -> out`, when the expert kernel offers one for this layer, replaces
  dispatch -> mlp -> combine (its dispatch and combine run inside it, in temoe_experts)."""
  with jax.named_scope("temoe_dispatch"):
    p = dispatch.plan(expert_ids, ctx.num_experts, ctx.align)
    buf = None if tokens_mlp else dispatch.dispatch(x, p, expert_ids.shape[-1])
  with jax.named_scope("temoe_experts"):
    y = tokens_mlp(x, p, weights) if tokens_mlp else mlp(buf, p)
  with jax.named_scope("temoe_combine"):
    out = y if tokens_mlp else dispatch.combine(y, p, weights, ctx.float32_weight_sum)
  stats = {
      "received": jnp.sum(p.padded_group_sizes),
      "capacity": jnp.int32(p.buffer_rows),
      "overflow": jnp.bool_(False),
      "padded": jnp.sum(p.padded_group_sizes),
      "real": jnp.sum(p.group_sizes),
  }
  return out, stats
