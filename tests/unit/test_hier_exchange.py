"""The hierarchical exchange (`te_moe_exchange=hier`) on a named vmap axis standing in for the expert mesh
axis (one process, the same collectives): rows per hop against a numpy count, and forward and every
gradient against the row-per-pair exchange and the one-device block, float32, fixed seeds: group-limited
routing, skew, experts nobody routes to, an idle node, one rank per node, bounded buffers, and the GPU
transport (`ragged_all_to_all`) on the reference model of its semantics."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_cache import persistent_cache
from test_dedup_exchange import (EMB, TOKENS, assert_close, ep_run, one_device,
                                 reference_ragged_all_to_all, setup)

from temoe.moe import exchange
from temoe.moe.exchange import hier, padded, ragged
from temoe.tools import exchange_volume


def routing(seed, devices, local, top_k, kind):
  """(devices, tokens, top_k) ids: grouped (DeepSeek-V3-like: 4 of 8 groups), skewed (node 0 hot),
  empty_experts (every third expert unused), idle_node (node 1's experts unused; nodes of 2 ranks)."""
  rng = np.random.default_rng(seed)
  experts = devices * local
  ids = np.zeros((devices, TOKENS, top_k), np.int64)
  for d in range(devices):
    for t in range(TOKENS):
      pool, p = np.arange(experts), None
      if kind == "grouped":
        size = experts // 8
        pool = np.concatenate([np.arange(g * size, (g + 1) * size) for g in rng.choice(8, 4, replace=False)])
      elif kind == "skewed":
        p = np.where(pool < experts // 4, 20.0, 1.0)
        p /= p.sum()
      elif kind == "empty_experts":
        pool = pool[pool % 3 != 0]
      elif kind == "idle_node":
        pool = pool[pool // (2 * local) != 1]
      ids[d, t] = rng.choice(pool, top_k, replace=False, p=p)
  return jnp.asarray(ids, jnp.int32)


@pytest.fixture(scope="module", autouse=True)
def _compile_cache():
  """A program compiled before in the session (the same HLO) is loaded, not compiled again (compile_cache)."""
  with persistent_cache():
    yield


def hier_run(devices, node, local, top_k, ids, args, factor=0.0, align=1, strategy=hier, **kw):
  """ep_run with nodes of `node` ranks (the hierarchical exchange by default)."""
  return ep_run(strategy, devices, local, top_k, ids, args, factor=factor, align=align,
                context={"ep_node_size": node}, **kw)


def hop_plan(devices, node, local, capacity):
  """One device's (hop 1, hop 2) rows to each device from its expert ids, as the plan and the padded transport give
  them: an ep_run probe."""

  def plan(ids):
    rp1, ex1, _ = hier.hop1(ids, local, node, devices, "ep", capacity)
    relayed = padded.send(rp1.local_ids, ex1, capacity, "ep", devices)
    _, ex2 = hier.hop2(relayed, local, node, devices, "ep", capacity)
    return ex1.send_sizes, ex2.send_sizes

  return plan


def distinct(ids, blocks, per):
  """(devices, blocks): each device's distinct (token, block of `per` experts) pairs per block."""
  ids = np.asarray(ids)
  out = np.zeros((ids.shape[0], blocks), np.int64)
  for d in range(ids.shape[0]):
    for t in range(ids.shape[1]):
      for b in set((ids[d, t] // per).tolist()):
        out[d, b] += 1
  return out


CASES = {  # name: (devices, ranks per node, local experts, top_k, routing, also against row-per-pair)
    "ep8_node4_deepseek_groups": (8, 4, 4, 8, "grouped", False),  # row-per-pair on EP 8: test_hier_mesh.py
    "ep4_node2_skewed": (4, 2, 3, 4, "skewed", True),
    "ep4_node2_empty_experts": (4, 2, 4, 3, "empty_experts", False),
    "ep8_node2_idle_node": (8, 2, 2, 4, "idle_node", False),
    "ep4_node1_top2": (4, 1, 2, 2, "skewed", False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hier_matches_row_per_pair_and_one_device(case):
  devices, node, local, top_k, kind, against_pairs = CASES[case]
  ids = routing(len(case), devices, local, top_k, kind)
  args = setup(devices, local, top_k, ids, seed=len(case))
  capacity = exchange.receive_capacity(TOKENS * top_k, devices, 0.0)
  out, stats, grads = hier_run(devices, node, local, top_k, ids, args, probe=hop_plan(devices, node, local, capacity))
  assert_close((out, grads), one_device(devices, local, top_k, ids, args))
  pairs = np.stack([np.bincount(np.asarray(ids[d]).ravel() // local, minlength=devices) for d in range(devices)])
  np.testing.assert_array_equal(stats["received"], pairs.sum(0))
  assert not np.asarray(stats["overflow"]).any()
  if against_pairs:  # each EP compile costs seconds on XLA:CPU
    p_out, p_stats, p_grads = hier_run(devices, node, local, top_k, ids, args, strategy=padded)
    assert_close((out, grads), (p_out, p_grads))
    np.testing.assert_array_equal(stats["real"], p_stats["real"])  # the same pairs at the GEMMs
    np.testing.assert_array_equal(stats["received"], p_stats["received"])
  # Rows per hop: hop 1 carries each token once per destination node, to the relay of the sender's local
  # index there; hop 2 once per (token, rank): in all, the distinct (token, rank) pairs.
  one, two = (np.asarray(a) for a in stats["probe"])
  nodes = distinct(ids, devices // node, node * local)
  want = np.zeros((devices, devices), np.int64)
  for src in range(devices):
    want[src, np.arange(devices // node) * node + src % node] = nodes[src]
  np.testing.assert_array_equal(one, want)
  np.testing.assert_array_equal(two.sum(0), distinct(ids, devices, local).sum(0))
  for src in range(devices):  # the in-node hop stays in the node
    assert (two[src][np.arange(devices) // node != src // node] == 0).all()
  # The volume model, given the measured routing statistics, counts the same rows per dispatch.
  v = exchange_volume.layer_volume("hier", TOKENS, EMB, top_k, devices, local,
                                   exchange_volume.measured_distinct_ranks(ids, local), node_size=node,
                                   distinct_nodes=exchange_volume.measured_distinct_ranks(ids, node * local))
  assert v.rows_forward / 2 * devices == pytest.approx(one.sum() + two.sum())
  assert (v.rows_scale_out + v.rows_in_node) * devices == pytest.approx(one.sum() + two.sum())
  if kind == "idle_node":
    assert int(stats["received"][2]) == int(stats["received"][3]) == 0 and one[:, 2:4].sum() == 0


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_bounded_buffers_overflow_when_row_per_pair_does_and_stay_finite(factor):
  devices, node, local, top_k = 4, 2, 4, 4
  ids = routing(7, devices, local, top_k, "skewed")
  args = setup(devices, local, top_k, ids)
  _, stats, grads = hier_run(devices, node, local, top_k, ids, args, factor=factor)
  _, p_stats, _ = hier_run(devices, node, local, top_k, ids, args, factor=factor, strategy=padded, grads=False)
  capacity = exchange.receive_capacity(TOKENS * top_k, devices, factor)
  np.testing.assert_array_equal(stats["received"], p_stats["received"])
  assert bool(np.asarray(p_stats["overflow"]).any()) == (factor == 1.0)  # the hot node overflows a 1x buffer
  assert bool(np.asarray(stats["overflow"]).any()) == (factor == 1.0)
  assert (np.asarray(stats["real"]) <= capacity).all()
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


# 1.5 (72 pairs): the in-node hop's send buffer capped at 72 rows, below its 48 relayed rows x 2 ranks
@pytest.mark.parametrize("factor,kind", [(4.0, "skewed"), (1.5, "empty_experts")])
def test_ragged_transport_uses_the_same_plan(monkeypatch, factor, kind):
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", reference_ragged_all_to_all)
  devices, node, local, top_k = 4, 2, 4, 4
  ids = routing(11, devices, local, top_k, kind)
  args = setup(devices, local, top_k, ids)
  out, stats, grads = hier_run(devices, node, local, top_k, ids, args, factor=factor, align=4, moves=ragged)
  assert not np.asarray(stats["overflow"]).any() and (np.asarray(stats["padded"]) % 4 == 0).all()
  assert_close((out, grads), one_device(devices, local, top_k, ids, args))


def test_hier_resolves_and_refuses_a_node_size_that_does_not_divide_the_axis():
  assert exchange.resolve("hier", 64, "gpu", top_k=8, local_experts=4, node_size=8) == "hier"
  assert exchange.resolve("hier", 8, "gpu", top_k=8, local_experts=4, node_size=8) == "dedup"  # one node
  assert exchange.resolve("hier", 1, "gpu", node_size=8) == "local"
  with pytest.raises(ValueError, match="te_moe_ep_node_size=8 does not divide the expert axis .12 ranks"):
    exchange.resolve("hier", 12, "gpu", top_k=8, local_experts=4, node_size=8)
  with pytest.raises(ValueError, match="te_moe_ep_node_size=0: ranks per node"):
    exchange.check_node_size(0)
  with pytest.raises(ValueError, match="valid choices: auto, ragged, padded, dedup, hier"):
    exchange.check_choice("deepep")


def test_deepseek_v3_on_ep_64_crosses_nodes_at_most_four_times_a_token():
  """DeepSeek-V3 (256 experts, top-8 of 4 of 8 groups) on EP 64 of 8-rank nodes: a group's 32 experts fill one
  node, so hier sends a token over the scale-out hop to at most its 4 groups' nodes, one of them its own."""
  experts, top_k, ep, node, tokens = 256, 8, 64, 8, 4096
  ranks = exchange_volume.modelled_distinct_ranks(experts, top_k, ep, 8, 4)
  nodes = exchange_volume.modelled_distinct_nodes(experts, top_k, ep, node, 8, 4)
  v = {s: exchange_volume.layer_volume(s, tokens, 7168, top_k, ep, experts // ep, ranks, node_size=node,
                                       distinct_nodes=nodes) for s in ("ragged", "dedup", "hier")}
  assert nodes <= 4 and v["hier"].rows_scale_out == pytest.approx(tokens * nodes * 7 / 8)
  assert v["hier"].rows_scale_out < 0.5 * v["dedup"].rows_scale_out < 0.5 * v["ragged"].rows_scale_out
  assert v["hier"].rows_in_node > v["dedup"].rows_in_node  # the price: the relays' fan-out over NVLink
