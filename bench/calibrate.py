"""Calibration for `temoe plan`'s step model (temoe.tools.step_model): what one GPU measures, written to
plugin/temoe/tools/calibrations/<gpu>.json, temoe's package data (`temoe.tools.calibration` reads it; a GPU
without a file is scaled from the H200's and says so).

Measured on the GPU it runs on, each with its command and shapes in the JSON:
  grouped_mlp          one MoE layer (dispatch -> expert MLP -> combine, fwd+bwd) per expert path and shape
                       class, as bench/moe_layer.py times it (its own functions), and the FP8 weight casts
                       of each class (temoe.moe.experts.fp8_quant.quantize_experts);
  grouped_gemm         temoe's grouped GEMM alone per class and recipe, forward
                       (temoe.moe.experts.mosaic_gemm.grouped_matmul, as moe_layer.gemm_fwd calls it);
  dense_gemm_tflops    dense GEMMs fwd+bwd at DeepSeek-V3's projection, MLP and logits shapes: bf16 (XLA)
                       and FP8 (TE current scaling, what MaxText's te_fp8_currentscaling runs);
  attention_core_tflops  causal attention fwd+bwd at the MLA shape (128 heads, qk 192, v 128 padded to 192):
                       cuDNN through jax.nn.dot_product_attention (stand-in for TE's cudnn_flash_te, which
                       calls cuDNN's fused attention) and the Pallas GPU flash attention MaxText's
                       `autoselected` ran on the H200 (its profile's pallas_flash_attention ops);
  elementwise_tbps     HBM bandwidth of a bf16 amax reduction over the MoE layer's operands (the kind of op
                       the derived H200 file has), a copy for comparison;
  optimizer_tbps       optax AdamW over a flat bf16 parameter vector, bytes per second;
then `fitted`, the constants no micro-benchmark gives, fitted to the committed H200 profile of the shipped
proxy (bench/results/profile/temoe_fp8.json) when the GPU is an H200, else copied from the H200 file (said so).

    python bench/calibrate.py [--out plugin/temoe/tools/calibrations] [--iters 10]   # on a GPU
    python bench/calibrate.py --smoke --out DIR     # CPU, tiny shapes: every measurement runs, nothing is kept
    python bench/calibrate.py --derive              # the H200 file from numbers already under bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
CALIBRATIONS = HERE.parent / "plugin" / "temoe" / "tools" / "calibrations"
"""Where `temoe.tools.calibration` reads the rates: temoe's package data (a wheel and the image carry it)."""
sys.path.insert(0, str(HERE))

DSV3 = {"emb": 7168, "q_lora": 1536, "kv_lora": 512, "rope": 64, "heads": 128, "nope": 128, "v": 128, "mlp": 18432,
        "vocab": 129280}
DENSE_ROLES = {  # role -> (K, N) of DeepSeek-V3's dense GEMMs; each appears once per layer (logits once per step)
    "q_a": (7168, 1536), "q_b": (1536, 128 * 192), "kv_a": (7168, 576), "kv_b": (512, 128 * 256),
    "out": (128 * 128, 7168), "mlp_up": (7168, 2 * 18432), "mlp_down": (18432, 7168), "logits": (7168, 129280),
}
SMOKE_ROLES = {"q_a": (128, 64), "out": (128, 128), "mlp_up": (128, 256)}
PATHS = ("temoe_fp8", "te_fp8", "temoe_bf16", "tokamax_bf16")


def timed(fn, *args, iters: int) -> float:
  import moe_layer  # pylint: disable=import-outside-toplevel

  return moe_layer.timed(fn, *args, iters=iters)


def error_text(exc: Exception) -> str:
  import moe_layer  # pylint: disable=import-outside-toplevel

  return moe_layer.error_text(exc)


# --- measurements -----------------------------------------------------------------------------------


def grouped(shapes: dict, paths, iters: int) -> dict:
  """path -> class -> the layer's fwd+bwd ms and its FP8 weight casts, as bench/moe_layer.py measures them."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import moe_layer  # pylint: disable=import-outside-toplevel

  from temoe.moe.experts import fp8_quant as fq  # pylint: disable=import-outside-toplevel

  out = {}
  for name, (hidden, ffn, experts, tokens, top_k) in shapes.items():
    moe_layer.SHAPES.setdefault(name, (hidden, ffn, experts, tokens, top_k))
    row = moe_layer.measure_shape(name, iters, per_gemm=False, paths=tuple(paths))
    wi = jnp.ones((experts, hidden, 2 * ffn), jnp.bfloat16)
    wo = jnp.ones((experts, ffn, hidden), jnp.bfloat16)
    casts = {}
    for impl in ("triton", "xla"):
      try:
        fn = jax.jit(lambda a, impl=impl: fq.quantize_experts(a, fq.E4M3, impl))
        casts[impl] = (timed(fn, wi, iters=iters) + timed(fn, wo, iters=iters)) * 1e3
      except Exception as exc:  # pylint: disable=broad-exception-caught
        casts[f"{impl}_error"] = error_text(exc)
    for path in paths:
      ms = row.get(f"{path}_fwdbwd_ms")
      if ms is None:
        out.setdefault(path, {})[f"{name}_error"] = row.get(f"{path}_error", "not measured")
        continue
      cast = casts.get("triton" if path == "temoe_fp8" else "xla", 0.0) if "fp8" in path else 0.0
      out.setdefault(path, {})[name] = {
          "hidden": hidden, "expert_ffn": ffn, "experts": experts, "tokens": tokens, "top_k": top_k,
          "layer_ms": ms, "weight_cast_ms": cast, "load_max_over_mean": row["load_max_over_mean"],
          "source": "bench/moe_layer.py measure_shape (skewed routing); weight casts fp8_quant.quantize_experts"
                    + (" (XLA cast, as a stand-in for TE's)" if path == "te_fp8" else "")}
  return out


def grouped_gemm(shapes: dict, iters: int) -> dict:
  """temoe's grouped GEMM alone, forward, per class and recipe (its row scatter included, as moe_layer.gemm_fwd)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import moe_layer  # pylint: disable=import-outside-toplevel

  out = {}
  for name, (hidden, ffn, experts, tokens, top_k) in shapes.items():
    ids, _ = moe_layer.skewed_routing(jax.random.key(0), experts, tokens, top_k)
    rows = tokens * top_k
    x = jax.random.normal(jax.random.key(1), (rows, hidden), jnp.bfloat16)
    wi = jax.random.normal(jax.random.key(2), (experts, hidden, 2 * ffn), jnp.bfloat16)
    for recipe in ("te_fp8_current", "te_no_quant"):
      key = f"{name}/{recipe}"
      try:
        fn = moe_layer.gemm_fwd(moe_layer.context("mosaic", recipe, experts, top_k), ids)
        seconds = timed(fn, x, wi, iters=iters)
        out[key] = {"gate_up_fwd_tflops": 2 * rows * hidden * 2 * ffn / seconds / 1e12, "ms": seconds * 1e3}
      except Exception as exc:  # pylint: disable=broad-exception-caught
        out[key] = {"error": error_text(exc)}
  return out


def dense(roles: dict, tokens: int, iters: int) -> dict:
  """Dense GEMMs fwd+bwd per role and dtype (moe_layer.dense_fwdbwd: XLA bf16, TE FP8 current scaling);
  the value per dtype is all roles' FLOPs over their time (each role once, as in one DeepSeek-V3 layer)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import moe_layer  # pylint: disable=import-outside-toplevel

  out = {}
  for dtype, fp8 in (("bf16", False), ("fp8", True)):
    per, flops, seconds = {}, 0.0, 0.0
    for role, (k, n) in roles.items():
      x = jax.random.normal(jax.random.key(0), (tokens, k), jnp.bfloat16)
      w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
      cot = jax.random.normal(jax.random.key(2), (tokens, n), jnp.float32)
      try:
        s = timed(moe_layer.dense_fwdbwd(fp8), x, w, cot, iters=iters)
      except Exception as exc:  # pylint: disable=broad-exception-caught
        per[role] = {"error": error_text(exc)}
        continue
      f = 6 * tokens * k * n
      per[role] = {"k": k, "n": n, "tflops": f / s / 1e12}
      flops, seconds = flops + f, seconds + s
    out[dtype] = {"value": flops / seconds / 1e12, "roles": per, "tokens": tokens,
                  "source": "bench/moe_layer.py dense_fwdbwd per role"} if seconds else {"error": per}
  return out


def attention(batch: int, seq: int, heads: int, dim: int, iters: int) -> dict:
  """Causal attention fwd+bwd per kernel; TFLOP/s count the MLA core as temoe.tools.flops does
  (qk 192 + v 128 per head, causal pairs), the kernels run v at the qk width (they take one head dim)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  q, k, v = (jax.random.normal(jax.random.key(i), (batch, seq, heads, dim), jnp.bfloat16) for i in range(3))
  useful = 6 * batch * seq * (seq + 1) / 2 * heads * (dim + dim * 2 // 3)  # qk dim + v dim (192 + 128 at full size)

  def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

  def pallas_flash(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # pylint: disable=import-outside-toplevel

    return pallas_attention.mha(q, k, v, None, sm_scale=dim**-0.5, causal=True)

  def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

  out = {}
  for name, fn, stands_for in (("cudnn_flash_te", cudnn, "jax.nn.dot_product_attention(implementation='cudnn')"),
                               ("autoselected", pallas_flash, "jax.experimental.pallas.ops.gpu.attention.mha"),
                               ("dot_product", xla, "jax.nn.dot_product_attention(implementation='xla')")):
    step = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    try:
      seconds = timed(step, q, k, v, iters=iters)
      out[name] = {"value": useful / seconds / 1e12, "ms": seconds * 1e3, "stand_in": stands_for,
                   "shape": [batch, seq, heads, dim]}
    except Exception as exc:  # pylint: disable=broad-exception-caught
      out[f"{name}_error"] = error_text(exc)
  return out


def bandwidth(shapes: list[tuple[int, ...]], iters: int) -> dict:
  """TB/s of a bf16 amax reduction (bytes read / time) over `shapes`, and of a scaled copy (read + write)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  read, reduce_s, copy_s = 0, 0.0, 0.0
  amax = jax.jit(lambda a: jnp.max(jnp.abs(a)))
  scale = jax.jit(lambda a: a * 2)
  for shape in shapes:
    a = jnp.ones(shape, jnp.bfloat16)
    read += a.size * 2
    reduce_s += timed(amax, a, iters=iters)
    copy_s += timed(scale, a, iters=iters)
  return {"value": read / reduce_s / 1e12, "copy_tbps": 2 * read / copy_s / 1e12, "shapes": [list(s) for s in shapes],
          "source": "bench/calibrate.py bandwidth: bf16 amax (read only) over the MoE layer's operand shapes; copy: a * 2"}


def optimizer(params: int, iters: int) -> dict:
  """optax AdamW over `params` bf16 parameters (bf16 moments): bytes (p, g read; p written; mu, nu read and
  written) per second."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  opt = optax.adamw(1e-4, mu_dtype=jnp.bfloat16)
  p = jnp.ones((params,), jnp.bfloat16)
  g = jnp.full((params,), 1e-3, jnp.bfloat16)
  state = opt.init(p)

  @jax.jit
  def update(p, g, state):
    u, state = opt.update(g, state, p)
    return optax.apply_updates(p, u), state

  seconds = timed(update, p, g, state, iters=iters)
  moved = params * (3 * 2 + 4 * 2)
  return {"value": moved / seconds / 1e12, "params": params, "params_per_s": params / seconds,
          "source": "bench/calibrate.py optimizer: optax.adamw (bf16 params and moments) update + apply"}


# --- the H200 file from committed results ------------------------------------------------------------


def read(name: str) -> dict:
  return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def derived_measurements() -> dict:
  """The measured part of the H200 calibration from files under bench/results, each value naming its file."""
  layer = read("moe_layer.json")  # the one call with every path and both dense ceilings
  quant = read("fp8_quant.call1.json")["shapes"]  # the only call that cast the weights
  dsv3_weights = quant["dsv3"]["wi"]["shape"][0] * 3 * 7168 * 2048  # wi + wo elements, 32 experts

  def weight_cast(path: str, row: dict) -> tuple[float, str]:
    if "fp8" not in path:
      return 0.0, ""
    key = "triton_64x128_ms" if path == "temoe_fp8" else "xla_ms"  # the shipped Triton block; XLA's for TE
    ms = quant["dsv3"]["wi"][key] + quant["dsv3"]["wo"][key]
    scale = row["experts"] * 3 * row["hidden"] * row["expert_ffn"] / dsv3_weights
    how = "" if scale == 1 else f", scaled by weight elements ({scale:.3f}x) from dsv3's"
    return ms * scale, f"; weight casts fp8_quant.call1.json dsv3 wi+wo {key}{how}"

  classes = {}
  for path in PATHS:
    for shape, row in layer["shapes"].items():
      if f"{path}_fwdbwd_ms" not in row:
        continue
      cast, cast_source = weight_cast(path, row)
      classes.setdefault(path, {})[shape] = {
          "hidden": row["hidden"], "expert_ffn": row["expert_ffn"], "experts": row["experts"], "tokens": row["tokens"],
          "top_k": row["top_k"], "layer_ms": row[f"{path}_fwdbwd_ms"], "weight_cast_ms": cast,
          "source": f"moe_layer.json shapes.{shape}.{path}_fwdbwd_ms{cast_source}"}
  ops = [quant["dsv3"][op] for op in ("x", "dy_gate_up", "h", "dy_down", "wi", "wo")]
  read_bytes = sum(o["bytes_moved_min"] / 2 for o in ops)  # bytes_moved_min = bf16 read + two FP8 writes
  amax_s = sum(o["amax_ms"] for o in ops) / 1e3
  dsv3 = layer["shapes"]["dsv3"]
  return {
      "grouped_mlp": classes,
      "dense_gemm_tflops": {
          "bf16": {"value": dsv3["bf16_dense_ceiling_tflops"], "source": "moe_layer.json shapes.dsv3.bf16_dense_ceiling_tflops "
                   "(XLA, 65,536 x 7,168 x 4,096 fwd+bwd)"},
          "fp8": {"value": dsv3["fp8_dense_ceiling_tflops"], "source": "moe_layer.json shapes.dsv3.fp8_dense_ceiling_tflops "
                  "(TE dense, FP8 current scaling, casts included)"}},
      "attention_core_tflops": {},
      "elementwise_tbps": {"value": read_bytes / amax_s / 1e12,
                           "source": "fp8_quant.call1.json dsv3 amax_ms of x, dy_gate_up, h, dy_down, wi, wo "
                                     "(bf16 bytes read / time)"},
  }


def fit_h200(data: dict) -> dict:
  """`fitted` from the committed H200 profiles: the shipped proxy's (temoe_fp8) for every constant, and
  the stock tokamax proxy's for the `autoselected` attention core."""
  from temoe import hardware  # pylint: disable=import-outside-toplevel
  from temoe.tools import step_model  # pylint: disable=import-outside-toplevel

  gpu = hardware.GPUS["h200"]
  variants = read("proxy_1gpu.variants.json")["paths"]
  run2 = read("proxy_1gpu.run2-allpaths.json")["paths"]
  fitted = step_model.fit_profile(
      data, gpu, proxy_job("temoe_fp8", "proxy_1gpu.variants.json"), read("profile/temoe_fp8.json"),
      variants["temoe_fp8"]["step_time_s"],
      ["bench/results/profile/temoe_fp8.json", "bench/results/proxy_1gpu.variants.json paths.temoe_fp8.step_time_s "
       "(the profile's device call)"], ["temoe_fp8"])
  return step_model.fit_profile(
      {**data, "fitted": fitted}, gpu, proxy_job("tokamax_gmm", "proxy_1gpu.run2-allpaths.json"),
      read("profile/tokamax_gmm.json"),
      run2["tokamax_gmm"]["step_time_s"], ["bench/results/profile/tokamax_gmm.json",
                                           "bench/results/proxy_1gpu.run2-allpaths.json paths.tokamax_gmm.step_time_s"],
      ["tokamax_gmm"], core_only=True)


def proxy_job(path: str, measured_in: str | None = None):
  """The step model's job for bench/proxy_1gpu.py's path `path`, planned here for one H200 (with the config
  as result file `measured_in` ran it: proxy_1gpu.as_measured)."""
  import proxy_1gpu  # pylint: disable=import-outside-toplevel

  from temoe.tools import plan, step_model  # pylint: disable=import-outside-toplevel

  args = proxy_1gpu.args_of(path, measured_in=measured_in)
  p = plan.make_plan(args[0], args[1:], gpu="h200", hbm_gib=141)
  ici, dcn = plan.mesh_split(p.config, 1)
  return step_model.job_of(p.config, ici, dcn, 1, p.backend, p.quantization, p.estimate)


# --- main --------------------------------------------------------------------------------------------


SECTIONS = ("grouped_mlp", "grouped_gemm", "dense_gemm_tflops", "attention_core_tflops", "elementwise_tbps",
            "optimizer_tbps")


def measurements(smoke: bool, iters: int) -> dict:
  """section -> a function measuring it (full-size shapes on a GPU; tiny ones with --smoke)."""
  if smoke:
    import moe_layer  # pylint: disable=import-outside-toplevel
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

    from temoe.moe.experts import mosaic_gemm  # pylint: disable=import-outside-toplevel

    moe_layer.PATHS.setdefault("xla_bf16", ("xla", "te_no_quant"))  # the reference kernel: what CPU runs
    mosaic_gemm.num_sms = lambda: 4  # a CPU device reports no SMs
    shapes = {"smoke": (128, 128, 4, 64, 2)}

    def interpreted_gemm():
      with plgpu.force_gpu_interpret_mode():
        return grouped_gemm(shapes, iters)

    return {"grouped_mlp": lambda: grouped(shapes, ("xla_bf16",), iters), "grouped_gemm": interpreted_gemm,
            "dense_gemm_tflops": lambda: dense(SMOKE_ROLES, 64, iters),
            "attention_core_tflops": lambda: attention(1, 64, 2, 48, iters),
            "elementwise_tbps": lambda: bandwidth([(256, 128)], iters), "optimizer_tbps": lambda: optimizer(1 << 12, iters)}
  shapes = {"dsv3": (7168, 2048, 32, 8192, 8), "dsv3_ep8": (7168, 2048, 8, 8192, 2),
            "dsv3_ep64": (7168, 2048, 4, 32768, 1),  # one EP-64 rank: 4 local experts, 4096 x 8 rows
            "qwen3_30b_a3b": (2048, 768, 128, 8192, 8)}
  operand_shapes = [(69632, 7168), (69632, 4096), (69632, 2048), (32, 7168, 4096), (32, 2048, 7168)]
  return {"grouped_mlp": lambda: grouped(shapes, PATHS, iters), "grouped_gemm": lambda: grouped_gemm(shapes, iters),
          "dense_gemm_tflops": lambda: dense(DENSE_ROLES, 8192, iters),
          "attention_core_tflops": lambda: attention(1, 4096, 128, 192, iters),
          "elementwise_tbps": lambda: bandwidth(operand_shapes, iters), "optimizer_tbps": lambda: optimizer(1 << 30, iters)}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(CALIBRATIONS))
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CPU: the test suite)")
  parser.add_argument("--derive", action="store_true", help="the H200 file from committed bench/results, no device")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help="measure these sections only, into the existing file if there is one (a long run in parts)")
  args = parser.parse_args()
  sections = args.sections.split(",")
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    parser.error(f"--sections {','.join(unknown)}: valid choices: {', '.join(SECTIONS)}")
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  command = " ".join(["python", "bench/calibrate.py", *sys.argv[1:]])
  if args.derive:
    data = {"gpu": "h200", "device_kind": "NVIDIA H200", "origin": "derived", "command": command,
            "note": ("Derived: every measured number comes from a file already committed under bench/results (named in "
                     "its source), none from a calibrate.py run. Attention core rates are fitted (no attention "
                     "micro-benchmark was run). Replace with `python bench/calibrate.py` on an H200."),
            **derived_measurements()}
    data["fitted"] = fit_h200(data)
    name = "h200"
  else:
    import jax  # pylint: disable=import-outside-toplevel

    from temoe import hardware  # pylint: disable=import-outside-toplevel

    device = jax.devices()[0]
    gpu = hardware.gpu_of_kind(device.device_kind)
    name = "smoke" if args.smoke else (gpu.name if gpu else device.device_kind.replace(" ", "_").lower())
    path = pathlib.Path(args.out) / f"{name}.json"
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    kept = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and args.sections != ",".join(SECTIONS) else {}
    data = {**kept, "gpu": gpu.name if gpu else name, "device_kind": device.device_kind, "origin": "measured",
            "commands": [*kept.get("commands", []), command]}
    for section, measure in measurements(args.smoke, args.iters).items():
      if section in sections:
        started = time.time()
        data[section] = measure()
        data.setdefault("seconds", {})[section] = time.time() - started
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")  # after every section
    missing = [s for s in SECTIONS if s not in data]
    if args.smoke or missing:
      data["fitted"] = {"note": f"not fitted: {'a smoke run' if args.smoke else 'sections missing: ' + ', '.join(missing)}"}
    elif data["gpu"] == "h200":
      data["fitted"] = fit_h200(data)
    else:
      reference = json.loads((CALIBRATIONS / "h200.json").read_text(encoding="utf-8"))
      data["fitted"] = {**reference["fitted"], "note": "copied from h200.json: no profile of this GPU is committed"}
  path = pathlib.Path(args.out) / f"{name}.json"
  pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
  print(f"calibrate: wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
