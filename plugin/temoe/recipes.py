"""The one recipe registry: what each `te_gmm_quantization` value is, which expert kernels implement
it, and the backend resolution that turns a bad flag into one clear error.

A recipe says its GEMM precision (operand dtypes and scaling), the oldest GPU it runs on, per expert
kernel the rows every expert group is padded to, the memory its quantized operand copies take, and
the relative error against float32 the GPU tests hold it to. Kernels are the modules under
`temoe.moe.experts` (`xla`, `te`, `mosaic`); `te_moe_backend` picks one or lets `auto` choose the
first that runs here, in the recipe's order. Every check runs while MaxText builds its config:
before any compilation, so a bad flag costs seconds, not a queue slot. No JAX import here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Mapping

KERNELS = ("te", "xla", "mosaic")
"""Expert-MLP kernels (temoe.moe.experts.<name>): Transformer Engine's grouped GEMM, the reference
`jax.lax.ragged_dot`, temoe's Pallas Mosaic GPU grouped GEMMs for Hopper."""

BACKENDS = ("auto", *KERNELS)
"""Values of `te_moe_backend`: `auto` picks the first kernel of the recipe that runs here."""

MODELS = ("deepseek3-smoke", "deepseek3-proxy")
"""temoe's model shapes (configs/models/<name>.yml), accepted as `model_name` beside MaxText's."""

HOPPER, BLACKWELL = (9, 0), (10, 0)

MOSAIC_DIM_MULTIPLE = {"none": 64, "current": 16, "blockwise": 16}
"""Per operand scaling, what K and N (emb_dim, moe_mlp_dim) must be multiples of on temoe's Mosaic
GPU kernels (temoe.moe.experts.mosaic_gemm.check_shapes). wgmma reads operands from 128-byte
swizzled shared-memory tiles, and Mosaic GPU's TMA needs every dim it tiles to be a multiple of the
tile: 64 bf16 elements. bf16 reads the weights as stored, so K and N must be multiples of 64. FP8
operands are fresh copies every step (the quantizers write them), so they are written padded where
needed at no extra pass (mosaic_copy_dim), and K and N need only be multiples of 16 (16-byte rows)."""


def mosaic_copy_dim(d: int, scaling: str) -> int:
  """The size, along a dim of true size d, of the FP8 copies temoe's Hopper kernels read for `scaling`.
  A copy's rows are read as swizzled tiles of one k-block (128 FP8 elements), whole tiles only (Mosaic
  GPU's TMA), so both FP8 scalings pad to whole 128s (block scaling has one scale per 128 of the
  contraction too); the weights' copies are padded as their casts read them, the activations by XLA before
  theirs (the tokens before the gathering cast; h in the fusion that takes its amax). Current scaling kept
  dims of whole 64s before and contracted over them in 64-element k-blocks: on the H200 those GEMMs ran at
  634-638 TFLOP/s on the 2880-dim layer where 128-element ones run 840 (bench/results/mosaic_gemm.gpt_oss_like.json),
  and padding 2880 to 2944 adds 2.2%. bf16 reads operands as stored."""
  if scaling == "none":
    return d
  return -(-d // 128) * 128


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What a kernel's fitness depends on besides the GPU: the expert GEMMs' dims and the model dtype."""

  emb: int
  ffn: int  # one expert's hidden width (moe_mlp_dim)
  dtype: str  # the model's compute dtype, e.g. "bfloat16"


def model_shape(config) -> ModelShape:
  """The ModelShape of a MaxText config (attribute reads only)."""
  dtype = config.dtype
  dtype = getattr(dtype, "value", None) or getattr(dtype, "name", None) or str(dtype)  # enum, numpy dtype or str
  return ModelShape(int(config.emb_dim), int(config.moe_mlp_dim), str(dtype))


@dataclasses.dataclass(frozen=True)
class Recipe:
  """One `te_gmm_quantization` value."""

  name: str
  summary: str
  fwd_dtype: str  # operands of the forward GEMMs (and of wgrad's activations)
  bwd_dtype: str  # the incoming gradient's operand in dgrad and wgrad
  scaling: str  # "none", "current" (per-expert amax of this step), "blockwise" (DeepSeek-V3's 1x128 /
  # 128x128 fp32 block scales, promoted per 128 of K) or "mxfp8" (1x32 blocks, E8M0 scales)
  min_compute_capability: tuple[int, int] | None
  align: Mapping[str, int]  # kernel -> rows per expert group; its keys, in order, are `auto`'s preference
  error_bound: tuple[float, float]  # (forward, gradients) relative error vs float32 in tests/gpu
  operand_bytes: float  # bytes per element of a quantized operand copy, scales included; 0 for none

  @property
  def fp8(self) -> bool:
    return self.scaling != "none"

  def quantized_copy_bytes(self, weights: int, rows: int, emb: int, ffn: int) -> float:
    """Bytes of the quantized operand copies one MoE layer holds while its GEMMs run: the expert
    weights and their transposes, and the dispatched rows and activations both ways."""
    return self.operand_bytes * (2 * weights + 2 * rows * (emb + ffn)) if self.fp8 else 0.0


# Alignment, per kernel. te: bf16 operands are never physically transposed, so any group size works;
# Hopper FP8 GEMMs are TN only, so wgrad reads each group's transposed rows and cuBLAS wants that
# leading dimension % 16 == 0 ("Caller must pad"); MXFP8 scales come in 128x4 tiles per group.
# mosaic: its tiles are 128 rows and FP8 registers cannot be masked, so groups are whole tiles.
# Error bounds: measured on the H200 (bench/results/gpu_tests.log) FP8 current scaling forward
# 0.066-0.116 and gradients 0.080-0.134 (E4M3 forward through two GEMMs, E5M2 gradients through two
# more); the bounds sit above that with margin for other seeds. Blockwise: one grouped GEMM measured
# 0.037 (y, dx, dw) on the H200 (bench/results/gpu_blockwise.log) and the expert MLP ~0.06 in interpret
# mode (two GEMMs, E4M3 gradients); tests/gpu also holds it to current scaling's error on the same inputs.
REGISTRY: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("te_no_quant", "bf16 grouped GEMMs", "bfloat16", "bfloat16", "none", None,
               {"mosaic": 128, "te": 1, "xla": 1}, (1e-2, 1e-2), 0.0),
        Recipe("te_fp8_current", "FP8 with current scaling: E4M3 forward, E5M2 gradients", "float8_e4m3fn",
               "float8_e5m2", "current", (8, 9), {"mosaic": 128, "te": 16}, (0.15, 0.2), 1.0),
        Recipe("te_fp8_blockwise", "FP8 with DeepSeek-V3's block scales: E4M3 throughout, 1x128 activation "
               "and 128x128 weight scales, fp32 promotion per 128 of K", "float8_e4m3fn", "float8_e4m3fn",
               "blockwise", HOPPER, {"mosaic": 128}, (0.1, 0.1), 1.0 + 4.0 / 128),
        Recipe("te_mxfp8", "MXFP8: E4M3 with a power-of-two scale per 32 elements", "float8_e4m3fn",
               "float8_e4m3fn", "mxfp8", BLACKWELL, {"te": 128}, (0.15, 0.2), 1.0 + 1.0 / 32),
    )
}

RECIPES = tuple(REGISTRY)
"""Values of `te_gmm_quantization`."""

FP8_RECIPES = tuple(name for name, r in REGISTRY.items() if r.fp8)


class TemoeConfigError(ValueError):
  """A temoe flag value that cannot run; the message names the valid choices."""


def check_recipe(recipe: str) -> str:
  """Returns `recipe` if temoe knows it, else raises naming the valid recipes."""
  if recipe not in REGISTRY:
    raise TemoeConfigError(
        f"te_gmm_quantization={recipe!r} is not a temoe recipe; valid choices: {', '.join(RECIPES)}."
    )
  return recipe


def check_backend(backend: str) -> str:
  """Returns `backend` if temoe knows it, else raises naming the valid backends."""
  if backend not in BACKENDS:
    raise TemoeConfigError(f"te_moe_backend={backend!r} is not a temoe backend; valid choices: {', '.join(BACKENDS)}.")
  return backend


def row_alignment(recipe: str, kernel: str) -> int:
  """Rows every expert group is padded to when `kernel` computes `recipe`."""
  return REGISTRY[recipe].align[kernel]


def grouped_gemm_min_cublas(compute_capability: tuple[int, int] | None) -> tuple[int, int]:
  """The run-time cuBLAS(Lt) TE 2.20's bf16 grouped GEMM kernel (nvte_grouped_gemm) needs.

  TE's own check (check_grouped_gemm_requirements) asks 13.4 on Hopper (sm_90), 13.3 on Blackwell.
  """
  return (13, 4) if (compute_capability or HOPPER) < BLACKWELL else (13, 3)


def _arch(cc: tuple[int, int]) -> str:
  return "Blackwell (sm_100+)" if cc >= BLACKWELL else "Ada/Hopper (sm_89+)"


def why_not(recipe: str, kernel: str, platform, shape: ModelShape | None = None) -> str | None:
  """None if `kernel` computes `recipe` on `platform` (a temoe.hardware.Platform) for a model of
  `shape` (None: any shape), else why not."""
  r = REGISTRY[recipe]
  if kernel not in r.align:
    return f"te_moe_backend={kernel} does not implement {recipe} (it has: {', '.join(r.align)})."
  if kernel == "xla":
    return None
  if platform.device_platform != "gpu":
    return f"te_moe_backend={kernel} needs a GPU."
  cc = platform.compute_capability or (0, 0)
  if r.min_compute_capability and cc < r.min_compute_capability:
    return f"{recipe} needs {_arch(r.min_compute_capability)}."
  if kernel == "mosaic":
    if cc[0] != HOPPER[0]:
      if "te" in r.align:
        return "temoe's Mosaic GPU kernels use Hopper's wgmma (sm_90); this GPU takes the te backend."
      return f"temoe's Mosaic GPU kernels use Hopper's wgmma (sm_90); {recipe} runs on Hopper only."
    if importlib.util.find_spec("jax.experimental.mosaic.gpu") is None:
      return "this JAX has no Mosaic GPU (jax.experimental.mosaic.gpu)."
    multiple = MOSAIC_DIM_MULTIPLE[r.scaling]
    if shape is not None and (shape.emb % multiple or shape.ffn % multiple):
      return (f"temoe's Mosaic GPU kernels need emb_dim and moe_mlp_dim multiples of {multiple} for {recipe} "
              f"(this model: {shape.emb}, {shape.ffn}).")
    if shape is not None and shape.dtype != "bfloat16":
      return f"temoe's Mosaic GPU kernels compute in bfloat16 (FP8 inside), this model's dtype is {shape.dtype}."
    return None
  if not platform.te_usable:
    return "the te backend needs a GPU with Transformer Engine."
  need_cublas = grouped_gemm_min_cublas(platform.compute_capability)
  if recipe == "te_no_quant" and (platform.cublas_version or (0, 0, 0))[:2] < need_cublas:
    have = ".".join(map(str, platform.cublas_version)) if platform.cublas_version else "an unknown version"
    return (
        f"TE's bf16 grouped GEMM needs cuBLAS >= {'.'.join(map(str, need_cublas))} here, this process "
        f"loads {have}; use an image with a newer CUDA (NGC JAX images), or te_moe_backend=auto."
    )
  return None


def runnable(platform, kernel: str | None = None, shape: ModelShape | None = None) -> tuple[str, ...]:
  """The recipes that run on `platform`: with `kernel`, or with any kernel but the reference."""
  kernels = (kernel,) if kernel else tuple(k for k in KERNELS if k != "xla")
  return tuple(r for r in RECIPES if any(why_not(r, k, platform, shape) is None for k in kernels))


def check_flag_conflicts(backend: str, recipe: str) -> None:
  """Rejects combinations no platform can run, whatever the machine."""
  if backend == "xla" and REGISTRY[recipe].fp8:
    raise TemoeConfigError(
        f"te_gmm_quantization={recipe} needs Transformer Engine, but te_moe_backend=xla computes in the model "
        "dtype; use te_moe_backend=te (or auto) on a GPU, or te_gmm_quantization=te_no_quant with the xla backend."
    )


def resolve_backend(backend: str, recipe: str, platform, shape: ModelShape | None = None) -> str:
  """The expert kernel that computes `recipe` on `platform` for `te_moe_backend=backend` (and a model
  of `shape`), or a TemoeConfigError saying what to change. `auto`: the recipe's first kernel that
  runs here."""
  check_backend(backend)
  check_recipe(recipe)
  check_flag_conflicts(backend, recipe)
  where = platform.describe()
  r = REGISTRY[recipe]
  if backend == "auto":
    for kernel in r.align:
      if kernel != "xla" and why_not(recipe, kernel, platform, shape) is None:
        return kernel
    if "xla" in r.align and (platform.device_platform != "gpu" or not r.fp8):
      return "xla"
    if platform.device_platform != "gpu":
      need = "a GPU with Transformer Engine" if "te" in r.align else "a Hopper GPU (temoe's Mosaic GPU kernels)"
      raise TemoeConfigError(
          f"te_gmm_quantization={recipe} needs {need}; this process has {where}. "
          "Valid choice here: te_gmm_quantization=te_no_quant (reference xla backend)."
      )
    reasons = "; ".join(f"{k}: {why_not(recipe, k, platform, shape)}" for k in r.align)
    ok = runnable(platform, shape=shape)
    raise TemoeConfigError(
        f"te_gmm_quantization={recipe} cannot run on {where} ({reasons}) "
        f"Valid choices here: {', '.join(ok) or 'te_gmm_quantization=te_no_quant with te_moe_backend=xla'}."
    )
  if backend == "te" and not platform.te_usable:
    raise TemoeConfigError(
        f"te_moe_backend=te needs a GPU with Transformer Engine for JAX; this process has {where}. "
        "Valid choices here: te_moe_backend=auto or xla (with te_gmm_quantization=te_no_quant)."
    )
  reason = why_not(recipe, backend, platform, shape)
  if reason is not None:
    ok = runnable(platform, backend, shape)
    raise TemoeConfigError(
        f"te_gmm_quantization={recipe} cannot run on {where}: {reason} "
        f"Valid choices here: {', '.join(ok) or f'none with te_moe_backend={backend}; use te_moe_backend=auto'}."
    )
  return backend
