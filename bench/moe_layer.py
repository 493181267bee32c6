"""Benchmark: one MoE layer's dispatch -> expert MLP -> combine, fwd+bwd, on one GPU, over shapes.

Shapes (hidden / expert ffn / experts / tokens x top-k, skewed load):
  dsv3            7168 / 2048 / 32 / 8192 x 8   DeepSeek-V3's 32 big experts
  dsv3_ep8        7168 / 2048 /  8 / 8192 x 2   the local slice of one EP-8 rank
  qwen3_30b_a3b   2048 /  768 / 128 / 8192 x 8  fine-grained MoE
  gpt_oss_like    2880 / 2880 / 128 / 8192 x 4  dims that are not multiples of 128
  small_dsv3      1024 /  512 / 32 / 8192 x 8   the small DeepSeek-V3-shaped model's layer
Paths per shape, each measured in this process: temoe FP8 with DeepSeek-V3's block scales
(`temoe_fp8_blockwise`, recipe te_fp8_blockwise, with dispatch's gather and combine's backward fused
into its quantizers: mosaic_tokens; `temoe_fp8_blockwise_unfused` through a bf16 buffer), temoe FP8 on its Hopper kernels (`mosaic`, with
dispatch's gather and combine's backward fused into fp8_quant's Triton casts, as blockwise's: mosaic_tokens;
`temoe_fp8_unfused` through a bf16 buffer and fp8_quant's Triton cast-transpose; `temoe_fp8_xla` with the casts
as XLA fusions), temoe
FP8 on TE's grouped GEMM (`te`), temoe bf16 on its sync-free kernel (`mosaic`), stock MaxText's
tokamax ragged dot (bf16, `use_tokamax_gmm=true`'s call, with temoe's dispatch and combine around
it), and the dense FP8 (TE) and bf16 (XLA) ceilings of the same GEMMs. Per-GEMM forward TFLOP/s
of each grouped path too. Useful FLOPs only: alignment padding rows are not counted. With
`--errors`, each path's layer output and gradients (dx, dwi, dwo) against a float32 computation of the
same layer on the same routing (`errors`: relative L2 per path).

    python bench/moe_layer.py [--out bench/results] [--iters 10] [--shapes dsv3,qwen3_30b_a3b] [--errors]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import plots  # bench/plots.py, beside this file
from temoe import recipes
from temoe.moe import block, dispatch
from temoe.moe.context import MoEContext, swiglu
from temoe.moe.experts import fp8_block, fp8_quant, mosaic_tokens, parts

SHAPES = {  # hidden, expert ffn, experts, tokens, top_k
    "dsv3": (7168, 2048, 32, 8192, 8),
    "dsv3_ep8": (7168, 2048, 8, 8192, 2),
    "qwen3_30b_a3b": (2048, 768, 128, 8192, 8),
    "gpt_oss_like": (2880, 2880, 128, 8192, 4),  # dims that are not multiples of 128
    "small_dsv3": (1024, 512, 32, 8192, 8),  # the small DeepSeek-V3-shaped model's layer (batch 32 x seq 256)
}
PATHS = {  # name -> (kernel, recipe); "tokamax" is stock MaxText's grouped GEMM
    "temoe_fp8_blockwise": ("mosaic", "te_fp8_blockwise"),
    "temoe_fp8_blockwise_unfused": ("mosaic", "te_fp8_blockwise"),
    "temoe_fp8_blockwise_divide": ("mosaic", "te_fp8_blockwise"),
    "temoe_fp8": ("mosaic", "te_fp8_current"),
    "temoe_fp8_unfused": ("mosaic", "te_fp8_current"),
    "temoe_fp8_xla": ("mosaic", "te_fp8_current"),
    "te_fp8": ("te", "te_fp8_current"),
    "temoe_bf16": ("mosaic", "te_no_quant"),
    "tokamax_bf16": ("tokamax", "te_no_quant"),
}
QUANT = {"temoe_fp8_xla": "xla"}  # fp8_quant's cast-transpose per path (default: its DEFAULT_IMPL)
TOKENS_SCALINGS = {  # mosaic_tokens.SCALINGS per path (default: its default, both FP8 scalings)
    "temoe_fp8_blockwise_unfused": (),  # dispatch -> bf16 buffer -> mosaic.mlp
    "temoe_fp8_unfused": (),
}
DIVIDE = {"temoe_fp8_blockwise_divide"}  # fp8_block's quantizers as before RECIPROCAL / AMAX_IN_INPUT_DTYPE


def tokamax_mlp(ctx, x, p, wi, wo, biases, rows_expert):
  """Stock MaxText's expert GEMMs (`use_tokamax_gmm=true`: tokamax.ragged_dot, implementation
  "mosaic", bf16) behind the expert-kernel contract, so dispatch and combine are the same."""
  import tokamax  # pylint: disable=import-outside-toplevel

  def gmm(a, w):
    return tokamax.ragged_dot(a, w, p.padded_group_sizes, precision=jax.lax.Precision.DEFAULT,
                              preferred_element_type=ctx.dtype, implementation="mosaic")

  return parts.gated_mlp(ctx, x, wi, wo, biases, rows_expert, gmm)


def skewed_routing(key, experts: int, tokens: int, top_k: int, skew: float = 1.2):
  """Top-k distinct experts per token from a Zipf-like popularity."""
  logits = -skew * jnp.log1p(jnp.arange(experts, dtype=jnp.float32))
  gumbel = jax.random.gumbel(key, (tokens, experts))
  _, ids = jax.lax.top_k(logits + gumbel, top_k)
  weights = jax.nn.softmax(jax.random.normal(jax.random.fold_in(key, 1), (tokens, top_k)), axis=-1)
  return ids.astype(jnp.int32), weights


def timed(fn, *args, iters: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def context(kernel: str, recipe: str, experts: int, top_k: int) -> MoEContext:
  align = 1 if kernel == "tokamax" else recipes.row_alignment(recipe, kernel)
  # the layer runs under no jax.checkpoint here: its backward reads the forward's FP8 weight copies, as the
  # adapter has it for an unscanned layer without remat (temoe.maxtext.adapter.fp8_weights)
  return MoEContext(num_experts=experts, top_k=top_k, dtype=jnp.bfloat16, recipe=recipe, kernel=kernel, align=align,
                    fp8_weights="device")


def mlp_of(ctx: MoEContext):
  return tokamax_mlp if ctx.kernel == "tokamax" else block.expert_kernel(ctx.kernel).mlp


def layer_of(ctx: MoEContext, ids, weights):
  """layer(x, wi, wo) -> out (tokens, emb): dispatch -> the path's expert MLP -> combine, or the kernel's
  MLP from tokens where it offers one (block.tokens_mlp: the recipes in mosaic_tokens.SCALINGS)."""
  mlp = mlp_of(ctx)
  none = (None, None, None)

  def layer(x, wi, wo):
    p = dispatch.plan(ids, ctx.num_experts, ctx.align)
    fused = None if ctx.kernel == "tokamax" else block.tokens_mlp(ctx, wi, wo, none)
    if fused:
      return fused(x, p, weights)
    return dispatch.combine(mlp(ctx, dispatch.dispatch(x, p, ctx.top_k), p, wi, wo, none, None), p, weights)

  return layer


def layer_fwdbwd(ctx: MoEContext, ids, weights):
  layer = layer_of(ctx, ids, weights)

  def loss(x, wi, wo, cot):
    return jnp.sum(layer(x, wi, wo).astype(jnp.float32) ** 2 * cot)  # quadratic: every forward GEMM stays live

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def layer_vjp(ctx: MoEContext, ids, weights):
  """(out, dx, dwi, dwo) of the layer for the cotangent `cot`: what the errors compare."""
  layer = layer_of(ctx, ids, weights)

  def run(x, wi, wo, cot):
    out, vjp = jax.vjp(layer, x, wi, wo)
    return (out, *vjp(cot.astype(out.dtype)))

  return jax.jit(run)


def float32_layer_vjp(ids, weights, experts: int, top_k: int, capacity: int):
  """(out, dx, dwi, dwo) of the same layer in float32 (HIGHEST precision dots): each expert's rows
  gathered into a (experts, capacity, .) block, so the expert MLP is two batched dense dots."""

  def layer(x, wi, wo):
    p = dispatch.plan(ids, experts, 1)
    rows = dispatch.dispatch(x, p, top_k)
    starts = jnp.cumsum(p.group_sizes) - p.group_sizes
    slot = starts[:, None] + jnp.arange(capacity)[None, :]
    valid = jnp.arange(capacity)[None, :] < p.group_sizes[:, None]
    xb = jnp.where(valid[..., None], rows[jnp.minimum(slot, rows.shape[0] - 1)], 0.0)
    h = jnp.einsum("gck,gkn->gcn", xb, wi, precision=jax.lax.Precision.HIGHEST)
    gate, up = parts.split_gate_up(h)
    yb = jnp.einsum("gcf,gfe->gce", swiglu(gate, up), wo, precision=jax.lax.Precision.HIGHEST)
    y = jnp.zeros((rows.shape[0] + 1, yb.shape[-1]), jnp.float32).at[jnp.where(valid, slot, rows.shape[0])].set(yb)
    return dispatch.combine(y[:-1], p, weights)

  def run(x, wi, wo, cot):
    out, vjp = jax.vjp(layer, x, wi, wo)
    return (out, *vjp(cot))

  return jax.jit(run)


def rel_l2(a, ref) -> float:
  a, ref = a.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.linalg.norm(a - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def gemm_fwd(ctx: MoEContext, ids):
  """One grouped GEMM of the path alone, forward, on the dispatched layout of `ids`."""
  if ctx.kernel == "tokamax":
    import tokamax  # pylint: disable=import-outside-toplevel

    def gmm(a, w, sizes):
      return tokamax.ragged_dot(a, w, sizes, preferred_element_type=ctx.dtype, implementation="mosaic")
  elif ctx.kernel == "te":
    from temoe.moe.experts import te  # pylint: disable=import-outside-toplevel

    def gmm(a, w, sizes):
      return te.grouped_matmul(a, w, dispatch.covering_group_sizes(sizes, a.shape[0]), ctx.recipe, ctx.dtype)
  elif ctx.kernel == "mosaic":
    from temoe.moe.experts import mosaic_gemm  # pylint: disable=import-outside-toplevel

    def gmm(a, w, sizes):
      return mosaic_gemm.grouped_matmul(a, w, sizes, scaling=recipes.REGISTRY[ctx.recipe].scaling)
  else:
    raise ValueError(f"per-GEMM timing covers tokamax, te and mosaic, not {ctx.kernel}")

  def run(a, w):
    p = dispatch.plan(ids, ctx.num_experts, ctx.align)
    rows = jnp.zeros((p.buffer_rows, a.shape[1]), a.dtype).at[p.slots].set(a[: p.routed_rows])
    return gmm(rows, w, p.padded_group_sizes)

  return jax.jit(run)


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


def error_text(exc: Exception) -> str:
  lines = [l for l in str(exc).splitlines() if l.strip()]
  return f"{type(exc).__name__}: {(lines[0] if lines else '')[:300]}"


def measure_shape(name: str, iters: int, per_gemm: bool = True, paths=tuple(PATHS), trace: str = "",
                  errors: bool = False) -> dict:
  hidden, ffn, experts, tokens, top_k = SHAPES[name]
  key = jax.random.key(0)
  ids, weights = skewed_routing(key, experts, tokens, top_k)
  loads = jnp.bincount(ids.reshape(-1), length=experts)
  rows = tokens * top_k
  kx, kw, ko, kc = jax.random.split(jax.random.fold_in(key, 7), 4)
  x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16)
  wi = (jax.random.normal(kw, (experts, hidden, 2 * ffn), jnp.float32) * hidden**-0.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(ko, (experts, ffn, hidden), jnp.float32) * ffn**-0.5).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, (tokens, hidden), jnp.float32)
  gate_up, down = 2 * rows * hidden * 2 * ffn, 2 * rows * ffn * hidden
  useful = 3 * (gate_up + down)  # fwd + 2x bwd
  out = {
      "hidden": hidden, "expert_ffn": ffn, "experts": experts, "tokens": tokens, "top_k": top_k,
      "load_max_over_mean": float(loads.max() / loads.mean()), "empty_experts": int((loads == 0).sum()),
      "useful_tflop_per_iter": useful / 1e12, "per_gemm_fwd_tflops": {},
  }
  default_quant, fused_default = fp8_quant.DEFAULT_IMPL, mosaic_tokens.SCALINGS
  block_flags = fp8_block.RECIPROCAL, fp8_block.AMAX_IN_INPUT_DTYPE
  if errors:  # the float32 layer on the same routing and the same (bf16-valued) inputs
    ref = float32_layer_vjp(ids, weights, experts, top_k, int(loads.max()))(*(a.astype(jnp.float32) for a in (x, wi, wo, cot)))
    out["errors"] = {}
  for path in paths:
    kernel, recipe = PATHS[path]
    ctx = context(kernel, recipe, experts, top_k)
    fp8_quant.DEFAULT_IMPL = QUANT.get(path, default_quant)  # both read when the path is traced
    mosaic_tokens.SCALINGS = frozenset(TOKENS_SCALINGS.get(path, mosaic_tokens.DEFAULT_SCALINGS))
    fp8_block.RECIPROCAL, fp8_block.AMAX_IN_INPUT_DTYPE = (False, False) if path in DIVIDE else block_flags
    try:
      fn = layer_fwdbwd(ctx, ids, weights)
      seconds = timed(fn, x, wi, wo, cot, iters=iters)
      if trace:
        with jax.profiler.trace(os.path.join(trace, f"{name}.{path}")):
          for _ in range(3):
            jax.block_until_ready(fn(x, wi, wo, cot))
      out[f"{path}_fwdbwd_tflops"] = useful / seconds / 1e12
      out[f"{path}_fwdbwd_ms"] = seconds * 1e3
      if errors:
        got = layer_vjp(ctx, ids, weights)(x, wi, wo, cot)
        out["errors"][path] = {k: rel_l2(g, r) for k, g, r in zip(("y", "dx", "dwi", "dwo"), got, ref)}
        del got
      if per_gemm:
        h = jax.random.normal(kx, (rows, ffn), jnp.bfloat16)
        xr = jnp.repeat(x, top_k, axis=0)
        out["per_gemm_fwd_tflops"][path] = {
            "gate_up": gate_up / timed(gemm_fwd(ctx, ids), xr, wi, iters=iters) / 1e12,
            "down": down / timed(gemm_fwd(ctx, ids), h, wo, iters=iters) / 1e12,
        }
    except Exception as exc:  # pylint: disable=broad-exception-caught
      out[f"{path}_error"] = error_text(exc)
    print(name, path, {k: v for k, v in out.items() if k.startswith(path)}, out["per_gemm_fwd_tflops"].get(path),
          out.get("errors", {}).get(path), flush=True)
  fp8_quant.DEFAULT_IMPL, mosaic_tokens.SCALINGS = default_quant, fused_default
  fp8_block.RECIPROCAL, fp8_block.AMAX_IN_INPUT_DTYPE = block_flags
  xd = jax.random.normal(kx, (rows, hidden), jnp.bfloat16)
  wd = (jax.random.normal(kw, (hidden, 2 * ffn), jnp.float32) * hidden**-0.5).astype(jnp.bfloat16)
  cd = jax.random.normal(kc, (rows, 2 * ffn), jnp.float32)
  for ceiling, fp8 in (("fp8_dense_ceiling", True), ("bf16_dense_ceiling", False)):
    try:
      out[f"{ceiling}_tflops"] = 3 * gate_up / timed(dense_fwdbwd(fp8), xd, wd, cd, iters=iters) / 1e12
    except Exception as exc:  # pylint: disable=broad-exception-caught
      out[f"{ceiling}_error"] = error_text(exc)
  for path in PATHS:
    if f"{path}_fwdbwd_tflops" in out:
      if "fp8_dense_ceiling_tflops" in out:
        out[f"{path}_over_fp8_ceiling"] = out[f"{path}_fwdbwd_tflops"] / out["fp8_dense_ceiling_tflops"]
      if "tokamax_bf16_fwdbwd_tflops" in out:
        out[f"{path}_over_tokamax"] = out[f"{path}_fwdbwd_tflops"] / out["tokamax_bf16_fwdbwd_tflops"]
  return out


def plot(result: dict, path: str) -> None:
  names = list(result["shapes"])
  series = {}
  for s in [*PATHS, "fp8_dense_ceiling", "bf16_dense_ceiling"]:
    key = f"{s}_tflops" if "ceiling" in s else f"{s}_fwdbwd_tflops"
    series[s] = [result["shapes"][n].get(key, 0) for n in names]
  plots.grouped_bars(path, names, series, "useful TFLOP/s, fwd+bwd",
                     f"MoE layer (dispatch + expert MLP + combine), {result['device']}")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="bench/results")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--paths", default=",".join(PATHS))
  parser.add_argument("--no-per-gemm", action="store_true", help="the layer only (bench/mosaic_gemm.py sweeps GEMMs)")
  parser.add_argument("--trace", default="", help="also write a profiler trace of 3 iterations per path here")
  parser.add_argument("--errors", action="store_true", help="each path's output and gradients against float32")
  args = parser.parse_args()
  result = {
      "command": " ".join(["python", "bench/moe_layer.py", *sys.argv[1:]]),
      "device": jax.devices()[0].device_kind,
      "shapes": {},
  }
  os.makedirs(args.out, exist_ok=True)
  for name in args.shapes.split(","):
    result["shapes"][name] = measure_shape(name, args.iters, not args.no_per_gemm, args.paths.split(","), args.trace,
                                           args.errors)
    with open(os.path.join(args.out, "moe_layer.json"), "w", encoding="utf-8") as f:  # after every shape
      json.dump(result, f, indent=1)
  plot(result, os.path.join(args.out, "moe_layer.png"))
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
