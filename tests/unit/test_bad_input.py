"""Bad input: one clear error naming the valid choices, raised while the config is built."""

from __future__ import annotations

import types

import pydantic
import pytest

from conftest import SMOKE, maxtext_config, run_temoe
from temoe import cli

CASES = {
    "unknown recipe": (["te_gmm_quantization=te_fp9"], ["te_no_quant, te_fp8_current, te_fp8_blockwise, te_mxfp8"]),
    "unknown backend": (["te_moe_backend=cuda"], ["valid choices: auto, te, xla"]),
    "fp8 without GPU": (["te_gmm_quantization=te_fp8_current"], ["needs a GPU with Transformer Engine", "te_no_quant"]),
    "mxfp8 without GPU": (["te_gmm_quantization=te_mxfp8"], ["needs a GPU with Transformer Engine", "te_no_quant"]),
    "te backend without TE": (["te_moe_backend=te"], ["te_moe_backend=te needs a GPU", "auto or xla"]),
    "fp8 on the xla backend": (
        ["te_moe_backend=xla", "te_gmm_quantization=te_fp8_current"],
        ["te_moe_backend=xla computes in the model dtype", "te_moe_backend=te"],
    ),
    "no recipe": (["te_gmm_quantization=''"], ["te_gmm_quantization must be specified", "te_no_quant"]),
    "unfused weights": (["prefuse_moe_weights=false"], ["requires prefuse_moe_weights=True"]),
    "dropping MoE": (["sparse_matmul=false"], ["requires sparse_matmul=True"]),
    "unknown fp8 weight placement": (["te_moe_fp8_weights=host"], ["choose one of remat, device, offload"]),
    "fp8 weights kept without a custom policy": (["te_moe_fp8_weights=device"],
                                                 ["needs remat_policy=custom (got full)", "te_moe_fp8_weights=remat"]),
    "fp8 weights kept where none are made": (["te_moe_fp8_weights=offload", "remat_policy=custom"],
                                             ["recipe te_no_quant on backend xla keeps no FP8 weight copies"]),
    "fp8 weights kept without temoe's block": (["te_moe_fp8_weights=device", "te_moe_block=false"],
                                               ["it needs te_moe_block=true"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_error_names_the_fix(case):
  overrides, expected = CASES[case]
  with pytest.raises(pydantic.ValidationError) as info:
    maxtext_config(*overrides)
  message = cli.config_error_message(info.value)
  assert len(info.value.errors()) == 1
  for text in expected:
    assert text in message, message


def test_an_unknown_tokens_path_scaling_is_refused_with_the_config(monkeypatch):
  monkeypatch.setenv("TEMOE_TOKENS_MLP", "current,bf16")
  with pytest.raises(pydantic.ValidationError) as info:
    maxtext_config()
  message = cli.config_error_message(info.value)
  assert len(info.value.errors()) == 1 and "TEMOE_TOKENS_MLP='current,bf16'" in message
  assert "choose from blockwise, current" in message, message


def test_lifted_restrictions_reach_the_config():
  cfg = maxtext_config("routed_bias_update_rate=0.01", "norm_topk_prob=true")
  assert cfg.te_moe_block and cfg.routed_bias_update_rate == 0.01 and cfg.norm_topk_prob


def test_loss_free_balancing_outside_deepseek_is_still_rejected():
  with pytest.raises(pydantic.ValidationError, match="only supported for the DeepSeek decoder"):
    maxtext_config("override_model_config=true", "decoder_block=mixtral", "routed_bias_update_rate=0.01")


@pytest.mark.parametrize("override", ["te_gmm_quantization=te_fp9", "te_gmm_quantization=te_fp8_current"])
def test_cli_prints_one_line_and_exits_2_before_compiling(tmp_path, capsys, override):
  """`temoe train`'s entry point in this process (a subprocess's whole output, the same path:
  test_cli_errors.py's test_a_subprocess_prints_only_the_line)."""
  code = cli.main(["train", SMOKE, f"base_output_directory={tmp_path}", "run_name=bad", override])
  out, err = capsys.readouterr()
  assert code == 2
  lines = [line for line in err.splitlines() if line.startswith("temoe: ")]
  assert len(lines) == 1 and "valid choice" in lines[0].lower(), err[-2000:]
  assert "Traceback" not in err
  assert "completed step" not in err + out
  assert not (tmp_path / "bad" / "checkpoints").exists()


def test_cli_usage_error():
  result = run_temoe("train", "key=value")
  assert result.returncode == 2 and "usage: temoe train <config.yml>" in result.stderr


@pytest.mark.parametrize("where, field", [("device", "tensors_on_device"), ("offload", "tensors_to_offload")])
def test_te_moe_fp8_weights_adds_temoes_name_to_maxtexts_custom_lists(where, field):
  from temoe.maxtext import config  # pylint: disable=import-outside-toplevel
  from temoe.moe.experts import parts  # pylint: disable=import-outside-toplevel

  model = types.SimpleNamespace(te_moe_fp8_weights=where, remat_policy="custom", te_gmm_quantization="te_fp8_current",
                                tensors_on_device=["mlpwo"], tensors_to_offload=None)
  config.place_fp8_weights(model, "mosaic")
  config.place_fp8_weights(model, "mosaic")  # once only
  # the weights' scales are kept under every custom policy (the backward casts again from them, no amax)
  assert model.tensors_on_device[:2] == ["mlpwo", parts.FP8_SCALES]
  assert getattr(model, field) == ([*(["mlpwo", parts.FP8_SCALES] if where == "device" else []), parts.FP8_WEIGHTS])
  with pytest.raises(ValueError, match="keeps no FP8 weight copies"):
    config.place_fp8_weights(model, "te")  # TE's grouped GEMM quantizes inside its own op: nothing to name


@pytest.mark.parametrize("where, placed", [("device", "device"), ("offload", "host"), ("remat", "remat")])
def test_maxtexts_own_policy_places_the_fp8_weights_as_asked(where, placed, monkeypatch):
  """Through MaxText's pyconfig and its decoder's get_remat_policy: the name temoe's kernels give the
  weights' FP8 copies is kept, offloaded or recomputed as the flag says. (No Hopper GPU here: the backend
  check is made to answer mosaic, so the FP8 recipe's config is built as on an H200.)"""
  from temoe import recipes  # pylint: disable=import-outside-toplevel
  from temoe.moe.experts import parts  # pylint: disable=import-outside-toplevel
  from temoe.tools import hbm_activations  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(recipes, "resolve_backend", lambda *args: "mosaic")
  cfg = maxtext_config("remat_policy=custom", "te_gmm_quantization=te_fp8_current", f"te_moe_fp8_weights={where}")
  policy = hbm_activations.remat_policy(cfg)
  assert hbm_activations.placement(policy, parts.FP8_WEIGHTS, cfg) == placed
  assert hbm_activations.placement(policy, parts.QUANTIZED, cfg) == "remat"  # the activations' copies are not kept
  assert hbm_activations.placement(policy, parts.FP8_SCALES, cfg) == "device"  # the weights' scales always are


def test_an_empty_run_name_under_a_scheduler_becomes_the_jobs_stable_name(tmp_path, monkeypatch, capsys, smoke_data):
  """MaxText names an unnamed run after the minute it started: each requeue of a job would start afresh. Under
  Slurm the job id names it (the same on every requeue and in every task), and temoe train says so."""
  import json  # pylint: disable=import-outside-toplevel

  from temoe.run import inputs, lock  # pylint: disable=import-outside-toplevel

  unnamed = [SMOKE, "run_name=", "steps=3"]
  assert inputs.with_stable_run_name(unnamed, {}) == (unnamed, None)  # no scheduler: MaxText's default stands
  assert inputs.with_stable_run_name([SMOKE], {"SLURM_JOB_ID": "7"}) == ([SMOKE], None)  # the YAML names it
  assert inputs.with_stable_run_name(unnamed, {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "6",
                                               "SLURM_ARRAY_TASK_ID": "3"})[0][-1] == "run_name=slurm-6_3"
  assert inputs.with_stable_run_name(unnamed, {"JOBSET_NAME": "ds3"})[0][-1] == "run_name=ds3"

  held = tmp_path / "slurm-4242"  # the run directory the job's name leads to, held by this live process
  held.mkdir()
  (held / lock.LOCK_NAME).write_text(json.dumps(lock.holder_info()))
  monkeypatch.setenv("SLURM_JOB_ID", "4242")
  assert cli.main(["train", SMOKE, f"base_output_directory={tmp_path}", f"grain_train_files={smoke_data}", "run_name="]) == 2
  out, err = capsys.readouterr()
  assert "temoe: run_name is empty; this job runs as run_name=slurm-4242 (from SLURM_JOB_ID)" in out
  assert f"run directory {held} is in use by another temoe train" in err
