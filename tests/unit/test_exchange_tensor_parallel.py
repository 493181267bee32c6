"""temoe's block under MaxText's tensor parallelism: the DeepSeek-V3 layer with its shared expert and a
skewed routing, on 4 host devices (one subprocess) as TP 2 x EP 2 with the hierarchical exchange (a node
of one rank) in 2 token chunks, against MaxText's native dropless MoE as TP 2 x FSDP 2 (its expert-parallel
path does not run on XLA:CPU): forward, input gradient and every parameter's gradient within 1e-5."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_parity import check
from conftest import HANG_S

TEMOE = ("ici_tensor_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=1", "te_moe_exchange=hier",
         "te_moe_ep_node_size=1", "te_moe_chunks=2")
NATIVE = ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=2")


def test_block_under_tensor_parallelism_matches_native_moe():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
  here = os.path.dirname(os.path.dirname(__file__))  # tests/, where parity_check.py lives
  proc = subprocess.run([sys.executable, os.path.join(here, "parity_check.py"), "deepseek3_shared_skewed", *TEMOE,
                         "--native", *NATIVE], capture_output=True, text=True, env=env, cwd=here, timeout=HANG_S)
  reports = [json.loads(l.removeprefix("PARITY ")) for l in proc.stdout.splitlines() if l.startswith("PARITY ")]
  assert proc.returncode == 0 and len(reports) == 1, proc.stderr[-3000:]
  r = reports[0]
  assert r["mesh"]["tensor"] == 2 and r["mesh"]["expert"] == 2, r
  assert 0 in r["expert_counts"], r  # skewed: some experts get no token
  check(r, compare_lb_loss=False)  # native's aux loss comes from one data shard (test_parity.py)
  for name, norm in r["param_grad_norms"].items():
    assert norm > 0, (name, r)
