"""The one implementation rule both FP8 quantizer modules follow (`temoe.moe.experts.quantizers`)."""

from __future__ import annotations

import pytest

from temoe.moe.experts import fp8_block, fp8_quant, quantizers


def test_auto_runs_xla_off_a_gpu_and_for_partial_tiles():
  assert quantizers.resolve("auto", "q", (256, 384), (128, 128)) == "xla"  # this host has no GPU
  assert fp8_quant.resolve(None, (1, 128, 128)) == fp8_block.resolve(None, 256, 256) == "xla"


@pytest.mark.parametrize("resolve,refusal", [
    (lambda impl: fp8_quant.resolve(impl, (1, 64, 200)), r"cast_transpose: .* multiples of 64 x 128, got \(64, 200\)"),
    (lambda impl: fp8_block.resolve(impl, 256, 200), r"fp8_block: .* multiples of 128 x 128, got \(256, 200\)"),
], ids=["fp8_quant", "fp8_block"])
def test_both_modules_refuse_a_partial_tile_for_triton_and_an_unknown_impl(resolve, refusal):
  with pytest.raises(ValueError, match=refusal):
    resolve("triton")
  with pytest.raises(ValueError, match="impl 'cuda': choose one of auto, xla, triton"):
    resolve("cuda")
  assert resolve("xla") == "xla"
