"""The hierarchical exchange through temoe's block under a real `shard_map` on 8 host devices (one
subprocess): EP 2 x FSDP 4 (nodes of one rank), EP 4 x FSDP 2 (2 nodes of 2) and EP 8 (2 nodes of 4),
routing skewed to the first node's experts with every third expert unused, forward and every gradient
against the row-per-pair exchange and the one-device block, float32; on EP 8 also in 2 token chunks."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, when this file runs as a script
import host_mesh  # noqa: E402  # pylint: disable=wrong-import-position

TOL = 1e-5
MESHES = ((4, 2, 1, 1), (2, 4, 2, 1), (1, 8, 4, 2))  # (fsdp, expert, ranks per node, chunks)


def compare() -> list[dict]:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from temoe.moe.context import MoEContext  # pylint: disable=import-outside-toplevel

  experts, top_k, emb, ffn, batch, seq = 16, 4, 8, 4, 8, 8
  rng = np.random.default_rng(0)
  pool = np.array([e for e in range(experts) if e % 3])  # experts 0, 3, 6, ... get no tokens
  p = np.where(pool < experts // 2, 6.0, 1.0)
  ids = np.stack([rng.choice(pool, top_k, replace=False, p=p / p.sum()) for _ in range(batch * seq)])
  ids = jnp.asarray(ids.reshape(batch, seq, top_k), jnp.int32)
  x = jnp.asarray(rng.standard_normal((batch, seq, emb)), jnp.float32)
  w = jnp.asarray(rng.random((batch, seq, top_k)), jnp.float32)
  wi = jnp.asarray(rng.standard_normal((experts, emb, 2 * ffn)) * 0.3, jnp.float32)
  wo = jnp.asarray(rng.standard_normal((experts, ffn, emb)) * 0.3, jnp.float32)
  cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  run = host_mesh.block_runner(ids, x, w, wi, wo, cot)
  base = {"num_experts": experts, "top_k": top_k, "dtype": jnp.float32}
  reference = run(MoEContext(**base))
  reports = []
  for fsdp, ep, node, chunks in MESHES:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(fsdp, ep), ("fsdp", "expert"))
    common = {**base, "mesh": mesh, "token_spec": P(("fsdp", "expert")), "ep_axis": "expert", "ep_size": ep}
    hier = run(MoEContext(**common, exchange="hier", ep_node_size=node, chunks=chunks))
    row_per_pair = run(MoEContext(**common, exchange="padded"))
    reports.append({"mesh": [fsdp, ep, node, chunks], **host_mesh.versus(hier, reference, row_per_pair)})
  return reports


def test_hier_on_8_host_devices_matches_row_per_pair_and_one_device():
  reports = host_mesh.run_script(__file__, "HIER", 8)
  assert [r["mesh"] for r in reports] == [list(m) for m in MESHES]
  host_mesh.check_versus(reports, TOL)


if __name__ == "__main__":
  host_mesh.report("HIER", compare())
