"""The deduplicating exchange through temoe's block under a real `shard_map` on 8 host devices
(one subprocess): EP 8, EP 4 x FSDP 2 and EP 2 x FSDP 4, DeepSeek-V3-style group-limited routing
(top-8 of 32 experts, 4 of 8 groups: one group per rank on EP 8), forward and every gradient against
the row-per-pair exchange and the one-device block, float32."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, when this file runs as a script
import host_mesh  # noqa: E402  # pylint: disable=wrong-import-position

TOL = 1e-5
MESHES = ((1, 8), (2, 4), (4, 2))  # (fsdp, expert)


def compare() -> list[dict]:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from temoe.moe.context import MoEContext  # pylint: disable=import-outside-toplevel

  experts, top_k, groups, topk_group, emb, ffn = 32, 8, 8, 4, 16, 8
  rng = np.random.default_rng(0)
  batch, seq = 8, 16
  ids = np.zeros((batch, seq, top_k), np.int32)
  for b in range(batch):
    for s in range(seq):
      chosen = rng.choice(groups, topk_group, replace=False)
      pool = np.concatenate([np.arange(g * 4, g * 4 + 4) for g in chosen])
      ids[b, s] = rng.choice(pool, top_k, replace=False)
  ids = jnp.asarray(ids)
  x = jnp.asarray(rng.standard_normal((batch, seq, emb)), jnp.float32)
  w = jnp.asarray(rng.random((batch, seq, top_k)), jnp.float32)
  wi = jnp.asarray(rng.standard_normal((experts, emb, 2 * ffn)) * 0.3, jnp.float32)
  wo = jnp.asarray(rng.standard_normal((experts, ffn, emb)) * 0.3, jnp.float32)
  cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  run = host_mesh.block_runner(ids, x, w, wi, wo, cot)
  base = {"num_experts": experts, "top_k": top_k, "dtype": jnp.float32}
  reference = run(MoEContext(**base))
  reports = []
  for fsdp, ep in MESHES:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(fsdp, ep), ("fsdp", "expert"))
    common = {**base, "mesh": mesh, "token_spec": P(("fsdp", "expert")), "ep_axis": "expert", "ep_size": ep}
    dedup = run(MoEContext(**common, exchange="dedup"))
    row_per_pair = run(MoEContext(**common, exchange="padded"))
    reports.append({"mesh": [fsdp, ep], **host_mesh.versus(dedup, reference, row_per_pair)})
  return reports


def test_dedup_on_8_host_devices_matches_row_per_pair_and_one_device():
  reports = host_mesh.run_script(__file__, "DEDUP", 8)
  assert [r["mesh"] for r in reports] == [list(m) for m in MESHES]
  host_mesh.check_versus(reports, TOL)


if __name__ == "__main__":
  host_mesh.report("DEDUP", compare())
