"""The parity matrix: temoe's block against MaxText's native sparse_matmul block on one device.

Every case of `parity_check.CASES` (MaxText's routed-MoE families at tiny dims, routed-only and
with shared experts, skewed routing with empty experts) must agree to 1e-5 relative error in
float32 on inputs drawn from a fixed seed (parity_check.SEED): output, load-balance loss, routed-bias
update (bit-equal, same dtype) and the gradient with respect to the input and every parameter.
"""

from __future__ import annotations

import pytest
from compile_cache import persistent_cache

from parity_check import CASES, compare
from test_parity import check


@pytest.fixture(scope="module", autouse=True)
def _compile_cache():
  """Every program of this module through the session's cache, however small (compile_cache): qwen3_custom_moe and
  qwen3_5 are qwen3_moe's config but for decoder_block, which MaxText's routed block (layers/moe.py) and temoe branch
  on for deepseek, deepseek4, gpt_oss, llama4 and gemma4 only, so their programs are qwen3_moe's, loaded, not
  compiled again. Every case still builds its configs and layers, traces, runs and compares both blocks."""
  with persistent_cache():
    yield


@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_maxtext_native_moe(case):
  r = compare(case)
  check(r, dropless_rows=r["routed_rows"])
  assert r["lb_loss_present"] == [True, True] and r["lb_loss"] is not None, r  # every family weighs its aux loss
  assert r["bias_update_present"] == [r["routed_bias_update"]] * 2, r
  # A gradient that is zero in both blocks would compare equal without testing anything: only
  # top-1 routing (envy: a weight of 1 for every token) leaves the gate without an output gradient,
  # and the aux loss still gives it one.
  for name, norm in r["param_grad_norms"].items():
    assert norm > 0, (name, r)
  counts = r["expert_counts"]  # (token, slot) pairs per expert, as MaxText's router assigns them
  assert sum(counts) == r["routed_rows"], r
  # skewed cases: parity_check.skew_until_skewed drew the inputs until expert 0 takes >= 90% and two none
