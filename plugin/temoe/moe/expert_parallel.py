"""Expert parallelism: routed rows to the devices that own their experts and back.

Runs per device inside `shard_map` over MaxText's mesh. Each device sorts its own routed rows
by expert, learns every device's per-expert counts (one small all-gather over the expert axis),
and exchanges rows with `jax.lax.ragged_all_to_all`: no host sync, static shapes. XLA:CPU has no
ragged all-to-all, so there the same plan moves rows with a padded `all_to_all` (one slot of
`rows` per device pair, more bytes; CPU runs are for correctness), honouring the same capacity,
so overflow behaves the same on both. The receive
buffer holds `capacity` rows: the worst case (dropless) unless MaxText's `ragged_buffer_factor`
bounds it, in which case rows past it are not sent, the layer reports the overflow, and MaxText's
train step skips that step's update (its te_moe_capacity_overflow handling) rather than train on
dropped tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


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


def send(rows: jax.Array, ex: Exchange, capacity: int, axis: str) -> jax.Array:
  """My expert-sorted rows -> my receive buffer (capacity, emb) of rows for my local experts."""
  out = jnp.zeros((capacity, rows.shape[-1]), rows.dtype)
  return jax.lax.ragged_all_to_all(
      rows, out, ex.send_offsets, ex.send_sizes, ex.out_offsets, ex.recv_sizes, axis_name=axis
  )


def receive_back(buffer: jax.Array, ex: Exchange, rows: int, axis: str) -> jax.Array:
  """The reverse: expert outputs in my receive buffer -> their senders' sorted rows (rows, emb)."""
  out = jnp.zeros((rows, buffer.shape[-1]), buffer.dtype)
  return jax.lax.ragged_all_to_all(
      buffer, out, ex.recv_offsets, ex.recv_sizes, ex.back_offsets, ex.send_sizes, axis_name=axis
  )


def local_expert_of_rows(ex: Exchange, capacity: int) -> jax.Array:
  """(capacity,) local expert of each received row; unused rows get the sentinel id local_experts."""
  senders, local_experts = ex.local_counts.shape
  ids = jnp.tile(jnp.arange(local_experts, dtype=jnp.int32), senders)
  per_row = jnp.repeat(ids, ex.local_counts.reshape(-1), total_repeat_length=capacity)
  return jnp.where(jnp.arange(capacity) < ex.local_counts.sum(), per_row, local_experts)


def uses_padded_exchange() -> bool:
  """Whether rows move through the padded all_to_all: XLA:CPU has no ragged all-to-all."""
  return jax.devices()[0].platform == "cpu"


def send_padded(rows: jax.Array, ex: Exchange, devices: int, axis: str) -> jax.Array:
  """`send` through all_to_all: (devices * rows, emb), sender i's rows at [i * rows, ...)."""
  n, emb = rows.shape
  slot = jnp.arange(n)
  src = ex.send_offsets[:, None] + slot[None, :]  # (devices, n)
  valid = slot[None, :] < ex.send_sizes[:, None]
  chunks = jnp.where(valid[..., None], rows[jnp.clip(src, 0, n - 1)], 0)
  return jax.lax.all_to_all(chunks, axis, 0, 0, tiled=False).reshape(devices * n, emb)


def receive_back_padded(buffer: jax.Array, ex: Exchange, devices: int, axis: str) -> jax.Array:
  """`receive_back` through all_to_all: my rows come back to their sorted positions."""
  n = buffer.shape[0] // devices
  back = jax.lax.all_to_all(buffer.reshape(devices, n, -1), axis, 0, 0, tiled=False)  # [dst j] = my rows j ran
  slot = jnp.arange(n)
  valid = slot[None, :] < ex.send_sizes[:, None]
  dest = jnp.where(valid, ex.send_offsets[:, None] + slot[None, :], n)  # invalid rows -> dropped index n
  out = jnp.zeros((n + 1, buffer.shape[-1]), buffer.dtype)
  return out.at[dest.reshape(-1)].set(back.reshape(devices * n, -1), unique_indices=False)[:n]


def local_expert_of_padded_rows(ex: Exchange, rows: int) -> jax.Array:
  """(devices * rows,) local expert of each row of the padded receive buffer; gaps get the sentinel."""
  senders, local_experts = ex.local_counts.shape
  slot = jnp.arange(rows)
  ends = jnp.cumsum(ex.local_counts, axis=1)  # (senders, local_experts)
  ids = jax.vmap(lambda e: jnp.searchsorted(e, slot, side="right"))(ends)  # (senders, rows)
  return jnp.where(slot[None, :] < ex.recv_sizes[:, None], ids, local_experts).reshape(-1).astype(jnp.int32)
