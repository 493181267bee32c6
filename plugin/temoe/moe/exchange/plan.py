"""The plan of a row-per-pair exchange: every device learns every device's per-expert row counts
(one small all-gather over the expert axis) and derives, identically everywhere, who sends how many
rows where, and where they land. Receivers fill their buffers in sender order; when a bounded buffer
(`ragged_buffer_factor`) is full, later senders' rows are not sent and the plan says so (`overflow`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Exchange:
  """This device's side of one dispatch exchange and its reverse (all (devices,) int32 unless said).

  send_offsets/send_sizes: slices of my expert-sorted rows for each receiver.
  out_offsets: where each of my slices lands in its receiver's buffer.
  recv_offsets/recv_sizes: slices of my receive buffer from each sender.
  back_offsets: where each sender's rows return to in its own sorted rows.
  local_counts: (devices, local_experts) rows received per sender and local expert.
  received: rows routed to me before any capacity cut; overflow: whether any receiver cut rows.
  """

  send_offsets: jax.Array
  send_sizes: jax.Array
  out_offsets: jax.Array
  recv_offsets: jax.Array
  recv_sizes: jax.Array
  back_offsets: jax.Array
  local_counts: jax.Array
  received: jax.Array
  overflow: jax.Array


def plan_exchange(group_sizes: jax.Array, axis: str, devices: int, capacity: int) -> Exchange:
  """Plans the exchange from my per-expert row counts `group_sizes` (experts,), identically on every device."""
  local_experts = group_sizes.shape[0] // devices
  me = jax.lax.axis_index(axis)
  counts = jax.lax.all_gather(group_sizes, axis).reshape(devices, devices, local_experts)  # [src, dst, e]
  wanted = counts.sum(-1)  # [src, dst]
  room = jnp.maximum(capacity - exclusive_cumsum(wanted, 0), 0)
  sent = jnp.minimum(wanted, room)  # senders in device order fill each receiver's buffer
  kept = jnp.minimum(counts, jnp.maximum(sent[..., None] - exclusive_cumsum(counts, 2), 0))
  landing = exclusive_cumsum(sent, 0)
  return Exchange(
      send_offsets=exclusive_cumsum(wanted, 1)[me],
      send_sizes=sent[me],
      out_offsets=landing[me],
      recv_offsets=landing[:, me],
      recv_sizes=sent[:, me],
      back_offsets=exclusive_cumsum(wanted, 1)[:, me],
      local_counts=kept[:, me],
      received=wanted[:, me].sum(),
      overflow=jnp.any(sent != wanted),
  )
