"""Measures the train step's memory on this host's devices and prints it beside `temoe.tools.hbm`'s estimate.

    python tests/plan_measure.py CASE [CASE ...]     (cases: plan_measure.CASES; one JSON line each)

JAX's CPU devices report no memory_stats(), so the measure is XLA's own account of the compiled step
(MaxText's train_compile path, on this host's devices): compiled.memory_analysis() arguments +
outputs - donated aliases + temporaries (its peak_memory_in_bytes on CPU counts the arguments only).
"""

from __future__ import annotations

import json
import os
import sys

CASES = {  # name -> MaxText overrides of the smoke config
    "smoke": [],  # the MoE layer's buffers dominate (XLA's dense ragged_dot)
    "state": ["override_model_config=true", "base_emb_dim=512", "base_mlp_dim=1024", "base_moe_mlp_dim=128",
              "per_device_batch_size=1"],  # parameters, optimizer state and gradients dominate
    "loss": ["override_model_config=true", "vocab_size=8192"],  # the logits dominate
    "fsdp_state": ["override_model_config=true", "base_emb_dim=512", "base_mlp_dim=1024", "base_moe_mlp_dim=128",
                   "per_device_batch_size=1"],  # 4 host devices: the state sharded over FSDP 4
    "expert_parallel": ["ici_expert_parallelism=4", "per_device_batch_size=2"],  # 4 host devices: EP 4
    # not in the set the estimate's terms were checked against: each changes one axis of the smoke config
    "seq_256": ["max_target_length=256", "per_device_batch_size=2"],  # 4x the sequence, 1/4 the batch
    "batch_16": ["per_device_batch_size=16"],  # 2x the batch
    "remat_minimal": ["remat_policy=minimal_with_context"],  # saved activations instead of full remat
    "unrolled": ["scan_layers=false", "remat_policy=minimal_with_context"],  # each layer its own parameters
}


def compiled_train_step(config):
  """MaxText's train step for `config`, compiled for this host's devices as train_compile does."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train, train_compile  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, sharding  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config, jax.devices()), config.mesh_axes)
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
  step, in_sh, out_sh, static, donate = maxtext_utils.get_functional_train_with_signature(
      train.train_step, sharding.get_input_data_sharding(config, mesh), input_shardings, model, config, params_shardings
  )
  compiled = train_compile.jit_and_compile(
      step, args, kwargs, mesh, in_sh, out_sh, static, donate, config, logical_axis_rules(config.logical_axis_rules)
  )
  return compiled, mesh


def measure(case: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from conftest import maxtext_config  # pylint: disable=import-outside-toplevel
  from temoe.tools import hbm  # pylint: disable=import-outside-toplevel

  config = maxtext_config(*CASES[case], "log_config=false")
  compiled, mesh = compiled_train_step(config)
  m = compiled.memory_analysis()
  measured = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  estimate = hbm.estimate(config, mesh, "xla", "cpu")
  return {
      "case": case, "devices": mesh.size, "measured": measured, "estimate": estimate.peak,
      "memory_stats": jax.devices()[0].memory_stats(), "transient": estimate.transient.name,
  }


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(__file__))
  for name in sys.argv[1:]:
    print("PLAN_MEASURE " + json.dumps(measure(name)), flush=True)
