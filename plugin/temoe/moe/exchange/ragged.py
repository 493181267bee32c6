"""Row-per-pair exchange over `jax.lax.ragged_all_to_all` (GPU): no host sync, static shapes; the
receive buffer holds `capacity` rows, filled in sender order."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from temoe.moe.exchange import pairs


def send(rows, ex, capacity, axis, devices):
  """My expert-sorted rows -> my receive buffer (capacity, emb) of rows for my local experts."""
  del devices
  out = jnp.zeros((capacity, rows.shape[-1]), rows.dtype)
  return jax.lax.ragged_all_to_all(
      rows, out, ex.send_offsets, ex.send_sizes, ex.out_offsets, ex.recv_sizes, axis_name=axis
  )


def receive_back(buffer, ex, routed_rows, axis, devices):
  """The reverse: expert outputs in my receive buffer -> their senders' sorted rows (rows, emb)."""
  del devices
  out = jnp.zeros((routed_rows, buffer.shape[-1]), buffer.dtype)
  return jax.lax.ragged_all_to_all(
      buffer, out, ex.recv_offsets, ex.recv_sizes, ex.back_offsets, ex.send_sizes, axis_name=axis
  )


def local_expert_ids(ex, capacity, routed_rows):
  """(capacity,) local expert of each received row; unused rows get the sentinel id local_experts."""
  del routed_rows
  senders, local_experts = ex.local_counts.shape
  ids = jnp.tile(jnp.arange(local_experts, dtype=jnp.int32), senders)
  per_row = jnp.repeat(ids, ex.local_counts.reshape(-1), total_repeat_length=capacity)
  return jnp.where(jnp.arange(capacity) < ex.local_counts.sum(), per_row, local_experts)


TRANSPORT = pairs.Transport(send=send, local_expert_ids=local_expert_ids, receive_back=receive_back)


def run(ctx, x, expert_ids, weights, mlp):
  return pairs.run(ctx, x, expert_ids, weights, mlp, TRANSPORT)
