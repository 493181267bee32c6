"""`temoe plan` on the hierarchical exchange (`te_moe_exchange=hier`): the step model prices its two hops, the
scale-out one at the NIC and the in-node one over NVLink, one after the other (checked by hand from the model's
own link constants on the shipped H100 x 1,024 preset), and the HBM model counts the exchange buffers
`hier.run` allocates (read from a traced call's collectives)."""

from __future__ import annotations

import dataclasses

import types

import jax
import jax.numpy as jnp
import pytest
from test_dedup_exchange import EMB, TOKENS, setup
from test_hier_exchange import routing

from conftest import ROOT
from temoe.moe import exchange
from temoe.moe.context import MoEContext
from temoe.moe.exchange import hier, padded, ragged
from temoe.tools import calibration, exchange_volume, hbm_activations, model_size, plan, step_model

H100_1024 = str(ROOT / "configs" / "deepseek3-671b-h100x1024.yml")


@pytest.fixture(scope="module")
def hier_plan():
  """The H100 x 1,024 preset as EP 64 over 8 nodes of 8 x FSDP 16, one sequence a GPU, with the hierarchical exchange
  unchunked, and its prediction without the overlap inside the layer (test_step_model prices that). A pricing case:
  FSDP x EP 1,024 does not split MLA's 512-wide dimension, so the sweep refuses it (test_shardings.py); the preset's
  own mesh is bound by the shared NIC at one sequence a GPU, where the overlap changes no step time."""
  p = plan.make_plan(H100_1024, ["te_moe_exchange=hier", "num_slices=128", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=16",
                                 "per_device_batch_size=1", "te_moe_chunks=1"], 1024, "h100")
  ici, dcn = plan.mesh_split(p.config, 1024)
  job = step_model.job_of(p.config, ici, dcn, 128, p.backend, p.quantization, p.estimate)
  calib = calibration.calibration_for("h100")
  job = dataclasses.replace(job, layer_overlap=False)
  return p, step_model.predict(job, calib, step_model.xla_flags_for(calib.gpu, {})[1])


def test_the_two_hops_are_priced_at_their_links_one_after_the_other(hier_plan):
  p, pred = hier_plan
  c, gpu = p.config, pred.gpu
  hops = [x for x in pred.collectives if x.name.startswith("expert all-to-all")]
  assert [x.name for x in hops] == ["expert all-to-all (hier) hop 1", "expert all-to-all (hier) hop 2"]
  assert [(x.link, x.ranks) for x in hops] == [("scale-out", 8), ("NVLink", 8)]  # 8 relays; a node's 8 ranks
  # By hand: DeepSeek-V3's router (4 of 8 groups, top-8 of 256) on EP 64 of 8-rank nodes; bf16 rows of 7168,
  # float32 weights and int32 expert ids in the slots (8 to a relay: a node holds 32 experts; 4 to a rank of 4)
  tokens, emb, layers = c.per_device_batch_size * c.max_target_length, c.emb_dim, model_size.layers(c).moe
  assert (tokens, emb, layers, c.te_moe_ep_node_size) == (4096, 7168, 58, 8) and pred.tokens == tokens
  nodes = exchange_volume.modelled_distinct_nodes(256, 8, 64, 8, 8, 4)
  ranks = exchange_volume.modelled_distinct_ranks(256, 8, 64, 8, 4)
  recompute = step_model.recomputed_share(c, step_model.placements_of(c))["gate_up"]  # the dispatch again

  def sent(rows, slots, gathered):  # one device, every MoE layer: dispatch and return, and their transposes
    forward = 2 * rows * emb * 2 + rows * slots * (4 + 4) + gathered
    return layers * (forward + 2 * rows * emb * 2 + rows * slots * 4 + recompute * forward / 2)

  hop1 = sent(tokens * nodes, 8, 64 * 64 * (3 + 2) * 4) * 7 / 8  # the relay on my own node is me
  hop2 = sent(tokens * ranks, 4, 0) * 7 / 8  # the relay's rows to itself stay
  nic = gpu.scale_out_gbps * 1e9 * step_model.LINK_EFFICIENCY["scale_out"]
  nvlink = gpu.nvlink_gbps * 1e9 * step_model.LINK_EFFICIENCY["nvlink_all_to_all"]
  assert hops[0].bytes == pytest.approx(hop1) and hops[0].seconds == pytest.approx(hop1 / nic)
  assert hops[1].bytes == pytest.approx(hop2) and hops[1].seconds == pytest.approx(hop2 / nvlink)
  assert all(x.exposed == x.seconds for x in hops)  # each MoE layer waits for its rows: both hops add up
  assert pred.step_seconds == pytest.approx(pred.compute + sum(x.exposed for x in pred.collectives))


def test_plan_prints_the_rows_of_each_hop_and_the_step(hier_plan):
  p, pred = hier_plan
  out = "\n".join(plan.step_lines(p))
  nodes = exchange_volume.modelled_distinct_nodes(256, 8, 64, 8, 8, 4)
  ranks = exchange_volume.modelled_distinct_ranks(256, 8, 64, 8, 4)
  assert "expert all-to-all (hier) hop 1 [scale-out, 8 ranks]" in out
  assert f"{4096 * nodes:,.0f} rows a dispatch to the relays (one a node), {4096 * nodes * 7 / 8:,.0f} of them leave" in out
  assert "expert all-to-all (hier) hop 2 [NVLink, 8 ranks]" in out
  assert f"{4096 * ranks:,.0f} rows a dispatch from the relays to their node's ranks" in out
  ici, dcn = plan.mesh_split(p.config, 1024)
  job = step_model.job_of(p.config, ici, dcn, 128, p.backend, p.quantization, p.estimate)
  calib = calibration.calibration_for("h100")
  overlapped = step_model.predict(job, calib, step_model.xla_flags_for(calib.gpu, {})[1])  # as temoe plan prices it
  assert overlapped.step_seconds < pred.step_seconds and "assumed hidden behind the shared expert" in out
  assert (f"{overlapped.step_seconds * 1e3:.1f} ms  {overlapped.tokens_per_s:,.0f} tokens/s/GPU, "
          f"{overlapped.tflops:,.0f} TFLOP/s/GPU") in out


def traced_rows(monkeypatch, moves, devices, node, local, top_k, factor):
  """Rows of every emb-wide buffer hier.run hands its collectives (sent and received, the dispatch and the
  combine), from an abstract trace of one forward on a named vmap axis (nothing compiled)."""
  rows = []
  if moves is ragged:
    def record(operand, output, *args, **kw):
      del args, kw
      rows.extend(a.shape[0] for a in (operand, output) if a.shape[-1] == EMB and a.dtype == jnp.float32)
      return output
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", record)
  else:
    original = jax.lax.all_to_all

    def record(x, *args, **kw):
      y = original(x, *args, **kw)
      rows.extend(a.size // EMB for a in (x, y) if a.shape[-1] == EMB and a.dtype == jnp.float32)
      return y
    monkeypatch.setattr(jax.lax, "all_to_all", record)
  ids = routing(3, devices, local, top_k, "skewed")
  x, w, *_ = setup(devices, local, top_k, ids)
  ctx = MoEContext(num_experts=devices * local, top_k=top_k, dtype=jnp.float32, ep_axis="ep", ep_size=devices,
                   ep_node_size=node, buffer_factor=factor)

  def per_device(x, ids, w):  # the expert MLP as the identity: the buffers do not depend on it
    return hier.run(ctx, x, ids, w, lambda buf, plan: buf, moves=moves)[0]

  jax.eval_shape(jax.vmap(per_device, axis_name="ep"), x, ids, w)
  return rows


@pytest.mark.parametrize("moves", [ragged, padded], ids=["gpu", "cpu"])
@pytest.mark.parametrize("devices,node,local,top_k,factor", [(4, 2, 4, 4, 2.0), (4, 2, 4, 4, 0.0), (8, 4, 2, 3, 1.5)])
def test_the_hbm_count_is_hier_runs_buffers(monkeypatch, moves, devices, node, local, top_k, factor):
  rows = traced_rows(monkeypatch, moves, devices, node, local, top_k, factor)
  assert len(rows) == 8  # two hops there and back, a send and a receive buffer each
  config = types.SimpleNamespace(num_experts_per_tok=top_k, num_experts=devices * local, te_moe_exchange="hier",
                                 te_moe_ep_node_size=node, ragged_buffer_factor=factor)
  shapes = hbm_activations.Shapes(tokens=TOKENS, batch=1, seq=TOKENS, emb=EMB, tp=1, ep=devices, act=4)
  platform = "gpu" if moves is ragged else "cpu"
  assert hbm_activations.exchange_bytes(config, shapes, platform) == sum(rows) * EMB * 4
  capacity = exchange.receive_capacity(TOKENS * top_k, devices, factor)
  send1, relay, send2, receive = hbm_activations.hier_rows(TOKENS, top_k, devices, local, node, capacity, platform)
  assert rows[:4] == [send1, relay, send2, receive]  # the dispatch, in order
  if moves is ragged:  # the brief's shapes: a token once per node, the relay's capacity, a relayed row per rank
    nodes = devices // node
    assert (send1, relay) == (TOKENS * min(top_k, nodes), min(capacity, send1 * nodes))
    assert (send2, receive) == (min(capacity, relay * min(top_k, node)), min(capacity, send2 * node))


@pytest.mark.parametrize("moves", [ragged, padded], ids=["gpu", "cpu"])
def test_the_in_node_hop_sends_at_most_the_relays_pair_capacity(monkeypatch, moves):
  """Every hop-2 row carries a (token, expert) pair and a relay receives at most `capacity` of them, so the
  relay's send buffer holds min(capacity, relayed rows x ranks a row may reach) rows, not the latter."""
  devices, node, local, top_k, factor = 8, 4, 2, 3, 1.5
  rows = traced_rows(monkeypatch, moves, devices, node, local, top_k, factor)
  capacity = exchange.receive_capacity(TOKENS * top_k, devices, factor)
  senders = devices if moves is padded else 1  # the padded transport keeps a slot per device of the axis
  relayed = rows[1] // senders  # the relay's receive buffer: hop 2's input rows
  uncapped = relayed * min(top_k, node)
  assert capacity < uncapped  # the shape where the cap matters
  assert rows[2] == min(capacity, uncapped) * senders
