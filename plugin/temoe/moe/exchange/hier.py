"""Hierarchical exchange: a token crosses the scale-out network once per destination node, then fans
out over the node's own links (NVLink) to the ranks holding its experts, and the reverse for combine.

The expert axis is `nodes` x `node` ranks, rank r on node r // node at local index r % node (MaxText's
mesh puts the ICI factor of an axis innermost, so `node` is `ici_expert_parallelism` where the axis
spans slices: `te_moe_ep_node_size`). Two deduplicating hops (`dedup_plan`), each one row per distinct
destination:

  hop 1 (scale-out)  one row per (token, destination node) to the relay: the rank of my local index on
                     that node; the row carries the token's experts on the node and their weights
  hop 2 (in-node)    the relay sends one row per (relayed row, destination rank) to its node's ranks

The expert ranks compute as in `dedup` (`dedup.experts`: expansion, grouped GEMMs, each row's weighted
sum), so the weights are applied before anything travels back: each hop returns one row per row it
carried, the relay summing its ranks' rows (float32, then the MLP dtype) and the sender its nodes'.

Capacity: every receive buffer is bounded by the row-per-pair exchange's capacity in (token, expert)
pairs (`ragged_buffer_factor`): the expert ranks' as in `dedup`, and the relays' (which on a uniform
routing relay as many pairs as an expert rank receives). Without a bound nothing is cut; with one the
relays may cut where the row-per-pair exchange would not (a skew of one local index), and any cut is
`overflow`. `received` counts the pairs routed to each rank, as the row-per-pair exchange does.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from temoe.moe.exchange import dedup, dedup_plan, ragged, receive_capacity
from temoe.moe.exchange.rowmaps import fan_in, fan_out


def hop_rows(moves: types.ModuleType, capacity: int, rows: int, senders: int) -> int:
  """Rows of a hop's receive buffer on the ragged transport: at most `capacity` pairs, so rows, from
  `senders` peers of `rows` each (the padded transport keeps its slot per device of the axis)."""
  return min(capacity, rows * senders) if moves is ragged else rows * senders


def hop2_rows(capacity: int, relayed: int, width: int, node: int) -> int:
  """Rows of the in-node hop's send buffer: one per (relayed row, rank of the node) it may reach, but no more
  than the relay's pair capacity, since every row carries a pair and hop 1 delivers at most `capacity` pairs
  (`dedup_plan.from_counts` cuts a sender's rows to whole rows that fit)."""
  return min(capacity, dedup_plan.send_rows(relayed, width, node))


def _spread(counts: jax.Array, at: jax.Array, devices: int) -> jax.Array:
  """(devices,) int32: `counts` at ranks `at`, zero elsewhere (a hop sends to a subset of the axis)."""
  return jnp.zeros(devices, jnp.int32).at[at].set(counts.astype(jnp.int32), unique_indices=True)


def _send(moves, ex, room, axis, devices, *arrays):
  return tuple(moves.send(a, ex, room, axis, devices) for a in arrays)


def hop1(expert_ids, local: int, node: int, devices: int, axis, capacity: int):
  """The scale-out hop's plan: my rows, one per (token, destination node) to the relay of my local index
  there; the exchange; and every device's pairs for every rank ([src, dst], for `received`)."""
  me = jax.lax.axis_index(axis)
  nodes = devices // node
  rp = dedup_plan.plan_ranks(expert_ids, local * node, nodes)
  relays = jnp.arange(nodes, dtype=jnp.int32) * node + me % node
  pairs = jnp.bincount((expert_ids // local).reshape(-1), length=devices).astype(jnp.int32)
  counts = jax.lax.all_gather(jnp.stack([_spread(rp.rows_to, relays, devices),
                                         _spread(rp.pairs_to, relays, devices), pairs]), axis)
  return rp, dedup_plan.from_counts(counts[:, 0], counts[:, 1], me, capacity, rp.local_ids.shape[1]), counts[:, 2]


def hop2(relayed_ids, local: int, node: int, devices: int, axis, capacity: int):
  """The in-node hop's plan: the relay's rows, one per (relayed row, destination rank of its node), from
  the relayed rows' node-local expert ids + 1 (0: an empty slot, no choice). At most `capacity` rows: each
  carries at least one (token, expert) pair and a relay receives at most `capacity` pairs (`hop2_rows`)."""
  me = jax.lax.axis_index(axis)
  valid = relayed_ids > 0
  rows = hop2_rows(capacity, relayed_ids.shape[0], relayed_ids.shape[1], node)
  rp = dedup_plan.plan_ranks(jnp.where(valid, relayed_ids - 1, 0), local, node, valid=valid, max_rows=rows)
  ranks = me // node * node + jnp.arange(node, dtype=jnp.int32)
  ex = dedup_plan.plan_exchange(_spread(rp.rows_to, ranks, devices), _spread(rp.pairs_to, ranks, devices),
                                axis, devices, capacity, rp.local_ids.shape[1])
  return rp, ex


def run(ctx, x, expert_ids, weights, mlp, moves: types.ModuleType | None = None, tokens_mlp=None):
  """As `dedup.run`, over two hops; `tokens_mlp` as there (the expert ranks' step is dedup's)."""
  moves = moves or dedup.transport(jax.devices()[0].platform)
  tokens, top_k = expert_ids.shape
  devices, local, node, axis = ctx.ep_size, ctx.local_experts, ctx.ep_node_size, ctx.ep_axis
  capacity = receive_capacity(tokens * top_k, devices, ctx.buffer_factor)
  with jax.named_scope("temoe_dispatch"):
    rp1, ex1, pairs = hop1(expert_ids, local, node, devices, axis, capacity)
    rows1, width1 = rp1.local_ids.shape
    send1 = fan_out(x, rp1.token_of_row, rp1.row_of_token)
    send_w1 = fan_out(weights.reshape(-1, 1), rp1.choice_of_slot, rp1.slot_of_choice).reshape(rows1, width1)
    room1 = hop_rows(moves, capacity, rows1, devices // node)
    relayed, relayed_w, relayed_ids = _send(moves, ex1, room1, axis, devices, send1, send_w1, rp1.local_ids)
    rp2, ex2 = hop2(relayed_ids, local, node, devices, axis, capacity)
    rows2, width2 = rp2.local_ids.shape
    send2 = fan_out(relayed, rp2.token_of_row, rp2.row_of_token)
    send_w2 = fan_out(relayed_w.reshape(-1, 1), rp2.choice_of_slot, rp2.slot_of_choice).reshape(rows2, width2)
    room2 = hop_rows(moves, capacity, rows2, node)
    recv, recv_w, recv_ids = _send(moves, ex2, room2, axis, devices, send2, send_w2, rp2.local_ids)
  partial, gp = dedup.experts(ctx, recv, recv_w, recv_ids, capacity, mlp, tokens_mlp)
  with jax.named_scope("temoe_combine"):
    back2 = moves.receive_back(partial, ex2, rows2, axis, devices)
    relay_sum = fan_in(back2, rp2.row_of_token, rp2.token_of_row).astype(partial.dtype)
    back1 = moves.receive_back(relay_sum, ex1, rows1, axis, devices)
    out = fan_in(back1, rp1.row_of_token, rp1.token_of_row)
  received = jnp.sum(pairs[:, jax.lax.axis_index(axis)])
  return out, dedup.stats(received, capacity, ex1.overflow | ex2.overflow, gp)
