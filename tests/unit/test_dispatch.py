"""Dispatch plans and their custom gradients, directly (CI otherwise reaches them only through
training runs, and never at the GPU kernels' alignments 16 and 128)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from temoe.moe import dispatch

EXPERTS, TOKENS, TOP_K, EMB = 8, 40, 3, 5


def routing(kind: str, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if kind == "random":
    return np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)]).astype(np.int32)
  if kind == "skewed":  # experts 2 and 6 empty
    return rng.choice([0, 1, 3, 4, 5, 7], (TOKENS, TOP_K), p=[0.6, 0.2, 0.05, 0.05, 0.05, 0.05]).astype(np.int32)
  return np.full((TOKENS, TOP_K), 4, np.int32)  # one expert takes all


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert"])
@pytest.mark.parametrize("align", [1, 16, 128])
def test_plan_layout(align, kind):
  ids = routing(kind)
  p = dispatch.plan(jnp.asarray(ids), EXPERTS, align)
  counts = np.bincount(ids.reshape(-1), minlength=EXPERTS)
  padded = -(-counts // align) * align
  np.testing.assert_array_equal(p.group_sizes, counts)
  np.testing.assert_array_equal(p.padded_group_sizes, padded)
  assert p.buffer_rows == dispatch.buffer_rows(TOKENS * TOP_K, EXPERTS, align) >= padded.sum()
  assert p.buffer_rows % max(align, 1) == 0
  slots = np.asarray(p.slot_of_choice)
  assert len(set(slots.tolist())) == slots.size, "two routed rows share a buffer slot"
  starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
  for choice, expert in enumerate(ids.reshape(-1)):  # each row lands inside its expert's padded group
    assert starts[expert] <= slots[choice] < starts[expert] + counts[expert]
  owner = np.asarray(p.choice_of_slot)
  np.testing.assert_array_equal(owner[slots], np.arange(slots.size))
  assert (np.delete(owner, slots) == slots.size).all(), "a padding slot claims a routed row"


@pytest.mark.parametrize("align", [1, 16, 128])
def test_dispatch_combine_values_and_gradients_equal_plain_autodiff(align):
  ids = jnp.asarray(routing("skewed", 1))
  p = dispatch.plan(ids, EXPERTS, align)
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (TOKENS, EMB))
  weights = jax.nn.softmax(jax.random.normal(keys[1], (TOKENS, TOP_K)), -1)
  scale = jax.random.normal(keys[2], (p.buffer_rows, EMB))

  def temoe(x, weights):
    buf = dispatch.dispatch(x, p, TOP_K)
    return dispatch.combine(jnp.tanh(buf) * scale, p, weights)

  def plain(x, weights):  # the same maps as ordinary gathers: autodiff makes them scatter-adds
    padded_x = jnp.concatenate([x, jnp.zeros((1, EMB))])
    buf = padded_x[jnp.minimum(p.choice_of_slot // TOP_K, TOKENS)]
    per_choice = (jnp.tanh(buf) * scale)[p.slot_of_choice].reshape(TOKENS, TOP_K, EMB)
    return jnp.sum(per_choice * weights[..., None], axis=1)

  buf = dispatch.dispatch(x, p, TOP_K)
  padding = np.setdiff1d(np.arange(p.buffer_rows), np.asarray(p.slot_of_choice))
  assert not np.asarray(buf)[padding].any(), "padding rows of the dispatched buffer are not zero"
  np.testing.assert_allclose(temoe(x, weights), plain(x, weights), rtol=1e-6, atol=1e-6)
  cot = jax.random.normal(jax.random.key(1), (TOKENS, EMB))
  ours = jax.grad(lambda *a: jnp.sum(temoe(*a) * cot), argnums=(0, 1))(x, weights)
  ref = jax.grad(lambda *a: jnp.sum(plain(*a) * cot), argnums=(0, 1))(x, weights)
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_worst_case_buffer_holds_any_routing():
  # every expert one row short of a multiple of the alignment: the most padding possible
  align, experts = 16, 8
  counts = np.full(experts, align + 1)
  ids = jnp.asarray(np.repeat(np.arange(experts), counts).reshape(-1, 1).astype(np.int32))
  p = dispatch.plan(ids, experts, align)
  assert int(p.padded_group_sizes.sum()) <= p.buffer_rows


@pytest.mark.parametrize("align", [1, 16, 128])
def test_covering_group_sizes_cover_the_buffer(align):
  p = dispatch.plan(jnp.asarray(routing("skewed")), EXPERTS, align)
  sizes = np.asarray(dispatch.covering_group_sizes(p.padded_group_sizes, p.buffer_rows))
  assert sizes.sum() == p.buffer_rows and (sizes % align == 0).all()
  np.testing.assert_array_equal(sizes[:-1], np.asarray(p.padded_group_sizes)[:-1])


def test_dispatch_refuses_a_plan_of_other_shape():
  p = dispatch.plan(jnp.asarray(routing("random")), EXPERTS)
  with pytest.raises(ValueError, match="does not fit"):
    dispatch.dispatch(jnp.zeros((TOKENS + 1, EMB)), p, TOP_K)
