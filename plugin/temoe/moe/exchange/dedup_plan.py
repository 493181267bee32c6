"""The plan of a deduplicating exchange: one row per distinct (token, destination rank), carrying the
rank's experts and weights for that token in `slots` = min(top_k, local_experts) metadata slots.

Three parts, all static-shaped: `plan_ranks` (the sender's rows, from its tokens' expert ids),
`plan_exchange` (who sends how many rows where, from one small all-gather, identically everywhere)
and `plan_expansion` (the receiver's rows spread into its local expert groups for the grouped GEMMs).
The receive bound is in (token, expert) pairs, the rows a receiver's GEMMs hold: the row-per-pair
exchange's capacity for the same `ragged_buffer_factor`, so both overflow on the same routing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from temoe.moe import dispatch
from temoe.moe.exchange.plan import exclusive_cumsum
from temoe.moe.exchange.rowmaps import take


def send_rows(tokens: int, top_k: int, devices: int) -> int:
  """Static rows one device sends at most: each token reaches min(top_k, devices) ranks."""
  return tokens * min(top_k, devices)


def slots(top_k: int, local_experts: int) -> int:
  """Metadata slots per row: a token has at most min(top_k, local_experts) experts on one rank."""
  return min(top_k, local_experts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RankPlan:
  """This device's tokens as rows per destination rank, rank-sorted, tokens in order within a rank.

  token_of_row: (rows,) the token of each row; `tokens` for unused rows.
  row_of_token: (tokens, top_k) the row of each choice that is its token's first on its rank, else `rows`.
  choice_of_slot: (rows * slots,) the flat (token * top_k + choice) in each metadata slot; tokens * top_k for none.
  slot_of_choice: (tokens * top_k, 1) the metadata slot of each choice.
  local_ids: (rows, slots) int32 local expert + 1 in each slot, 0 for none (zero-filled rows read as empty).
  rows_to / pairs_to: (devices,) rows and (token, expert) pairs for each rank.
  """

  token_of_row: jax.Array
  row_of_token: jax.Array
  choice_of_slot: jax.Array
  slot_of_choice: jax.Array
  local_ids: jax.Array
  rows_to: jax.Array
  pairs_to: jax.Array


def plan_ranks(expert_ids: jax.Array, local_experts: int, devices: int, valid: jax.Array | None = None,
               max_rows: int | None = None) -> RankPlan:
  """Plans my rows from `expert_ids` (tokens, top_k); experts [r * local_experts, ...) live on rank r.
  `valid` (tokens, top_k) bool, where given, marks the choices that exist (a relayed row's empty slots
  do not): the others get no row, no slot and no pair. `max_rows`, where given, caps the static row
  count below `send_rows`; the caller guarantees its rows fit (a relay's: each row carries at least one
  of its at most `capacity` valid pairs)."""
  tokens, top_k = expert_ids.shape
  rows, width = send_rows(tokens, top_k, devices), slots(top_k, local_experts)
  if max_rows is not None:
    rows = min(rows, max_rows)
  rank = expert_ids // local_experts
  if valid is not None:
    rank = jnp.where(valid, rank, devices)  # the never-sent group
  same = rank[:, :, None] == rank[:, None, :]  # [t, k, k']
  earlier = jnp.tril(jnp.ones((top_k, top_k), bool), -1)  # [k, k']: k' < k
  dup = same & earlier
  leader = ~jnp.any(dup, axis=-1)  # the token's first choice on its rank
  slot = jnp.sum(dup, axis=-1, dtype=jnp.int32)  # how many of the token's earlier choices share the rank
  first = jnp.argmax(same, axis=-1)  # that first choice
  key = jnp.where(leader, rank, devices).reshape(-1)  # non-leaders sort last, in a group never sent
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  counts = jnp.bincount(key, length=devices + 1).astype(jnp.int32)
  position = jnp.zeros(tokens * top_k, jnp.int32).at[order].set(jnp.arange(tokens * top_k, dtype=jnp.int32),
                                                                unique_indices=True).reshape(tokens, top_k)
  real = jnp.arange(rows) < jnp.sum(counts[:devices])
  meta = (jnp.take_along_axis(position, first, axis=1) * width + slot).reshape(-1)
  row_of_token = jnp.where(leader, position, rows)
  if valid is not None:  # no slot for a missing choice: distinct out-of-range indices, dropped by the scatter
    flat = valid.reshape(-1)
    meta = jnp.where(flat, meta, rows * width + jnp.arange(tokens * top_k, dtype=jnp.int32))
    row_of_token = jnp.where(valid, row_of_token, rows)
  choice_of_slot = jnp.full(rows * width, tokens * top_k, jnp.int32).at[meta].set(
      jnp.arange(tokens * top_k, dtype=jnp.int32), unique_indices=True, mode="drop")
  local_ids = take((expert_ids.reshape(-1) % local_experts + 1).astype(jnp.int32), choice_of_slot)
  return RankPlan(
      token_of_row=jnp.where(real, order[:rows] // top_k, tokens).astype(jnp.int32),
      row_of_token=row_of_token.astype(jnp.int32),
      choice_of_slot=choice_of_slot,
      slot_of_choice=jnp.minimum(meta, rows * width)[:, None],
      local_ids=local_ids.reshape(rows, width),
      rows_to=counts[:devices],
      pairs_to=jnp.bincount(rank.reshape(-1), length=devices + 1)[:devices].astype(jnp.int32),
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RankExchange:
  """This device's side of the row exchange (all (devices,) int32), in the fields the row-per-pair
  transports read (`temoe.moe.exchange.ragged` / `padded` send and receive_back), plus:
  received: (token, expert) pairs routed to me before any cut; rows: rows routed to me;
  overflow: whether any receiver cut rows."""

  send_offsets: jax.Array
  send_sizes: jax.Array
  out_offsets: jax.Array
  recv_offsets: jax.Array
  recv_sizes: jax.Array
  back_offsets: jax.Array
  received: jax.Array
  rows: jax.Array
  overflow: jax.Array


def plan_exchange(rows_to: jax.Array, pairs_to: jax.Array, axis, devices: int, capacity: int, width: int) -> RankExchange:
  """Plans the exchange from my per-rank row and pair counts, identically on every device (`from_counts`)."""
  counts = jax.lax.all_gather(jnp.stack([rows_to, pairs_to]), axis).reshape(devices, 2, devices)
  return from_counts(counts[:, 0], counts[:, 1], jax.lax.axis_index(axis), capacity, width)


def from_counts(wanted: jax.Array, pairs: jax.Array, me, capacity: int, width: int) -> RankExchange:
  """The exchange of every device's rows `wanted` and pairs `pairs` ([src, dst]), seen from device `me`:
  receivers take senders in device order while their pairs fit `capacity`; the sender that does not fit
  sends the prefix of its rows that fits whatever they carry (room // width rows), later senders none."""
  room = jnp.maximum(capacity - exclusive_cumsum(pairs, 0), 0)
  sent = jnp.where(pairs <= room, wanted, jnp.minimum(wanted, room // width))
  landing = exclusive_cumsum(sent, 0)
  starts = exclusive_cumsum(wanted, 1)
  return RankExchange(
      send_offsets=starts[me],
      send_sizes=sent[me],
      out_offsets=landing[me],
      recv_offsets=landing[:, me],
      recv_sizes=sent[:, me],
      back_offsets=starts[:, me],
      received=pairs[:, me].sum(),
      rows=wanted[:, me].sum(),
      overflow=jnp.any(sent != wanted),
  )


def gemm_rows(capacity: int, received_rows: int, width: int, local_experts: int, align: int) -> int:
  """Rows of the receiver's expert-sorted buffer: its pair capacity plus alignment padding."""
  return dispatch.buffer_rows(min(capacity, received_rows * width), local_experts, align)


def plan_expansion(local_ids: jax.Array, local_experts: int, align: int, buffer: int) -> dispatch.DispatchPlan:
  """The expert-sorted layout of the received rows' pairs: `local_ids` (rows, slots) as sent
  (local expert + 1, 0 for none); a `buffer`-row plan of `local_experts` groups whose empty slots
  map to no row (slot_of_choice == buffer) and whose spare rows to no pair (zero rows)."""
  pairs = local_ids.shape[0] * local_ids.shape[1]
  ids = jnp.where(local_ids > 0, local_ids - 1, local_experts)
  p = dispatch.plan(ids, local_experts + 1, align)  # the empty slots form a last group, dropped here
  end = jnp.sum(p.padded_group_sizes[:local_experts])
  choice_of_slot = p.choice_of_slot[:buffer]
  if choice_of_slot.shape[0] < buffer:
    choice_of_slot = jnp.pad(choice_of_slot, (0, buffer - choice_of_slot.shape[0]), constant_values=pairs)
  p = dataclasses.replace(
      p,
      slot_of_choice=jnp.where(ids.reshape(-1) < local_experts, p.slot_of_choice, buffer).astype(jnp.int32),
      choice_of_slot=jnp.where(jnp.arange(buffer) < end, choice_of_slot, pairs).astype(jnp.int32),
      buffer_rows=buffer,
  )
  return dispatch.with_groups(p, local_experts)
