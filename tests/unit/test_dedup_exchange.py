"""The deduplicating expert-parallel exchange on a named vmap axis standing in for the expert mesh
axis (the same collectives, one process): its plan against a numpy model, and its forward and every
gradient against the row-per-pair exchange and the one-device block, float32, across expert-axis
sizes, top-k, group-limited routing aligned and not aligned with ranks, skew, an idle rank, expert
row alignment and bounded buffers. The GPU transport (`ragged_all_to_all`, which XLA:CPU lacks) runs
here on a reference model of that collective's documented semantics built from all_gather."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_cache import persistent_cache

from temoe.moe import block, dispatch, exchange
from temoe.moe.context import MoEContext
from temoe.moe.exchange import dedup, dedup_plan, padded, ragged
from temoe.moe.exchange import plan as exchange_plan
from temoe.moe.exchange.rowmaps import take

TOL = 1e-5
TOKENS, EMB, FFN = 12, 8, 4
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # XLA:CPU compile time halves; the math is the same


def routing(rng, devices, local, top_k, kind, groups=None, topk_group=None):
  """(devices, tokens, top_k) expert ids: uniform top-k, group-limited (topk_group of `groups`
  groups, then top_k among their experts), skewed (rank 0's experts first) or with rank 1 idle."""
  experts = devices * local
  ids = np.zeros((devices, TOKENS, top_k), np.int64)
  for d in range(devices):
    for t in range(TOKENS):
      pool = np.arange(experts)
      if kind == "grouped":
        size = experts // groups
        chosen = rng.choice(groups, topk_group, replace=False)
        pool = np.concatenate([np.arange(g * size, (g + 1) * size) for g in chosen])
      elif kind == "idle_rank":
        pool = pool[pool // local != 1]
      p = None
      if kind == "skewed":
        p = np.where(pool // local == 0, 20.0, 1.0)
        p /= p.sum()
      ids[d, t] = rng.choice(pool, top_k, replace=False, p=p)
  return jnp.asarray(ids, jnp.int32)


def distinct_rank_pairs(ids: np.ndarray, local: int) -> np.ndarray:
  """(devices, devices) distinct (token, rank) pairs each device has for each rank."""
  devices = ids.shape[0]
  out = np.zeros((devices, devices), np.int64)
  for d in range(devices):
    for t in range(ids.shape[1]):
      for r in set((ids[d, t] // local).tolist()):
        out[d, r] += 1
  return out


def setup(devices, local, top_k, ids, seed=0):
  rng = np.random.default_rng(seed)
  experts = devices * local
  x = jnp.asarray(rng.standard_normal((devices, TOKENS, EMB)), jnp.float32)
  w = jnp.asarray(rng.random((devices, TOKENS, top_k)), jnp.float32)
  wi = jnp.asarray(rng.standard_normal((experts, EMB, 2 * FFN)) * 0.3, jnp.float32)
  wo = jnp.asarray(rng.standard_normal((experts, FFN, EMB)) * 0.3, jnp.float32)
  cot = jnp.asarray(rng.standard_normal((devices, TOKENS, EMB)), jnp.float32)
  return x, w, wi, wo, cot


def reference_tokens_mlp(ctx, wi, wo, calls):
  """An expert kernel's MLP from rows (`tokens_mlp`: expansion, MLP and weighted sum in one call) as
  plain JAX: the contract the deduplicating exchange hands its received rows to."""

  def run(rows, p, weights, empty_choices=False):
    calls.append(empty_choices)
    width = weights.shape[1]
    buf = take(rows, p.choice_of_slot // width)  # padding slots: zero rows
    y = block.expert_mlp(ctx, buf, p, wi, wo, (None, None, None))
    per_choice = take(y, p.slot_of_choice) if empty_choices else y[p.slot_of_choice]
    return dispatch.weighted_sum(per_choice.reshape(rows.shape[0], width, -1), weights, ctx.float32_weight_sum)

  return run


@pytest.fixture(scope="module", autouse=True)
def _compile_cache():
  """A program compiled before in the session (the same HLO: the tokens-MLP test's reference runs are the ragged
  test's, on its routing) is loaded, not compiled again (compile_cache)."""
  with persistent_cache():
    yield


def ep_run(strategy, devices, local, top_k, ids, args, factor=0.0, align=1, tokens_calls=None, context=None,
           grads=True, probe=None, **kw):
  """Output, stats and grads wrt (x, weights, wi, wo) of `strategy` on a vmap expert axis (with `tokens_calls` a
  list: through reference_tokens_mlp, recording its calls there; `context`: more MoEContext fields,
  e.g. the hierarchical exchange's ep_node_size; grads=False: the forward alone, a smaller program, grads None;
  `probe`: a function of one device's expert ids run in the same program, its results as stats["probe"]: a plan
  computed there is the exchange's own, which XLA computes once, where a program of its own took ~0.3-0.5 CPU-s)."""
  x, w, wi, wo, cot = args
  ctx = MoEContext(num_experts=devices * local, top_k=top_k, dtype=jnp.float32, ep_axis="ep", ep_size=devices,
                   buffer_factor=factor, align=align, **(context or {}))

  def per_device(x, ids, w, wi, wo):
    mlp = functools.partial(block.expert_mlp, ctx, wi=wi, wo=wo, biases=(None, None, None))
    extra = dict(kw)
    if tokens_calls is not None:
      extra["tokens_mlp"] = reference_tokens_mlp(ctx, wi, wo, tokens_calls)
    out, stats = strategy.run(ctx, x, ids, w, mlp, **extra)
    return out, ({**stats, "probe": probe(ids)} if probe else stats)

  def loss(x, w, wi, wo):
    out, stats = jax.vmap(per_device, axis_name="ep")(
        x, ids, w, wi.reshape(devices, local, *wi.shape[1:]), wo.reshape(devices, local, *wo.shape[1:]))
    return jnp.sum(out * cot), (out, stats)

  if not grads:
    _, (out, stats) = jax.jit(loss, compiler_options=FAST_COMPILE)(x, w, wi, wo)
    return out, stats, None
  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True), compiler_options=FAST_COMPILE)
  (_, (out, stats)), grads = run(x, w, wi, wo)
  return out, stats, grads


def one_device(devices, local, top_k, ids, args):
  x, w, wi, wo, cot = args
  ctx = MoEContext(num_experts=devices * local, top_k=top_k, dtype=jnp.float32)

  def loss(x, w, wi, wo):
    out, _ = block.apply(ctx, x, ids, w, wi, wo)
    return jnp.sum(out * cot), out

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True), compiler_options=FAST_COMPILE)
  (_, out), grads = grad(x, w, wi, wo)
  return out, grads


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(got, want):
  (out, grads), (ref_out, ref_grads) = got, want
  assert rel(out, ref_out) < TOL and np.linalg.norm(ref_out) > 0
  for name, g, r in zip(("x", "weights", "wi", "wo"), grads, ref_grads):
    assert rel(g, r) < TOL, (name, rel(g, r))


def planned_rows(devices, local, top_k, capacity):
  """One device's row exchange (dedup_plan.RankExchange: the rows it sends, its stats) from its expert ids, as the
  deduplicating exchange plans it: an ep_run probe."""
  width = dedup_plan.slots(top_k, local)

  def plan(ids):
    rp = dedup_plan.plan_ranks(ids, local, devices)
    return dedup_plan.plan_exchange(rp.rows_to, rp.pairs_to, "ep", devices, capacity, width)

  return plan


CASES = {  # name: (devices, local experts, top_k, routing kind, groups, topk_group)
    "ep2_top1": (2, 4, 1, "uniform", None, None),
    "ep2_top6_more_choices_than_ranks": (2, 4, 6, "uniform", None, None),
    "ep4_top2_groups_aligned": (4, 3, 2, "grouped", 4, 2),
    "ep4_top8_groups_not_aligned": (4, 6, 8, "grouped", 6, 3),  # groups of 4 experts straddle ranks of 6
    "ep8_top8_deepseek_one_group_per_rank": (8, 4, 8, "grouped", 8, 4),
    "ep8_top3_skewed": (8, 2, 3, "skewed", None, None),
    "ep4_top4_idle_rank": (4, 4, 4, "idle_rank", None, None),
}
"""No uniform case on 8 ranks (it was ep8_top5: 8 ranks of 3 experts, top-5): the plan and the exchange branch on
shapes alone, and it took the branches of ep8_top3_skewed and ep8_top8_deepseek_one_group_per_rank (top_k <= ranks:
tokens * top_k rows a device; top_k > local experts: as many slots a row as local experts; the receiver's GEMM
buffer at the pair capacity, below received rows x slots; align 1, dropless); tokens with several experts on one
rank and every rank receiving occur in both, uniform routing on ep2_top1 and ep2_top6."""
AGAINST_ROW_PER_PAIR = ("ep2_top6_more_choices_than_ranks", "ep4_top4_idle_rank", "ep8_top8_deepseek_one_group_per_rank")


@pytest.mark.parametrize("case", sorted(CASES))
def test_dedup_matches_row_per_pair_and_one_device(case):
  devices, local, top_k, kind, groups, topk_group = CASES[case]
  ids = routing(np.random.default_rng(len(case)), devices, local, top_k, kind, groups, topk_group)
  args = setup(devices, local, top_k, ids)
  capacity = exchange.receive_capacity(TOKENS * top_k, devices, 0.0)
  out, stats, grads = ep_run(dedup, devices, local, top_k, ids, args, probe=planned_rows(devices, local, top_k, capacity))
  assert_close((out, grads), one_device(devices, local, top_k, ids, args))
  if case in AGAINST_ROW_PER_PAIR:  # each EP compile costs seconds on XLA:CPU
    p_out, p_stats, p_grads = ep_run(padded, devices, local, top_k, ids, args)
    assert_close((out, grads), (p_out, p_grads))
    np.testing.assert_array_equal(stats["real"], p_stats["real"])  # the same pairs at the GEMMs
  # `received` counts the (token, expert) pairs routed to each rank, as the row-per-pair exchange.
  pairs = np.stack([np.bincount(np.asarray(ids[d]).ravel() // local, minlength=devices) for d in range(devices)])
  np.testing.assert_array_equal(stats["received"], pairs.sum(0))
  assert not np.asarray(stats["overflow"]).any()
  # Rows crossing the exchange are exactly the distinct (token, rank) pairs.
  distinct = distinct_rank_pairs(np.asarray(ids), local)
  ex = stats["probe"]
  np.testing.assert_array_equal(ex.send_sizes, distinct)
  np.testing.assert_array_equal(ex.rows, distinct.sum(0))
  if kind == "idle_rank":
    assert int(stats["received"][1]) == 0
  if case == "ep8_top8_deepseek_one_group_per_rank":  # a token reaches at most its 4 groups' ranks
    assert distinct.sum() <= 0.5 * devices * TOKENS * top_k


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_bounded_buffer_overflow_is_exact_and_the_same_as_row_per_pair(factor):
  devices, local, top_k = 4, 4, 4
  ids = routing(np.random.default_rng(7), devices, local, top_k, "skewed")
  capacity = exchange.receive_capacity(TOKENS * top_k, devices, factor)
  args = setup(devices, local, top_k, ids)
  _, stats, grads = ep_run(dedup, devices, local, top_k, ids, args, factor=factor,
                           probe=planned_rows(devices, local, top_k, capacity))
  ex = stats["probe"]
  pairs = np.stack([np.bincount(np.asarray(ids[d]).ravel() // local, minlength=devices) for d in range(devices)])
  rows = distinct_rank_pairs(np.asarray(ids), local)
  width = dedup_plan.slots(top_k, local)
  sent = np.zeros_like(rows)  # model: senders in device order while their pairs fit; the first that
  for dst in range(devices):  # does not sends what fits whatever its rows carry, later ones nothing
    room = capacity
    for src in range(devices):
      sent[src, dst] = rows[src, dst] if pairs[src, dst] <= room else min(rows[src, dst], max(room, 0) // width)
      room -= pairs[src, dst]
  np.testing.assert_array_equal(ex.send_sizes, sent)
  np.testing.assert_array_equal(ex.received, pairs.sum(0))
  overflow = bool((pairs.sum(0) > capacity).any())
  assert bool(ex.overflow[0]) == overflow
  counts = jnp.asarray(np.stack([np.bincount(np.asarray(ids[d]).ravel(), minlength=devices * local)
                                 for d in range(devices)]), jnp.int32)
  plan = jax.vmap(lambda g: exchange_plan.plan_exchange(g, "ep", devices, capacity), axis_name="ep")
  pairs_ex = jax.jit(plan)(counts)
  assert bool(np.asarray(stats["overflow"]).any()) == overflow == bool(pairs_ex.overflow[0])  # as row-per-pair
  np.testing.assert_array_equal(stats["received"], pairs_ex.received)
  assert (np.asarray(stats["real"]) <= capacity).all()  # what was kept fits the GEMM buffer
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)
  assert overflow == (factor == 1.0)  # rank 0's experts are hot: a balanced-load buffer overflows; 4x holds all


def reference_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
  """jax.lax.ragged_all_to_all's documented semantics from all_gather: sender j's rows
  [input_offsets[me], + send_sizes[me]) land in my output at its output_offsets[me]. All senders in one gather
  (each output row from the last sender landing on it, as a loop over senders would leave it): fewer ops than a
  loop, so the ragged programs compile in ~4/5 of the time."""
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  ops, starts, sizes, lands = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                                          output_offsets))
  land, size, start = lands[:, me], sizes[:, me], starts[:, me]
  r = jnp.arange(output.shape[0])
  hit = (r[None, :] >= land[:, None]) & (r[None, :] < (land + size)[:, None])  # (senders, output rows)
  src = ops.shape[0] - 1 - jnp.argmax(hit[::-1], axis=0)  # the last sender landing on each row
  rows = ops[src, jnp.clip(start[src] + r - land[src], 0, operand.shape[0] - 1)]
  return jnp.where(jnp.any(hit, axis=0).reshape(-1, *([1] * (output.ndim - 1))), rows, output)


@pytest.mark.parametrize("factor,align", [(0.0, 1), (2.0, 4)])
def test_ragged_transport_uses_the_same_plan(monkeypatch, factor, align):
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", reference_ragged_all_to_all)
  devices, local, top_k = 4, 4, 4
  ids = routing(np.random.default_rng(11), devices, local, top_k, "grouped", 4, 2)
  args = setup(devices, local, top_k, ids)
  out, stats, grads = ep_run(dedup, devices, local, top_k, ids, args, factor=factor, align=align, moves=ragged)
  want = ep_run(dedup, devices, local, top_k, ids, args, factor=factor, align=align, moves=padded)
  assert_close((out, grads), (want[0], want[2]))
  assert_close((out, grads), one_device(devices, local, top_k, ids, args))
  assert not np.asarray(stats["overflow"]).any()
  assert (np.asarray(stats["padded"]) % align == 0).all()


@pytest.mark.parametrize("factor,align", [(0.0, 1), (2.0, 4)])
def test_dedup_hands_its_received_rows_to_a_tokens_mlp(factor, align):
  """With an expert kernel's MLP from rows (mosaic_tokens on Hopper), the receiver hands it the received
  rows, its expansion plan and the rows' weights (empty slots marked) in place of expansion -> MLP ->
  weighted sum: the same output and gradients (the kernel itself: tests/unit/test_mosaic_tokens.py), on a
  dropless buffer and on a bounded, aligned one (test_ragged_transport_uses_the_same_plan's settings: the
  reference runs are the same programs, compiled once)."""
  devices, local, top_k = 4, 4, 4
  ids = routing(np.random.default_rng(11), devices, local, top_k, "grouped", 4, 2)  # test_ragged_transport_...'s
  args = setup(devices, local, top_k, ids)
  calls = []
  out, stats, grads = ep_run(dedup, devices, local, top_k, ids, args, factor=factor, align=align, tokens_calls=calls)
  want = ep_run(dedup, devices, local, top_k, ids, args, factor=factor, align=align)
  assert calls and all(calls)  # called, with empty_choices=True
  assert_close((out, grads), (want[0], want[2]))
  np.testing.assert_array_equal(stats["real"], want[1]["real"])
  assert not np.asarray(stats["overflow"]).any()  # the bounded buffer holds this routing: nothing cut


def test_auto_picks_dedup_where_it_sends_fewer_rows():
  assert exchange.resolve("auto", 8, "gpu", top_k=8, local_experts=4) == "dedup"
  assert exchange.resolve("auto", 8, "cpu", top_k=8, local_experts=4) == "dedup"
  assert exchange.resolve("auto", 8, "gpu", top_k=1, local_experts=4) == "ragged"  # one expert a token
  assert exchange.resolve("auto", 8, "cpu", top_k=8, local_experts=1) == "padded"  # one expert a rank
  assert exchange.resolve("dedup", 1, "gpu", top_k=8, local_experts=4) == "local"
  assert dedup.transport("cpu") is padded and dedup.transport("gpu") is ragged
  with pytest.raises(ValueError, match="valid choices: auto, ragged, padded, dedup"):
    exchange.check_choice("nccl")
