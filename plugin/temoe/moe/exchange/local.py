"""No exchange: this device holds every expert its tokens are routed to."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from temoe.moe import dispatch


def run(ctx, x, expert_ids, weights, mlp):
  with jax.named_scope("temoe_dispatch"):
    p = dispatch.plan(expert_ids, ctx.num_experts, ctx.align)
    buf = dispatch.dispatch(x, p, expert_ids.shape[-1])
  with jax.named_scope("temoe_experts"):
    y = mlp(buf, p)
  with jax.named_scope("temoe_combine"):
    out = dispatch.combine(y, p, weights, ctx.float32_weight_sum)
  stats = {
      "received": jnp.sum(p.padded_group_sizes),
      "capacity": jnp.int32(p.buffer_rows),
      "overflow": jnp.bool_(False),
      "padded": jnp.sum(p.padded_group_sizes),
      "real": jnp.sum(p.group_sizes),
  }
  return out, stats
