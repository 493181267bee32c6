"""Deduplicating exchange: a token routed to several experts of one rank crosses to it once.

Per device, one row per distinct (token, destination rank) travels with that rank's expert ids and
weights for it (`dedup_plan`); the receiver spreads each row into its local expert groups for the
grouped GEMMs, sums each row's weighted expert outputs into one row and sends that back; the sender
sums its tokens' rows over ranks. The rows move over the row-per-pair exchange's transports with
this plan: `jax.lax.ragged_all_to_all` on GPUs (`ragged`), a padded `all_to_all` on XLA:CPU
(`padded`). Every local step is a gather whose gradient is the reverse gather (`rowmaps`).

Where the expert kernel offers an MLP from rows (temoe's Hopper kernels with an FP8 recipe that
`mosaic_tokens` takes), the receiver hands it the received rows and their expansion plan instead: its
quantizer reads the rows as it quantizes, and no expert-sorted bf16 copy of them is written.

Each rank's weighted sum travels back in the expert MLP's dtype (one rounding of a partial sum of
at most `slots` terms); the sum over ranks is float32.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from temoe.moe.exchange import dedup_plan, padded, ragged, receive_capacity
from temoe.moe.exchange.rowmaps import fan_in, fan_out


def transport(platform: str) -> types.ModuleType:
  """The module whose send / receive_back move rows on `platform`: XLA:CPU has no ragged all-to-all."""
  return padded if platform == "cpu" else ragged


def receive_rows(moves: types.ModuleType, capacity: int, rows: int, devices: int) -> int:
  """Rows of the receive buffer `moves` fills: ragged packs senders (at most `capacity` pairs, so
  rows), padded keeps one slot of `rows` per sender."""
  return min(capacity, rows * devices) if moves is ragged else rows * devices


def run(ctx, x, expert_ids, weights, mlp, moves: types.ModuleType | None = None, tokens_mlp=None):
  """`tokens_mlp(rows, plan, weights, empty_choices=True) -> partial`, when the expert kernel offers one,
  replaces the receiver's expansion -> mlp -> weighted sum: its quantizer reads the received rows as it
  quantizes (no expert-sorted bf16 buffer) and its combine gives each row's weighted sum."""
  moves = moves or transport(jax.devices()[0].platform)
  tokens, top_k = expert_ids.shape
  devices, local = ctx.ep_size, ctx.local_experts
  rows, width = dedup_plan.send_rows(tokens, top_k, devices), dedup_plan.slots(top_k, local)
  capacity = receive_capacity(tokens * top_k, devices, ctx.buffer_factor)
  with jax.named_scope("temoe_dispatch"):
    rp = dedup_plan.plan_ranks(expert_ids, local, devices)
    ex = dedup_plan.plan_exchange(rp.rows_to, rp.pairs_to, ctx.ep_axis, devices, capacity, width)
    send = fan_out(x, rp.token_of_row, rp.row_of_token)
    send_w = fan_out(weights.reshape(-1, 1), rp.choice_of_slot, rp.slot_of_choice).reshape(rows, width)
    room = receive_rows(moves, capacity, rows, devices)
    recv, recv_w, recv_ids = (moves.send(a, ex, room, ctx.ep_axis, devices) for a in (send, send_w, rp.local_ids))
  partial, gp = experts(ctx, recv, recv_w, recv_ids, capacity, mlp, tokens_mlp)
  with jax.named_scope("temoe_combine"):
    back = moves.receive_back(partial, ex, rows, ctx.ep_axis, devices)
    out = fan_in(back, rp.row_of_token, rp.token_of_row)
  return out, stats(ex.received, capacity, ex.overflow, gp)


def experts(ctx, recv, recv_w, recv_ids, capacity: int, mlp, tokens_mlp=None):
  """The receiver's side: received rows `recv` with their `slots` local expert ids + 1 (`recv_ids`, 0 for
  none) and weights -> (each row's weighted sum of its experts' outputs in ctx.dtype, the expansion plan)."""
  received, width = recv_ids.shape
  with jax.named_scope("temoe_dispatch"):
    buffer = dedup_plan.gemm_rows(capacity, received, width, ctx.local_experts, ctx.align)
    gp = dedup_plan.plan_expansion(recv_ids, ctx.local_experts, ctx.align, buffer)
    buf = None if tokens_mlp else fan_out(recv, gp.choice_of_slot // width, gp.slot_of_choice.reshape(received, width))
  with jax.named_scope("temoe_experts"):
    if tokens_mlp:
      return tokens_mlp(recv, gp, recv_w, empty_choices=True).astype(ctx.dtype), gp
    y = mlp(buf, gp)
  with jax.named_scope("temoe_combine"):
    per_pair = fan_out(y, gp.slot_of_choice, gp.choice_of_slot[:, None]).reshape(received, width, -1)
    if ctx.float32_weight_sum:
      per_pair, recv_w = per_pair.astype(jnp.float32), recv_w.astype(jnp.float32)
    return jnp.sum(per_pair * recv_w[..., None].astype(per_pair.dtype), axis=1).astype(y.dtype), gp


def stats(received, capacity: int, overflow, gp) -> dict:
  """The strategy's stats (temoe.moe.exchange): pairs routed to me, my pair capacity, any cut, GEMM rows."""
  return {
      "received": received,
      "capacity": jnp.int32(capacity),
      "overflow": overflow,
      "padded": jnp.sum(gp.padded_group_sizes),
      "real": jnp.sum(gp.group_sizes),
  }
