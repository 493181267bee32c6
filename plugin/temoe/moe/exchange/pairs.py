"""Row-per-pair expert parallelism: each routed (token, expert) pair is one row that travels to the
device owning the expert and back. The transport (ragged or padded all-to-all) is the only part
that differs between strategies, and is passed in."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from temoe.moe import dispatch
from temoe.moe.exchange import plan as exchange_plan
from temoe.moe.exchange import receive_capacity


@dataclasses.dataclass(frozen=True)
class Transport:
  """How rows move for one plan. send(rows, ex, capacity, axis, devices) -> receive buffer;
  local_expert_ids(ex, capacity, routed_rows) -> local expert of each buffer row (sentinel
  local_experts for unused rows); receive_back(buffer, ex, routed_rows, axis, devices) -> my rows."""

  send: Callable
  local_expert_ids: Callable
  receive_back: Callable


def run(ctx, x, expert_ids, weights, mlp, transport: Transport):
  top_k = expert_ids.shape[-1]
  with jax.named_scope("temoe_dispatch"):
    p = dispatch.plan(expert_ids, ctx.num_experts)
    rows = dispatch.dispatch(x, p, top_k)
    capacity = receive_capacity(p.routed_rows, ctx.ep_size, ctx.buffer_factor)
    ex = exchange_plan.plan_exchange(p.group_sizes, ctx.ep_axis, ctx.ep_size, capacity)
    received = transport.send(rows, ex, capacity, ctx.ep_axis, ctx.ep_size)
    local_ids = transport.local_expert_ids(ex, capacity, p.routed_rows)
    local_plan = dispatch.plan(local_ids[:, None], ctx.local_experts + 1, ctx.align)  # + sentinel group
    buf = dispatch.dispatch(received, local_plan, 1)
  gemm_plan = dispatch.with_groups(local_plan, ctx.local_experts)
  with jax.named_scope("temoe_experts"):
    y = mlp(buf, gemm_plan)
  with jax.named_scope("temoe_combine"):
    y = dispatch.undispatch(y, local_plan)
    y = transport.receive_back(y, ex, p.routed_rows, ctx.ep_axis, ctx.ep_size)
    out = dispatch.combine(y, p, weights, ctx.float32_weight_sum)
  stats = {
      "received": ex.received,
      "capacity": jnp.int32(capacity),
      "overflow": ex.overflow,
      "padded": jnp.sum(gemm_plan.padded_group_sizes),
      "real": jnp.sum(gemm_plan.group_sizes),
  }
  return out, stats
