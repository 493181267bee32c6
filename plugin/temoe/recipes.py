"""temoe's flags and recipes, and the checks that turn bad values into one clear error.

temoe adds one flag to MaxText's schema, `te_moe_backend`, and widens another,
`te_gmm_quantization`. Every check here runs while MaxText builds its config: before any
compilation, so a bad flag costs seconds, not a queue slot.
"""

from __future__ import annotations

RECIPES = ("te_no_quant", "te_fp8_current", "te_mxfp8")
"""Values of `te_gmm_quantization`: bf16 (no quantization), FP8 current scaling, MXFP8."""

BACKENDS = ("auto", "te", "xla")
"""Values of `te_moe_backend`: auto picks `te` on a GPU with Transformer Engine, else `xla`."""

MODELS = ("deepseek3-smoke", "deepseek3-proxy")
"""temoe's model shapes (configs/models/<name>.yml), accepted as `model_name` beside MaxText's."""

FP8_RECIPES = ("te_fp8_current", "te_mxfp8")

ROW_ALIGNMENT = {
    # bf16 operands are never physically transposed, so a group's row count is never a cuBLAS
    # leading dimension: any group size works.
    "te_no_quant": 1,
    # Hopper FP8 GEMMs are TN only, so wgrad reads each group's transposed rows: cuBLAS wants that
    # leading dimension (the group's row count) % 16 == 0 ("Caller must pad").
    "te_fp8_current": 16,
    # MXFP8 scales are padded to 128x4 tiles per group; TE's grouped quantize/GEMM need 128-row groups.
    "te_mxfp8": 128,
}
"""Rows every expert group is padded to by the te backend, per recipe."""

MIN_COMPUTE_CAPABILITY = {"te_fp8_current": (8, 9), "te_mxfp8": (10, 0)}
"""The oldest GPU each quantized recipe runs on: FP8 needs Ada/Hopper, MXFP8 Blackwell."""


class TemoeConfigError(ValueError):
  """A temoe flag value that cannot run; the message names the valid choices."""


def check_recipe(recipe: str) -> str:
  """Returns `recipe` if temoe knows it, else raises naming the valid recipes."""
  if recipe not in RECIPES:
    raise TemoeConfigError(
        f"te_gmm_quantization={recipe!r} is not a temoe recipe; valid choices: {', '.join(RECIPES)}."
    )
  return recipe


def check_backend(backend: str) -> str:
  """Returns `backend` if temoe knows it, else raises naming the valid backends."""
  if backend not in BACKENDS:
    raise TemoeConfigError(f"te_moe_backend={backend!r} is not a temoe backend; valid choices: {', '.join(BACKENDS)}.")
  return backend


def check_flag_conflicts(backend: str, recipe: str) -> None:
  """Rejects combinations no platform can run, whatever the machine."""
  if backend == "xla" and recipe in FP8_RECIPES:
    raise TemoeConfigError(
        f"te_gmm_quantization={recipe} needs Transformer Engine, but te_moe_backend=xla computes in the model "
        "dtype; use te_moe_backend=te (or auto) on a GPU, or te_gmm_quantization=te_no_quant with the xla backend."
    )


def resolve_backend(backend: str, recipe: str, platform) -> str:
  """Picks the backend that computes the block on this machine, or raises saying what to change.

  `platform` is a `temoe.hardware.Platform`: what devices and Transformer Engine this process has.
  """
  check_backend(backend)
  check_recipe(recipe)
  check_flag_conflicts(backend, recipe)
  where = platform.describe()
  if backend == "te" and not platform.te_usable:
    raise TemoeConfigError(
        f"te_moe_backend=te needs a GPU with Transformer Engine for JAX; this process has {where}. "
        "Valid choices here: te_moe_backend=auto or xla (with te_gmm_quantization=te_no_quant)."
    )
  chosen = "te" if backend == "te" or (backend == "auto" and platform.te_usable) else "xla"
  if chosen == "xla":
    if recipe in FP8_RECIPES:
      raise TemoeConfigError(
          f"te_gmm_quantization={recipe} needs a GPU with Transformer Engine; this process has {where}. "
          "Valid choice here: te_gmm_quantization=te_no_quant (reference xla backend)."
      )
    return chosen
  runnable = platform.runnable_recipes()
  if recipe not in runnable:
    raise TemoeConfigError(
        f"te_gmm_quantization={recipe} cannot run on {where}: {platform.why_not(recipe)} "
        f"Valid choices here: {', '.join(runnable) or 'none with te_moe_backend=te; use te_moe_backend=xla'}."
    )
  return chosen
