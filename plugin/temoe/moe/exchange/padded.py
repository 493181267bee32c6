"""Row-per-pair exchange over a padded `jax.lax.all_to_all`, for XLA:CPU (no ragged all-to-all):
one slot of `routed_rows` per device pair, the same plan and capacity as `ragged`, so overflow
behaves the same; more bytes move (CPU runs are for correctness)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from temoe.moe.exchange import pairs


def send(rows, ex, capacity, axis, devices):
  """(devices * rows, emb): sender i's rows for me at [i * rows, ...)."""
  del capacity
  n, emb = rows.shape
  slot = jnp.arange(n)
  src = ex.send_offsets[:, None] + slot[None, :]  # (devices, n)
  valid = slot[None, :] < ex.send_sizes[:, None]
  chunks = jnp.where(valid[..., None], rows[jnp.clip(src, 0, n - 1)], 0)
  return jax.lax.all_to_all(chunks, axis, 0, 0, tiled=False).reshape(devices * n, emb)


def receive_back(buffer, ex, routed_rows, axis, devices):
  """My rows come back to their sorted positions."""
  n = routed_rows
  back = jax.lax.all_to_all(buffer.reshape(devices, n, -1), axis, 0, 0, tiled=False)  # [dst j] = my rows j ran
  slot = jnp.arange(n)
  valid = slot[None, :] < ex.send_sizes[:, None]
  dest = jnp.where(valid, ex.send_offsets[:, None] + slot[None, :], n)  # invalid rows -> dropped index n
  out = jnp.zeros((n + 1, buffer.shape[-1]), buffer.dtype)
  return out.at[dest.reshape(-1)].set(back.reshape(devices * n, -1), unique_indices=False)[:n]


def local_expert_ids(ex, capacity, routed_rows):
  """(devices * rows,) local expert of each row of the padded receive buffer; gaps get the sentinel."""
  del capacity
  senders, local_experts = ex.local_counts.shape
  slot = jnp.arange(routed_rows)
  ends = jnp.cumsum(ex.local_counts, axis=1)  # (senders, local_experts)
  ids = jax.vmap(lambda e: jnp.searchsorted(e, slot, side="right"))(ends)  # (senders, rows)
  return jnp.where(slot[None, :] < ex.recv_sizes[:, None], ids, local_experts).reshape(-1).astype(jnp.int32)


TRANSPORT = pairs.Transport(send=send, local_expert_ids=local_expert_ids, receive_back=receive_back)


def run(ctx, x, expert_ids, weights, mlp):
  return pairs.run(ctx, x, expert_ids, weights, mlp, TRANSPORT)
