"""temoe's FP8 residuals carry MaxText's `quantization` remat name: its *_with_quantization policies
keep them (instead of quantizing again in the backward) as they keep its own layers', and the memory
plan counts exactly what JAX then saves (traced on CPU; the Mosaic GPU kernels are not run)."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from temoe.moe import dispatch
from temoe.moe.context import MoEContext
from temoe.moe.experts import mosaic, mosaic_gemm, parts
from temoe.tools import hbm_activations

EXPERTS, EMB, FFN, TOKENS, TOP_K = 4, 256, 128, 96, 2


def saved_lines(recipe: str, names: tuple[str, ...], capsys, emb: int = EMB, ffn: int = FFN,
                fp8_weights: str = "remat") -> list[str]:
  ctx = MoEContext(num_experts=EXPERTS, top_k=TOP_K, dtype=jnp.bfloat16, recipe=recipe, kernel="mosaic", align=128,
                   fp8_weights=fp8_weights)
  p = dispatch.plan(jnp.asarray(np.arange(TOKENS * TOP_K).reshape(TOKENS, TOP_K) % EXPERTS, jnp.int32), EXPERTS, 128)

  def layer(x, wi, wo):
    y = mosaic.mlp(ctx, dispatch.dispatch(x, p, TOP_K), p, wi, wo, (None, None, None), None)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  args = (jnp.ones((TOKENS, emb), jnp.bfloat16), jnp.ones((EXPERTS, emb, 2 * ffn), jnp.bfloat16),
          jnp.ones((EXPERTS, ffn, emb), jnp.bfloat16))
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(layer, policy=policy), *args)
  return capsys.readouterr().out.splitlines(), p.buffer_rows


ITEMSIZE = {"f8_e4m3fn": 1, "f8_e5m2": 1, "bf16": 2, "f32": 4}


def nbytes(line: str) -> int:
  dtype, shape = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
  return int(np.prod([int(d) for d in shape.split(",") if d])) * ITEMSIZE[dtype]


@pytest.mark.parametrize("recipe", ["te_fp8_current", "te_fp8_blockwise"])
@pytest.mark.parametrize("emb, ffn", [(EMB, FFN), (192, 320)])  # whole 64s: current keeps them, blockwise pads to 128s
def test_maxtexts_quantization_policies_keep_the_fp8_residuals_the_plan_counts(recipe, emb, ffn, monkeypatch, capsys):
  monkeypatch.setattr(mosaic_gemm, "num_sms", lambda: 4)
  lines, rows = saved_lines(recipe, ("mlpwi_0", "mlpwo", "quantization"), capsys, emb, ffn)
  quantized = [line for line in lines if "named 'quantization'" in line or f"named '{parts.FP8_WEIGHTS}'" in line]
  # the backward's x^T, h^T (and, blockwise, wi and wo as stored: current scaling casts those again from
  # the saved scales) and the recomputed gate/up GEMM's x, wi^T (for its up half), with scales
  fp8, scales = {"te_fp8_current": (4, 4), "te_fp8_blockwise": (6, 5)}[recipe]  # per-expert x scales serve x and x^T
  assert sum("f8_e4m3fn" in line for line in quantized) == fp8 and len(quantized) == fp8 + scales, lines
  config = types.SimpleNamespace(num_experts=EXPERTS, moe_mlp_dim=ffn, te_gmm_quantization=recipe)
  shapes = hbm_activations.Shapes(tokens=TOKENS, batch=1, seq=TOKENS, emb=emb, tp=1, ep=1, act=2)
  planned = sum(t.elements * t.itemsize for t in hbm_activations.quantized_residuals(config, shapes, rows, "mosaic")
                if "quantization" in t.names)  # what this policy keeps of the plan's list
  assert planned == pytest.approx(sum(map(nbytes, quantized)), rel=1e-3)
  without, _ = saved_lines(recipe, ("mlpwi_0", "mlpwo"), capsys, emb, ffn)  # minimal_with_context: quantized again
  assert not [line for line in without if "f8_e4m3fn" in line or "'quantization'" in line]
  assert hbm_activations.quantized_residuals(config, shapes, rows, "xla") == []


SHIPPED_NAMES = ("mlpwi_0", "moe_mlpwi_0", "moe_mlpwi_1", "mlpwo", "moe_mlpwo")
"""The MoE names the shipped proxy's custom policy keeps (configs/deepseek3-proxy-1gpu.yml)."""


@pytest.mark.parametrize("recipe", ["te_fp8_current", "te_fp8_blockwise"])
def test_te_moe_fp8_weights_keeps_the_weights_fp8_copies_alone(recipe, monkeypatch, capsys):
  monkeypatch.setattr(mosaic_gemm, "num_sms", lambda: 4)
  lines, rows = saved_lines(recipe, (*SHIPPED_NAMES, parts.FP8_WEIGHTS), capsys, fp8_weights="device")
  kept = [line for line in lines if f"named '{parts.FP8_WEIGHTS}'" in line]
  # wi and wo as stored (dgrad reads them) and their scales; not wi^T (the gate/up GEMM is not recomputed)
  assert sum("f8_e4m3fn" in line for line in kept) == 2 and len(kept) == 4, lines
  fp8 = sorted(nbytes(line) for line in kept if "f8_e4m3fn" in line)
  assert fp8 == [EXPERTS * EMB * FFN, EXPERTS * EMB * 2 * FFN]
  assert not [line for line in lines if "f8_e4m3fn" in line and line not in kept]  # no activation copy kept
  config = types.SimpleNamespace(num_experts=EXPERTS, moe_mlp_dim=FFN, te_gmm_quantization=recipe)
  shapes = hbm_activations.Shapes(tokens=TOKENS, batch=1, seq=TOKENS, emb=EMB, tp=1, ep=1, act=2)
  weights = [t for t in hbm_activations.quantized_residuals(config, shapes, rows, "mosaic", up_recomputed=False)
             if parts.FP8_WEIGHTS in t.names]
  assert sum(t.elements * t.itemsize for t in weights) == pytest.approx(sum(map(nbytes, kept)), rel=1e-3)
  without, _ = saved_lines(recipe, SHIPPED_NAMES, capsys)  # the shipped policy: quantized again
  assert not [line for line in without if "f8_e4m3fn" in line]


def test_the_weights_scales_are_kept_and_the_backward_casts_the_weights_again(monkeypatch, capsys):
  """Current scaling under the shipped policy plus temoe's scales name (what temoe.maxtext.config adds to
  MaxText's custom lists): the backward keeps the weights' per-expert scales (G floats each) and no FP8
  copy of them (that its gradients are those of the kept copies: test_mosaic_mlp, tests/gpu)."""
  monkeypatch.setattr(mosaic_gemm, "num_sms", lambda: 4)
  lines, _ = saved_lines("te_fp8_current", (*SHIPPED_NAMES, parts.FP8_SCALES), capsys)
  scales = [line for line in lines if f"named '{parts.FP8_SCALES}'" in line]
  assert len(scales) == 2 and all(line.startswith(f"f32[{EXPERTS}]") for line in scales), lines
  assert not [line for line in lines if "f8_e4m3fn" in line]
  without, _ = saved_lines("te_fp8_current", SHIPPED_NAMES, capsys)  # MaxText's named policies: scales recomputed
  assert not [line for line in without if parts.FP8_SCALES in line]


@pytest.mark.parametrize("scan, policy, flag, expected", [
    (True, "none", "remat", "remat"),  # scanned: jax.checkpoint with policy None, everything recomputed
    (False, "none", "remat", "device"),  # no jax.checkpoint at all: the forward's copies are kept anyway
    (False, "custom", "remat", "remat"),
    (True, "custom", "device", "device"),
])
def test_the_adapter_keeps_the_forwards_weight_copies_where_nothing_is_recomputed(scan, policy, flag, expected):
  from temoe.maxtext import adapter  # pylint: disable=import-outside-toplevel

  cfg = types.SimpleNamespace(scan_layers=scan, remat_policy=policy, te_moe_fp8_weights=flag)
  assert adapter.fp8_weights(cfg) == expected
