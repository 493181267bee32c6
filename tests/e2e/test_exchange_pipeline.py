"""temoe's block under MaxText's pipeline parallelism trains with the loss of MaxText's native MoE: the
smoke DeepSeek-V3 model (routing bias off: MaxText's pipeline refuses it, test_exchange_config.py) for 3
steps on 4 host devices, pipeline 2 stages x 4 microbatches of 2 sequences, temoe as EP 2 with the
hierarchical exchange (a node of one rank) in 2 token chunks, native as FSDP 2 (its expert-parallel path
does not run on XLA:CPU). Two training runs, forked (about a minute each here): the least that compares a
loss. Most of a run is XLA's compile of the pipelined step (~50 s); per_device_batch_size=2 cut MaxText's
step time from 3.6-5.2 s (the config's 8) to 0.7-1.9 s."""

from __future__ import annotations

import json
import sys

import runs
from conftest import SMOKE, xla_flags

TOL = 1e-5
COMMON = ("dataset_type=synthetic", "steps=3", "per_device_batch_size=2", "log_period=1", "enable_tensorboard=false", "override_model_config=true",
          "routed_bias=false", "routed_bias_update_rate=0.0", "ici_pipeline_parallelism=2",
          "num_pipeline_microbatches=4")
TEMOE = ("ici_fsdp_parallelism=1", "ici_expert_parallelism=2", "te_moe_exchange=hier", "te_moe_ep_node_size=1",
         "te_moe_chunks=2")
NATIVE = ("ici_fsdp_parallelism=2", "te_moe_block=false", "te_gmm_quantization=")


def losses(tmp_path, name, overrides) -> list[dict]:
  """The run's metrics rows; it is forked like the session's other runs (tests/runs.py's launch)."""
  metrics = tmp_path / f"{name}.jsonl"
  proc = runs.launch([sys.executable, "-m", "temoe.cli", "train", SMOKE, f"base_output_directory={tmp_path}",
                      f"run_name={name}", f"metrics_file={metrics}", *COMMON, *overrides], tmp_path / f"{name}.log",
                     {"XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"})
  code, log = runs.finish(proc, tmp_path, name)
  assert code == 0, log[-3000:]
  return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_pipeline_trains_with_the_native_loss(tmp_path):
  temoe, native = losses(tmp_path, "temoe", TEMOE), losses(tmp_path, "native", NATIVE)
  assert len(temoe) == len(native) == 3
  for t, n in zip(temoe, native):
    for key in ("learning/lm_loss", "learning/loss"):  # loss adds the load-balance term: native's is one shard's
      assert abs(t[key] - n[key]) <= TOL * abs(n[key]), (key, t[key], n[key])
    assert t["learning/te_moe_capacity_overflow"] == 0.0
  assert temoe[-1]["learning/lm_loss"] < temoe[0]["learning/lm_loss"]
