"""The hierarchical exchange through temoe's block under a real `shard_map` on 8 host devices (one
subprocess): EP 2 x FSDP 4 (nodes of one rank), EP 4 x FSDP 2 (2 nodes of 2) and EP 8 (2 nodes of 4),
routing skewed to the first node's experts with every third expert unused, forward and every gradient
against the row-per-pair exchange and the one-device block, float32; on EP 8 also in 2 token chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TOL = 1e-5
MESHES = ((4, 2, 1, 1), (2, 4, 2, 1), (1, 8, 4, 2))  # (fsdp, expert, ranks per node, chunks)


def compare() -> list[dict]:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from temoe.moe import block  # pylint: disable=import-outside-toplevel
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

  def run(ctx):
    def loss(x, w, wi, wo):
      out, stats = block.apply(ctx, x, ids, w, wi, wo)
      return jnp.sum(out * cot), (out, stats)
    (_, (out, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w, wi, wo)
    return out, grads, stats

  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

  base = {"num_experts": experts, "top_k": top_k, "dtype": jnp.float32}
  ref_out, ref_grads, _ = run(MoEContext(**base))
  reports = []
  for fsdp, ep, node, chunks in MESHES:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(fsdp, ep), ("fsdp", "expert"))
    common = {**base, "mesh": mesh, "token_spec": P(("fsdp", "expert")), "ep_axis": "expert", "ep_size": ep}
    h_out, h_grads, h_stats = run(MoEContext(**common, exchange="hier", ep_node_size=node, chunks=chunks))
    p_out, p_grads, p_stats = run(MoEContext(**common, exchange="padded"))
    reports.append({
        "mesh": [fsdp, ep, node, chunks],
        "vs_one_device": [rel(h_out, ref_out)] + [rel(a, b) for a, b in zip(h_grads, ref_grads)],
        "vs_row_per_pair": [rel(h_out, p_out)] + [rel(a, b) for a, b in zip(h_grads, p_grads)],
        "received": [int(h_stats["received"]), int(p_stats["received"])],
        "overflow": bool(h_stats["overflow"]),
    })
  return reports


def test_hier_on_8_host_devices_matches_row_per_pair_and_one_device():
  from conftest import HANG_S  # pylint: disable=import-outside-toplevel  (this file also runs as a script)
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=HANG_S)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("HIER ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  reports = json.loads(lines[0][5:])
  assert [r["mesh"] for r in reports] == [list(m) for m in MESHES]
  for r in reports:
    assert max(r["vs_one_device"]) < TOL and max(r["vs_row_per_pair"]) < TOL, r
    assert r["received"][0] == r["received"][1] and not r["overflow"], r


if __name__ == "__main__":
  print("HIER " + json.dumps(compare()), flush=True)
