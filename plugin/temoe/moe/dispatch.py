"""Dispatch and combine: tokens into per-expert groups and back, dropless, with static shapes.

Every (token, choice) pair gets a row in an expert-sorted buffer whose size is fixed at trace time
(tokens * top_k, plus `align - 1` spare rows per expert when groups are padded), so the block is
jit- and CUDA-graph-friendly and no routing skew can drop a token. Group sizes stay on device.

Both directions are gathers, and so are their gradients (custom VJPs): autodiff of a gather is a
scatter-add, which on GPUs costs several times a gather of the same rows; here the plan already
holds both index maps, so each transpose is the other direction's gather.
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
  slot_of_choice: (rows,) buffer position of each flat (token, choice).
  choice_of_slot: (buffer_rows,) flat (token, choice) held by each buffer row; `rows` for padding.
  group_sizes: (experts,) real rows per expert.
  padded_group_sizes: (experts,) rows per expert in the buffer, multiples of `align`.
  buffer_rows: static buffer length.
  """

  order: jax.Array
  slots: jax.Array
  slot_of_choice: jax.Array
  choice_of_slot: jax.Array
  group_sizes: jax.Array
  padded_group_sizes: jax.Array
  buffer_rows: int

  @property
  def routed_rows(self) -> int:
    return self.order.shape[0]


jax.tree_util.register_dataclass(
    DispatchPlan,
    data_fields=["order", "slots", "slot_of_choice", "choice_of_slot", "group_sizes", "padded_group_sizes"],
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
  rows = flat.shape[0]
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  if align <= 1:
    padded, slots, size = group_sizes, jnp.arange(rows, dtype=jnp.int32), rows
  else:
    padded = ((group_sizes + align - 1) // align * align).astype(jnp.int32)
    shift = (jnp.cumsum(padded) - padded) - (jnp.cumsum(group_sizes) - group_sizes)
    slots = (jnp.arange(rows, dtype=jnp.int32) + shift[flat[order]]).astype(jnp.int32)
    size = buffer_rows(rows, num_experts, align)
  slot_of_choice = jnp.zeros(rows, jnp.int32).at[order].set(slots, unique_indices=True)
  choice_of_slot = jnp.full(size, rows, jnp.int32).at[slots].set(order, unique_indices=True)
  return DispatchPlan(order, slots, slot_of_choice, choice_of_slot, group_sizes, padded, size)


def covering_group_sizes(padded_group_sizes: jax.Array, rows: int) -> jax.Array:
  """Group sizes summing to `rows`: the buffer's spare rows past the last group join the last expert.

  TE's grouped quantize and its multi-stream grouped GEMM (the path FP8 current scaling takes) check
  sum(group_sizes) == rows and fail otherwise; the cuBLAS grouped kernel (bf16, MXFP8) accepts a
  shorter sum but leaves the rows past it uninitialised, which would then flow into the activation
  and the backward quantizers. The spare rows are zeros and combine never reads them; the cost is
  that the last expert multiplies them too. The spare count is a multiple of the alignment.
  """
  spare = rows - jnp.sum(padded_group_sizes)
  return padded_group_sizes.astype(jnp.int32).at[-1].add(spare.astype(jnp.int32))


def row_experts(p: DispatchPlan) -> jax.Array:
  """The expert of each buffer row (padding rows belong to the group they pad)."""
  ids = jnp.arange(p.padded_group_sizes.shape[0], dtype=jnp.int32)
  return jnp.repeat(ids, p.padded_group_sizes, total_repeat_length=p.buffer_rows)


def take_with_zero_row(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[index], where index == len(x) reads a zero row (padding)."""
  return jnp.concatenate([x, jnp.zeros((1, x.shape[-1]), x.dtype)])[index]


@jax.custom_vjp
def _to_slots(x, choice_of_slot, slot_of_choice):
  top_k = slot_of_choice.shape[0] // x.shape[0]
  return take_with_zero_row(x, choice_of_slot // top_k)


def _to_slots_fwd(x, choice_of_slot, slot_of_choice):
  return _to_slots(x, choice_of_slot, slot_of_choice), (slot_of_choice, x.shape[0])


def sum_choices(g: jax.Array, slot_of_choice: jax.Array, tokens: int) -> jax.Array:
  """(tokens, emb): each token's top_k buffer rows of g summed (in float32): dispatch's transpose."""
  return g[slot_of_choice].reshape(tokens, -1, g.shape[-1]).sum(axis=1, dtype=jnp.float32).astype(g.dtype)


def _to_slots_bwd(res, g):
  slot_of_choice, tokens = res
  return sum_choices(g, slot_of_choice, tokens), None, None


_to_slots.defvjp(_to_slots_fwd, _to_slots_bwd)


@jax.custom_vjp
def _to_choices(y, slot_of_choice, choice_of_slot):
  return y[slot_of_choice]


def _to_choices_fwd(y, slot_of_choice, choice_of_slot):
  return y[slot_of_choice], choice_of_slot


def _to_choices_bwd(choice_of_slot, g):
  return take_with_zero_row(g, choice_of_slot), None, None


_to_choices.defvjp(_to_choices_fwd, _to_choices_bwd)


def dispatch(x: jax.Array, p: DispatchPlan, top_k: int) -> jax.Array:
  """Gathers token rows `x` (tokens, emb) into the expert-sorted buffer; padding rows are zero."""
  if p.routed_rows != x.shape[0] * top_k:
    raise ValueError(f"a plan of {p.routed_rows} routed rows does not fit {x.shape[0]} tokens x top_k {top_k}")
  return _to_slots(x, p.choice_of_slot, p.slot_of_choice)


def undispatch(y: jax.Array, p: DispatchPlan) -> jax.Array:
  """Buffer `y` back to one row per routed (token, choice), in the flat order `plan` was given."""
  return _to_choices(y, p.slot_of_choice, p.choice_of_slot)


def with_groups(p: DispatchPlan, num_groups: int) -> DispatchPlan:
  """The plan seen by the expert MLP when groups past `num_groups` are spare rows (EP sentinel)."""
  return dataclasses.replace(p, group_sizes=p.group_sizes[:num_groups], padded_group_sizes=p.padded_group_sizes[:num_groups])


def combine(y: jax.Array, p: DispatchPlan, weights: jax.Array, float32_sum: bool = True) -> jax.Array:
  """Returns (tokens, emb): each token's expert outputs from buffer `y`, summed with its `weights`."""
  tokens, top_k = weights.shape
  return weighted_sum(undispatch(y, p).reshape(tokens, top_k, -1), weights, float32_sum)


def weighted_sum(per_choice: jax.Array, weights: jax.Array, float32_sum: bool = True) -> jax.Array:
  """(tokens, emb): per_choice (tokens, top_k, emb) summed over top_k with `weights` (tokens, top_k)."""
  if float32_sum:  # converts fuse into the multiply-reduce: no float32 copy of the rows is stored
    per_choice, weights = per_choice.astype(jnp.float32), weights.astype(jnp.float32)
  return jnp.sum(per_choice * weights[..., None].astype(per_choice.dtype), axis=1)
