"""Benchmark: one DeepSeek-V3 MoE layer's dispatch -> expert MLP -> combine, fwd+bwd, on one GPU.

Shapes: hidden 7168, expert ffn 2048, 32 local experts, 8192 tokens x top-8 (65,536 routed rows),
skewed load. Paths: temoe `te` FP8 current scaling, temoe `te` bf16 (where TE's bf16 grouped
GEMM runs), temoe `xla` (ragged_dot); and the dense FP8 (TE) and bf16 (XLA) matmul ceilings of the
same GEMM shapes, measured in the same call. Useful FLOPs only: padding rows are not counted.

    python bench/moe_layer.py [--out bench/results] [--iters 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from temoe.moe import dispatch
from temoe.moe.experts import xla as experts

HIDDEN, FFN, EXPERTS, TOKENS, TOP_K = 7168, 2048, 32, 8192, 8


@dataclasses.dataclass
class ExpertsLayer:
  """What the expert stage reads of MaxText's RoutedMoE: dtype, recipe, SwiGLU."""

  dtype: jnp.dtype
  config: object

  @staticmethod
  def apply_ffn_activation(w0, w1):
    return (jax.nn.silu(w0) * w1).astype(w0.dtype)


def skewed_routing(key, skew: float = 1.2):
  """Top-8 distinct experts per token from a Zipf-like popularity (max/mean load ~2.5)."""
  logits = -skew * jnp.log1p(jnp.arange(EXPERTS, dtype=jnp.float32))
  gumbel = jax.random.gumbel(key, (TOKENS, EXPERTS))
  _, ids = jax.lax.top_k(logits + gumbel, TOP_K)
  weights = jax.nn.softmax(jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, TOP_K)), axis=-1)
  return ids.astype(jnp.int32), weights


def timed(fn, *args, iters: int) -> float:
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def moe_fwdbwd(backend: str, recipe: str, ids, weights, align_override: int | None = None):
  layer = ExpertsLayer(jnp.bfloat16, type("Cfg", (), {"te_gmm_quantization": recipe})())
  align = 1
  if backend == "te":
    from temoe.moe.experts import te as te_experts  # pylint: disable=import-outside-toplevel

    align = align_override or te_experts.ROW_ALIGNMENT[recipe]

  def loss(x, wi, wo, cot):
    p = dispatch.plan(ids, EXPERTS, align)
    buf = dispatch.dispatch(x, p, TOP_K)
    if backend == "te":
      y = te_experts.mlp(layer, buf, p, wi, wo, (None, None, None), None)
    else:
      y = experts.mlp_xla(layer, buf, p.padded_group_sizes, wi, wo, (None, None, None), None)
    out = dispatch.combine(y, p, weights)
    return jnp.sum(out.astype(jnp.float32) ** 2 * cot)

  # value_and_grad: the loss value needs every forward GEMM, so none is dead code.
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def dense_fwdbwd(fp8: bool):
  def loss(x, w, cot):
    if fp8:
      from transformer_engine.jax.dense import dense  # pylint: disable=import-outside-toplevel
      from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode  # pylint: disable=import-outside-toplevel

      qs = QuantizerFactory.create_set(
          scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, fwd_dtype=jnp.float8_e4m3fn, bwd_dtype=jnp.float8_e5m2
      )
      y = dense(x, w, contracting_dims=((1,), (0,)), quantizer_set=qs)
    else:
      y = x @ w
    return jnp.sum(y.astype(jnp.float32) ** 2 * cot)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--iters", type=int, default=10)
  args = parser.parse_args()
  key = jax.random.key(0)
  ids, weights = skewed_routing(key)
  loads = jnp.bincount(ids.reshape(-1), length=EXPERTS)
  rows = TOKENS * TOP_K
  kx, kw, ko, kc = jax.random.split(jax.random.fold_in(key, 7), 4)
  x = jax.random.normal(kx, (TOKENS, HIDDEN), jnp.bfloat16)
  wi = (jax.random.normal(kw, (EXPERTS, HIDDEN, 2 * FFN), jnp.float32) * HIDDEN**-0.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(ko, (EXPERTS, FFN, HIDDEN), jnp.float32) * FFN**-0.5).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, (TOKENS, HIDDEN), jnp.float32)
  useful = 3 * (2 * rows * HIDDEN * 2 * FFN + 2 * rows * FFN * HIDDEN)  # fwd + 2x bwd, 3 GEMMs
  result = {
      "command": " ".join(["python", "bench/moe_layer.py", *sys.argv[1:]]),
      "device": jax.devices()[0].device_kind,
      "shapes": {"hidden": HIDDEN, "expert_ffn": FFN, "experts": EXPERTS, "tokens": TOKENS, "top_k": TOP_K},
      "load_max_over_mean": float(loads.max() / loads.mean()),
      "empty_experts": int((loads == 0).sum()),
      "useful_tflop_per_iter": useful / 1e12,
  }
  paths = {
      "temoe_fp8": ("te", "te_fp8_current", None),
      "temoe_fp8_align128": ("te", "te_fp8_current", 128),  # TE moe()'s alignment, for comparison
      "temoe_bf16": ("te", "te_no_quant", None),
      "temoe_xla": ("xla", "te_no_quant", None),
  }
  for name, (backend, recipe, align) in paths.items():
    try:
      seconds = timed(moe_fwdbwd(backend, recipe, ids, weights, align), x, wi, wo, cot, iters=args.iters)
      result[f"{name}_fwdbwd_tflops"] = useful / seconds / 1e12
      result[f"{name}_fwdbwd_ms"] = seconds * 1e3
    except Exception as exc:  # pylint: disable=broad-exception-caught
      result[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    print(name, {k: v for k, v in result.items() if k.startswith(name)}, flush=True)
  # Dense ceilings: the same rows x (hidden -> 2*ffn) GEMM, fwd + bwd.
  xd = jax.random.normal(kx, (rows, HIDDEN), jnp.bfloat16)
  wd = (jax.random.normal(kw, (HIDDEN, 2 * FFN), jnp.float32) * HIDDEN**-0.5).astype(jnp.bfloat16)
  cd = jax.random.normal(kc, (rows, 2 * FFN), jnp.float32)
  dense_flops = 3 * 2 * rows * HIDDEN * 2 * FFN
  for name, fp8 in (("fp8_dense_ceiling", True), ("bf16_dense_ceiling", False)):
    try:
      result[f"{name}_tflops"] = dense_flops / timed(dense_fwdbwd(fp8), xd, wd, cd, iters=args.iters) / 1e12
    except Exception as exc:  # pylint: disable=broad-exception-caught
      result[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
  if "temoe_fp8_fwdbwd_tflops" in result and "fp8_dense_ceiling_tflops" in result:
    result["temoe_fp8_over_fp8_ceiling"] = result["temoe_fp8_fwdbwd_tflops"] / result["fp8_dense_ceiling_tflops"]
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "moe_layer.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    keys = [k for k in result if k.endswith("_tflops")]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([k.removesuffix("_tflops") for k in keys], [result[k] for k in keys], color="#76b900")
    ax.set_xlabel("TFLOP/s (useful, fwd+bwd)")
    ax.set_title("DeepSeek-V3 MoE layer, 32 experts, 65,536 routed rows")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "moe_layer.png"), dpi=120)
  except ImportError:
    pass
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
