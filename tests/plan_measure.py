"""Measures the train step's memory on this host's devices and prints it beside `temoe.tools.hbm`'s estimate.

    python tests/plan_measure.py [--devices N] CASE [CASE ...] [--devices M CASE ...]   (one JSON line each)

Cases: plan_measure.CASES. Each `--devices N` group runs in its own child with N host devices (XLA's
host-platform devices), forked from this process once MaxText is imported and before any JAX backend exists,
so the groups share one import of MaxText and run side by side. JAX's CPU devices report no memory_stats(), so
the measure is XLA's own account of the compiled step (MaxText's train_compile path, on this host's devices):
compiled.memory_analysis() arguments + outputs - donated aliases + temporaries (its peak_memory_in_bytes on CPU
counts the arguments only).
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
  return compiled, mesh, args[0]


def measure(case: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from conftest import maxtext_config  # pylint: disable=import-outside-toplevel
  from temoe.tools import hbm  # pylint: disable=import-outside-toplevel

  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  with introspect.yaml_read_once():  # the smoke config's chain, read before the fork
    config = maxtext_config(*CASES[case], "log_config=false")
  compiled, mesh, state = compiled_train_step(config)
  m = compiled.memory_analysis()
  measured = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  # the abstract train state the step was compiled for: the one introspect.abstract_state builds (test_introspect_state)
  estimate = hbm.estimate(config, mesh, "xla", "cpu", state=state)
  return {
      "case": case, "devices": mesh.size, "measured": measured, "estimate": estimate.peak,
      "memory_stats": jax.devices()[0].memory_stats(), "transient": estimate.transient.name,
  }


def groups(argv: list[str]) -> list[tuple[int, list[str]]]:
  """[(devices, cases)] of the command line (cases before any --devices: 1 device)."""
  out, devices = [], 1
  items = iter(argv)
  for item in items:
    if item == "--devices":
      devices = int(next(items))
    elif out and out[-1][0] == devices:
      out[-1][1].append(item)
    else:
      out.append((devices, [item]))
  return out


def run_group(devices: int, cases: list[str], out) -> None:
  """In a forked child (tests/forked_cases.py): `cases` on `devices` host devices, a PLAN_MEASURE line each to `out`."""
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  for name in cases:
    out.write("PLAN_MEASURE " + json.dumps(measure(name)) + "\n")
    out.flush()


def main(argv: list[str]) -> int:
  sys.path.insert(0, os.path.dirname(__file__))
  import conftest  # pylint: disable=import-outside-toplevel
  import forked_cases  # pylint: disable=import-outside-toplevel
  import temoe  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  temoe.register()
  introspect.read_config_chain(conftest.SMOKE)  # every case is the smoke config with overrides
  children = [forked_cases.fork(lambda out, d=devices, c=cases: run_group(d, c, out)) for devices, cases in groups(argv)]
  failed = 0
  for child in children:  # side by side: each group's child is forked before the first is read
    text, status = forked_cases.collect(*child)
    sys.stdout.write(text)
    failed |= os.waitstatus_to_exitcode(status) != 0
  sys.stdout.flush()
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
