"""temoe's block under MaxText's tensor parallelism: the DeepSeek-V3 layer with its shared expert and a
skewed routing, on 4 host devices (test_parity.py's subprocess: `parity_check.FOUR_DEVICE_RUNS`) as TP 2 x EP 2
with the hierarchical exchange (a node of one rank) in 2 token chunks, against MaxText's native dropless MoE as
TP 2 x FSDP 2 (its expert-parallel path does not run on XLA:CPU): forward, input gradient and every parameter's
gradient within 1e-5."""

from __future__ import annotations

import pytest

from parity_check import FOUR_DEVICE_RUNS, four_device_reports
from test_parity import check

RUN = "tensor2_expert2_hier"


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory) -> dict:
  return four_device_reports(tmp_path_factory)  # test_parity.py's subprocess: one per session


def test_block_under_tensor_parallelism_matches_native_moe(four_devices):
  assert "te_moe_exchange=hier" in FOUR_DEVICE_RUNS[RUN][1] and "te_moe_chunks=2" in FOUR_DEVICE_RUNS[RUN][1]
  reports = four_devices["reports"].get(RUN, [])
  assert len(reports) == 1, four_devices["stderr"]
  r = reports[0]
  assert "error" not in r, r["error"]
  assert r["mesh"]["tensor"] == 2 and r["mesh"]["expert"] == 2, r
  assert 0 in r["expert_counts"], r  # skewed: some experts get no token
  check(r, compare_lb_loss=False)  # native's aux loss comes from one data shard (test_parity.py)
  for name, norm in r["param_grad_norms"].items():
    assert norm > 0, (name, r)
