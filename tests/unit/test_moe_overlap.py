"""Overlap inside the MoE layer, on CPU: the routed experts in token chunks give the unchunked layer's
numbers (forward and gradients, float32), and the compiled program leaves XLA's scheduler free to overlap
(`temoe.tools.overlap`): no chunk's exchange depends on another chunk's expert GEMMs, and a shared expert
computed beside the block (as MaxText's RoutedAndSharedMoE does) depends on none of the exchange's
all-to-alls, nor they on it; on 4 host devices (one subprocess), dedup and hier (2 nodes of 2)."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from temoe.moe import block
from temoe.moe.context import MoEContext
from temoe.tools import overlap

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, when this file runs as a script
import host_mesh  # noqa: E402  # pylint: disable=wrong-import-position

TOL = 1e-5


def problem(seed=0, experts=8, top_k=2, emb=8, ffn=4, batch=4, seq=8):
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.integers(0, experts, (batch, seq, top_k)), jnp.int32)
  x = jnp.asarray(rng.standard_normal((batch, seq, emb)), jnp.float32)
  w = jnp.asarray(rng.random((batch, seq, top_k)), jnp.float32)
  wi = jnp.asarray(rng.standard_normal((experts, emb, 2 * ffn)) * 0.3, jnp.float32)
  wo = jnp.asarray(rng.standard_normal((experts, ffn, emb)) * 0.3, jnp.float32)
  ws = jnp.asarray(rng.standard_normal((emb, 2 * ffn)) * 0.3, jnp.float32)
  cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  return ids, (x, w, wi, wo, ws), cot


def layer(ctx, ids, cot):
  """The loss of a DeepSeek-like MoE layer: temoe's routed block plus a shared expert beside it."""

  def loss(x, w, wi, wo, ws):
    out, _ = block.apply(ctx, x, ids, w, wi, wo)
    with jax.named_scope("shared_expert"):
      shared = jax.nn.silu(x @ ws) @ ws.T
    return jnp.sum((out + shared) * cot)

  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_chunks_give_the_unchunked_layer_on_one_device():
  ids, args, cot = problem()
  base = {"num_experts": 8, "top_k": 2, "dtype": jnp.float32}
  want = jax.jit(layer(MoEContext(**base), ids, cot), compiler_options=host_mesh.FAST_COMPILE)(*args)
  for chunks in (2, 4):
    got = jax.jit(layer(MoEContext(**base, chunks=chunks), ids, cot), compiler_options=host_mesh.FAST_COMPILE)(*args)
    assert rel(got[0], want[0]) < TOL and all(rel(g, r) < TOL for g, r in zip(got[1], want[1])), chunks


def test_chunks_that_do_not_divide_the_tokens_are_refused_before_compiling():
  ids, args, cot = problem()
  with pytest.raises(ValueError, match=r"te_moe_chunks=3 does not divide the 32 tokens .* choose one of 1, 2, 4, 8"):
    jax.jit(layer(MoEContext(num_experts=8, top_k=2, dtype=jnp.float32, chunks=3), ids, cot)).lower(*args)


SCHEDULED = """HloModule m, is_scheduled=true

%fused_gemm (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[8,8], b: bf16[8,8]) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %start = ((bf16[8,8]{1,0}), bf16[8,8]{1,0}) all-to-all-start(%a), metadata={op_name="x/temoe_chunk1/temoe_dispatch/a"}
  %g0 = bf16[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_gemm, metadata={op_name="x/temoe_chunk0/temoe_experts/d"}
  %done = bf16[8,8]{1,0} all-to-all-done(%start)
  %g1 = bf16[8,8]{1,0} fusion(%done, %b), kind=kCustom, calls=%fused_gemm, metadata={op_name="x/temoe_chunk1/temoe_experts/d"}
  ROOT %out = bf16[8,8]{1,0} add(%g0, %g1)
}
"""


def test_the_schedule_reader_finds_the_gemms_between_an_async_start_and_its_done():
  """What the GPU check reads from a scheduled module (a GPU's compiled HLO through the one-rank bench)."""
  module = overlap.parse(SCHEDULED)
  assert module.entry == "main" and [i.name for i in module.computations["fused_gemm"]] == ["p0", "p1", "dot.1"]
  assert overlap.between(module, lambda i: i.opcode == "all-to-all-start",
                         lambda i: overlap.gemm(module, i)) == {"start": ["g0"]}
  exchange = lambda i: i.opcode == "all-to-all-start"  # noqa: E731
  assert overlap.dependent(module, exchange, lambda i: i.name == "g0") == []
  assert overlap.dependent(module, exchange, lambda i: i.name == "g1") == [("start", "g1")]


def analyse() -> dict:
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  ids, args, cot = problem()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))
  common = {"num_experts": 8, "top_k": 2, "dtype": jnp.float32, "mesh": mesh, "token_spec": P("expert"),
            "ep_axis": "expert", "ep_size": 4}
  report = {}
  for name, extra in (("dedup", {"exchange": "dedup"}), ("hier", {"exchange": "hier", "ep_node_size": 2})):
    want = jax.jit(layer(MoEContext(**common, **extra), ids, cot), compiler_options=host_mesh.FAST_COMPILE)(*args)
    step = jax.jit(layer(MoEContext(**common, **extra, chunks=2), ids, cot), compiler_options=host_mesh.FAST_COMPILE)
    got = step(*args)
    module = overlap.parse(step.lower(*args).compile().as_text())

    def a2a(c, module=module):
      return lambda i: i.opcode in ("all-to-all", "ragged-all-to-all") and f"temoe_chunk{c}/" in i.op_name

    def gemms(c, module=module):
      return lambda i: f"temoe_chunk{c}/" in i.op_name and overlap.gemm(module, i)

    def shared(i, module=module):
      return "shared_expert" in i.op_name and overlap.gemm(module, i)

    def any_a2a(i):
      return i.opcode in ("all-to-all", "ragged-all-to-all") and "temoe_" in i.op_name

    entry = module.computations[module.entry]
    report[name] = {
        "rel_chunked": [rel(got[0], want[0])] + [rel(g, r) for g, r in zip(got[1], want[1])],
        "counts": [sum(map(p, entry)) for p in (a2a(0), a2a(1), gemms(0), gemms(1), shared)],
        "chunk1_exchange_vs_chunk0_gemms": overlap.dependent(module, a2a(1), gemms(0)),
        "chunk0_exchange_vs_chunk1_gemms": overlap.dependent(module, a2a(0), gemms(1)),
        "shared_vs_exchange": overlap.dependent(module, shared, any_a2a),
        "chunk0_exchange_feeds_its_gemms": len(overlap.dependent(module, a2a(0), gemms(0))),
    }
  return report


def test_compiled_layer_leaves_the_exchange_free_to_overlap_the_gemms():
  result = host_mesh.run_script(__file__, "OVERLAP", 4)
  for name, r in result.items():
    assert max(r["rel_chunked"]) < TOL, (name, r)
    assert min(r["counts"]) > 0, (name, r)  # both chunks' all-to-alls and GEMMs, and the shared expert's, found
    assert r["chunk0_exchange_feeds_its_gemms"] > 0, (name, r)  # the analysis sees a dependence where one is
    assert r["chunk1_exchange_vs_chunk0_gemms"] == [] and r["chunk0_exchange_vs_chunk1_gemms"] == [], (name, r)
    assert r["shared_vs_exchange"] == [], (name, r)


if __name__ == "__main__":
  host_mesh.report("OVERLAP", analyse())
