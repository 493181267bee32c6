"""The row-per-pair expert-parallel exchange plan against a numpy model, on a named vmap axis
standing in for the expert mesh axis (the same collectives, one process, no devices needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from temoe.moe import exchange
from temoe.moe.exchange import padded
from temoe.moe.exchange import plan as exchange_plan

DEVICES, LOCAL = 4, 3


def model(counts: np.ndarray, capacity: int) -> dict[str, np.ndarray]:
  """counts[src, expert]: rows device src routes to each global expert. Receivers take senders in
  device order until their buffer is full."""
  per_dst = counts.reshape(DEVICES, DEVICES, LOCAL)  # [src, dst, local expert]
  wanted = per_dst.sum(-1)
  sent = np.zeros_like(wanted)
  kept = np.zeros_like(per_dst)
  for dst in range(DEVICES):
    room = capacity
    for src in range(DEVICES):
      sent[src, dst] = min(wanted[src, dst], room)
      room -= sent[src, dst]
      left = sent[src, dst]
      for e in range(LOCAL):
        kept[src, dst, e] = min(per_dst[src, dst, e], left)
        left -= kept[src, dst, e]
  return {"wanted": wanted, "sent": sent, "kept": kept}


def planned(counts: np.ndarray, capacity: int):
  fn = jax.vmap(lambda g: exchange_plan.plan_exchange(g, "ep", DEVICES, capacity), axis_name="ep")
  return fn(jnp.asarray(counts, jnp.int32))


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
@pytest.mark.parametrize("kind", ["random", "skewed", "one_receiver_empty"])
def test_plan_matches_the_model(kind, capacity_factor):
  rng = np.random.default_rng(3)
  counts = rng.integers(0, 9, (DEVICES, DEVICES * LOCAL))
  if kind == "skewed":
    counts[:, :LOCAL] *= 6  # device 0's experts are hot
  if kind == "one_receiver_empty":
    counts[:, 2 * LOCAL:3 * LOCAL] = 0  # nobody routes to device 2
  routed = int(counts.sum(1).max())
  capacity = exchange.receive_capacity(routed, DEVICES, capacity_factor or 0.0)
  m = model(counts, capacity)
  ex = planned(counts, capacity)
  np.testing.assert_array_equal(ex.send_sizes, m["sent"])
  np.testing.assert_array_equal(ex.recv_sizes, m["sent"].T)
  np.testing.assert_array_equal(ex.received, m["wanted"].sum(0))
  np.testing.assert_array_equal(ex.local_counts, m["kept"].transpose(1, 0, 2))
  np.testing.assert_array_equal(ex.send_offsets, np.cumsum(m["wanted"], 1) - m["wanted"])
  landing = np.cumsum(m["sent"], 0) - m["sent"]
  np.testing.assert_array_equal(ex.out_offsets, landing)
  assert (m["sent"].sum(0) <= capacity).all()
  assert bool(ex.overflow[0]) == bool((m["sent"] != m["wanted"]).any())
  if capacity_factor is None:  # worst-case buffers: dropless
    assert not bool(ex.overflow[0])


def test_padded_transport_round_trips_every_sent_row():
  rng = np.random.default_rng(5)
  rows_per_device = 10
  experts = rng.integers(0, DEVICES * LOCAL, (DEVICES, rows_per_device))
  experts.sort(axis=1)  # rows arrive expert-sorted, as dispatch leaves them
  counts = np.stack([np.bincount(e, minlength=DEVICES * LOCAL) for e in experts])
  rows = jnp.asarray(rng.standard_normal((DEVICES, rows_per_device, 2)), jnp.float32)
  capacity = exchange.receive_capacity(rows_per_device, DEVICES, 0.0)

  def there_and_back(group_sizes, r):
    ex = exchange_plan.plan_exchange(group_sizes, "ep", DEVICES, capacity)
    buf = padded.send(r, ex, capacity, "ep", DEVICES)
    ids = padded.local_expert_ids(ex, capacity, rows_per_device)
    return padded.receive_back(buf, ex, rows_per_device, "ep", DEVICES), ids

  back, ids = jax.vmap(there_and_back, axis_name="ep")(jnp.asarray(counts, jnp.int32), rows)
  np.testing.assert_array_equal(back, rows)  # dropless: every row returns to where it came from
  for dst in range(DEVICES):  # each device's buffer holds exactly its experts' rows
    got = np.sort(np.asarray(ids[dst])[np.asarray(ids[dst]) < LOCAL])
    want = np.sort(experts[(experts // LOCAL) == dst] % LOCAL)
    np.testing.assert_array_equal(got, want)


def test_resolve_and_capacity():
  assert exchange.resolve("auto", 1, "gpu") == "local"
  assert exchange.resolve("auto", 8, "cpu") == "padded" and exchange.resolve("auto", 8, "gpu") == "ragged"
  with pytest.raises(ValueError, match="valid choices"):
    exchange.resolve("nccl", 8, "gpu")
  assert exchange.receive_capacity(100, 8, 0.0) == 800 and exchange.receive_capacity(100, 8, 1.5) == 150
