"""The recipe registry: every recipe's kernels exist, and the backend resolution on stand-in GPUs."""

from __future__ import annotations

import importlib.util

import pytest

from temoe import recipes
from temoe.hardware import Platform

CPU = Platform("cpu", "cpu", None, None, "no GPU", None)
H200_OLD_CUBLAS = Platform("gpu", "NVIDIA H200", (9, 0), "2.20.2", None, (13, 1, 0))
H200 = Platform("gpu", "NVIDIA H200", (9, 0), "2.20.2", None, (13, 4, 0))
B200 = Platform("gpu", "NVIDIA B200", (10, 0), "2.20.2", None, (13, 3, 0))


def test_every_recipe_names_kernels_that_exist():
  for recipe in recipes.REGISTRY.values():
    assert recipe.align and set(recipe.align) <= set(recipes.KERNELS), recipe.name
    for kernel, align in recipe.align.items():
      assert align >= 1 and align & (align - 1) == 0, (recipe.name, kernel, align)
      assert importlib.util.find_spec(f"temoe.moe.experts.{kernel}") is not None, kernel
    assert recipe.fp8 == (recipe.name in recipes.FP8_RECIPES)
    assert 0 < recipe.error_bound[0] <= recipe.error_bound[1] < 1


@pytest.mark.parametrize(
    "platform, backend, recipe, kernel",
    [
        (CPU, "auto", "te_no_quant", "xla"),
        (H200, "auto", "te_fp8_current", "mosaic"),  # Hopper FP8: temoe's sync-free kernels, measured fastest
        (H200, "te", "te_fp8_current", "te"),  # TE's grouped GEMM, selectable for comparison
        (H200, "auto", "te_no_quant", "mosaic"),  # Hopper bf16: temoe's sync-free kernels
        (H200, "te", "te_no_quant", "te"),
        (H200_OLD_CUBLAS, "auto", "te_no_quant", "mosaic"),  # bf16 on Hopper never refuses
        (H200, "auto", "te_fp8_blockwise", "mosaic"),  # DeepSeek-V3's block scales: temoe's kernels only
        (H200_OLD_CUBLAS, "mosaic", "te_fp8_blockwise", "mosaic"),
        (B200, "auto", "te_fp8_current", "te"),  # Blackwell keeps TE
        (B200, "auto", "te_mxfp8", "te"),
        (B200, "xla", "te_no_quant", "xla"),
    ],
)
def test_resolution(platform, backend, recipe, kernel):
  assert recipes.resolve_backend(backend, recipe, platform) == kernel
  assert recipes.row_alignment(recipe, kernel) == recipes.REGISTRY[recipe].align[kernel]


@pytest.mark.parametrize(
    "platform, backend, recipe, words",
    [
        (CPU, "auto", "te_fp8_current", ["needs a GPU with Transformer Engine", "te_no_quant"]),
        (H200, "auto", "te_mxfp8", ["needs Blackwell", "Valid choices here: te_no_quant, te_fp8_current"]),
        (B200, "mosaic", "te_fp8_current", ["Hopper's wgmma", "te_moe_backend=auto"]),
        (H200_OLD_CUBLAS, "te", "te_no_quant", ["cuBLAS >= 13.4", "te_fp8_current"]),
        (H200, "xla", "te_fp8_current", ["te_moe_backend=xla computes in the model dtype"]),
        (H200, "cuda", "te_no_quant", ["valid choices: auto, te, xla, mosaic"]),
        (B200, "auto", "te_fp8_blockwise", ["Hopper's wgmma", "Valid choices here: te_no_quant, te_fp8_current, te_mxfp8"]),
        (H200, "te", "te_fp8_blockwise", ["does not implement te_fp8_blockwise (it has: mosaic)"]),
        (CPU, "auto", "te_fp8_blockwise", ["needs a Hopper GPU", "te_no_quant"]),
    ],
)
def test_refusals_name_the_fix(platform, backend, recipe, words):
  with pytest.raises(recipes.TemoeConfigError) as info:
    recipes.resolve_backend(backend, recipe, platform)
  for word in words:
    assert word in str(info.value), str(info.value)


def test_quantized_copies_cost_memory_only_for_fp8():
  assert recipes.REGISTRY["te_no_quant"].quantized_copy_bytes(10, 10, 4, 4) == 0
  assert recipes.REGISTRY["te_fp8_current"].quantized_copy_bytes(10, 10, 4, 4) == 2 * 10 + 2 * 10 * 8
  # blockwise: one fp32 scale per 128 elements beside every FP8 copy
  assert recipes.REGISTRY["te_fp8_blockwise"].quantized_copy_bytes(10, 10, 4, 4) == (2 * 10 + 2 * 10 * 8) * (1 + 4 / 128)


def test_mosaic_wherever_its_rows_and_dtype_fit():
  # bf16 reads the weights as stored: K and N multiples of 64 (128-byte TMA tiles); FP8 copies are
  # written padded, so multiples of 16 do: 128-aligned dims, gpt-oss-like 2880, and (FP8 only) the
  # smoke model's 64 / 32 run on temoe's kernels; a dim of 100 or a float32 model does not
  for emb, ffn in ((7168, 2048), (2880, 2880), (64, 32)):
    shape = recipes.ModelShape(emb, ffn, "bfloat16")
    for recipe in ("te_no_quant", "te_fp8_current", "te_fp8_blockwise"):
      want = "xla" if recipe == "te_no_quant" and ffn % 64 else "mosaic"
      assert recipes.resolve_backend("auto", recipe, H200_OLD_CUBLAS, shape) == want, (emb, ffn, recipe)
  smoke = recipes.ModelShape(64, 32, "bfloat16")
  assert recipes.resolve_backend("auto", "te_no_quant", H200, smoke) == "te"  # TE's sync-free bf16 grouped GEMM
  with pytest.raises(recipes.TemoeConfigError, match="multiples of 64 for te_no_quant .this model: 64, 32."):
    recipes.resolve_backend("mosaic", "te_no_quant", H200, smoke)
  odd = recipes.ModelShape(100, 32, "bfloat16")
  assert recipes.resolve_backend("auto", "te_no_quant", H200_OLD_CUBLAS, odd) == "xla"
  assert recipes.resolve_backend("auto", "te_no_quant", H200_OLD_CUBLAS, recipes.ModelShape(7168, 2048, "float32")) == "xla"
  for recipe in ("te_fp8_current", "te_fp8_blockwise"):
    with pytest.raises(recipes.TemoeConfigError, match=f"multiples of 16 for {recipe} .this model: 100, 32."):
      recipes.resolve_backend("mosaic", recipe, H200, odd)
  with pytest.raises(recipes.TemoeConfigError, match="multiples of 16 for te_fp8_blockwise .this model: 100, 32."):
    recipes.resolve_backend("auto", "te_fp8_blockwise", H200, odd)
