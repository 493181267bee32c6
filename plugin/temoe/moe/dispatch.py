"""Dispatch and combine: tokens into per-expert groups and back, dropless, with static shapes.

Every (token, choice) pair gets a row in an expert-sorted buffer whose size is fixed at trace time
(tokens * top_k, plus `align - 1` spare rows per expert when groups are padded), so the block is
jit- and CUDA-graph-friendly and no routing skew can drop a token. Group sizes stay on device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """Where each routed row goes.

  order: (rows,) the flat (token * top_k + choice) index of each row, in expert order.
  slots: (rows,) each expert-ordered row's position in the buffer (arange when align == 1).
  group_sizes: (experts,) real rows per expert.
  padded_group_sizes: (experts,) rows per expert in the buffer, multiples of `align`.
  buffer_rows: static buffer length.
  """

  order: jax.Array
  slots: jax.Array
  group_sizes: jax.Array
  padded_group_sizes: jax.Array
  buffer_rows: int

  @property
  def routed_rows(self) -> int:
    return self.order.shape[0]


jax.tree_util.register_dataclass(
    DispatchPlan,
    data_fields=["order", "slots", "group_sizes", "padded_group_sizes"],
    meta_fields=["buffer_rows"],
)


def buffer_rows(routed_rows: int, num_experts: int, align: int) -> int:
  """The worst-case buffer: every expert may waste up to align - 1 rows of padding."""
  if align <= 1:
    return routed_rows
  worst = routed_rows + num_experts * (align - 1)
  return -(-worst // align) * align


def plan(experts: jax.Array, num_experts: int, align: int = 1) -> DispatchPlan:
  """Plans the expert-sorted layout for `experts` (tokens, top_k) int32 ids."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  rows = flat.shape[0]
  if align <= 1:
    return DispatchPlan(order, jnp.arange(rows, dtype=jnp.int32), group_sizes, group_sizes, rows)
  padded = (group_sizes + align - 1) // align * align
  start = jnp.cumsum(group_sizes) - group_sizes
  padded_start = jnp.cumsum(padded) - padded
  sorted_expert = flat[order]
  slots = (jnp.arange(rows, dtype=jnp.int32) - start[sorted_expert] + padded_start[sorted_expert]).astype(jnp.int32)
  return DispatchPlan(order, slots, group_sizes, padded.astype(jnp.int32), buffer_rows(rows, num_experts, align))


def row_experts(p: DispatchPlan) -> jax.Array:
  """The expert of each buffer row (padding rows belong to the group they pad)."""
  ids = jnp.arange(p.padded_group_sizes.shape[0], dtype=jnp.int32)
  return jnp.repeat(ids, p.padded_group_sizes, total_repeat_length=p.buffer_rows)


def dispatch(x: jax.Array, p: DispatchPlan, top_k: int) -> jax.Array:
  """Gathers token rows `x` (tokens, emb) into the expert-sorted buffer; padding rows are zero."""
  rows = x[p.order // top_k]
  if p.buffer_rows == p.routed_rows:
    return rows
  return jnp.zeros((p.buffer_rows, x.shape[-1]), x.dtype).at[p.slots].set(rows, unique_indices=True)


def undispatch(y: jax.Array, p: DispatchPlan) -> jax.Array:
  """Buffer `y` back to one row per routed (token, choice), in the flat order `plan` was given."""
  rows = y if p.buffer_rows == p.routed_rows else y[p.slots]
  inverse = jnp.zeros_like(p.order).at[p.order].set(jnp.arange(p.routed_rows, dtype=jnp.int32), unique_indices=True)
  return rows[inverse]


def with_groups(p: DispatchPlan, num_groups: int) -> DispatchPlan:
  """The plan seen by the expert MLP when groups past `num_groups` are spare rows (EP sentinel)."""
  return dataclasses.replace(p, group_sizes=p.group_sizes[:num_groups], padded_group_sizes=p.padded_group_sizes[:num_groups])


def combine(y: jax.Array, p: DispatchPlan, weights: jax.Array, float32_sum: bool = True) -> jax.Array:
  """Returns (tokens, emb): each token's expert outputs from buffer `y`, summed with its `weights`."""
  tokens, top_k = weights.shape
  per_choice = undispatch(y, p).reshape(tokens, top_k, -1)
  if float32_sum:
    per_choice, weights = per_choice.astype(jnp.float32), weights.astype(jnp.float32)
  return jnp.einsum("tkd,tk->td", per_choice, weights)
