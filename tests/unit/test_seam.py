"""The seams temoe hooks in MaxText: installed once, version-guarded, schema widened."""

from __future__ import annotations

import types
from importlib import metadata

import pydantic
import pytest

import temoe
from temoe.maxtext import seams


def test_register_is_idempotent_and_hooks_the_four_seams():
  from maxtext.common import metric_logger  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils  # pylint: disable=import-outside-toplevel

  def hooked_now():
    return (pyconfig.initialize, moe.RoutedMoE._te_moe_block, max_utils.maybe_bootstrap_te_moe,
            metric_logger.record_activation_metrics)

  temoe.register()
  hooked = hooked_now()
  temoe.register()
  assert hooked_now() == hooked
  assert moe.RoutedMoE._te_moe_block is seams._temoe_block
  assert train.record_activation_metrics is metric_logger.record_activation_metrics  # train's own name too
  assert hooked[0] is not seams._installed["initialize"] and hooked[0].__wrapped__ is seams._installed["initialize"]
  assert hooked[2] is not seams._installed["bootstrap"]
  assert hooked[3].__wrapped__.__module__ == "maxtext.common.metric_logger"  # MaxText's, wrapped
  assert seams.is_installed()


def test_stock_maxtext_schema_rejects_what_temoe_accepts(tmp_path):
  import os  # pylint: disable=import-outside-toplevel

  from maxtext.configs import pyconfig, types  # pylint: disable=import-outside-toplevel
  from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # pylint: disable=import-outside-toplevel

  temoe.register()
  argv = ["test", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml"), f"base_output_directory={tmp_path}", "run_name=t"]
  with pytest.raises(pydantic.ValidationError, match="te_gmm_quantization"):
    pyconfig.initialize(argv + ["te_gmm_quantization=te_fp8_current"], config_class=types.MaxTextConfig)
  cfg = pyconfig.initialize(argv + ["te_gmm_quantization=te_fp8_current", "te_moe_backend=te"])
  assert (cfg.te_gmm_quantization, cfg.te_moe_backend, cfg.te_moe_block) == ("te_fp8_current", "te", False)


def test_version_mismatch_is_one_clear_error(monkeypatch):
  real = metadata.version
  monkeypatch.setattr(metadata, "version", lambda name: "0.3.0" if name == "maxtext" else real(name))
  with pytest.raises(seams.TemoeSeamError, match=r"hooks MaxText 0\.2\.5 internals, but maxtext 0\.3\.0"):
    seams.check_maxtext()


def test_missing_seam_is_named(monkeypatch):
  from maxtext.utils import max_utils  # pylint: disable=import-outside-toplevel

  monkeypatch.delattr(max_utils, "maybe_bootstrap_te_moe")
  with pytest.raises(seams.TemoeSeamError, match="max_utils.maybe_bootstrap_te_moe"):
    seams.check_maxtext()


def test_the_startup_line_names_the_kernels_recipe_and_a_set_tokens_switch(monkeypatch):
  from temoe import hardware  # pylint: disable=import-outside-toplevel
  from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel

  h200 = hardware.Platform("gpu", "NVIDIA H200", (9, 0), "2.20.2", None, (13, 4, 0))
  monkeypatch.setattr(hardware, "detect", lambda: h200)
  config = types.SimpleNamespace(te_moe_backend="auto", te_gmm_quantization="te_fp8_current", emb_dim=7168,
                                 moe_mlp_dim=2048, dtype="bfloat16")
  mesh = types.SimpleNamespace(devices=types.SimpleNamespace(size=8))
  monkeypatch.delenv(mosaic_tokens.ENV, raising=False)
  line = seams.describe_block(config, mesh)
  assert "backend mosaic: temoe's Pallas Mosaic GPU kernels" in line and "recipe te_fp8_current, 8 device(s)" in line
  monkeypatch.setenv(mosaic_tokens.ENV, "none")
  assert "recipe te_fp8_current, TEMOE_TOKENS_MLP=none, 8 device(s)" in seams.describe_block(config, mesh)
