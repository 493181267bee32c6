"""Model FLOPs of a MoE training step, and MFU against the GPU's peak for the recipe in use.

Why not only MaxText's figure (`perf/per_device_tflops`, `calculate_tflops_training_per_device`):
MFU needs the FLOPs split by precision (temoe's FP8 recipes quantize the routed-expert GEMMs
only), and MaxText's count has two gaps. Convention (MaxText's, Megatron's): matmul FLOPs only,
training = 3x forward (backward = 2x), no remat recompute, dropless routing with exactly top_k
rows per token (FP8 alignment padding is not useful work), the embedding lookup is a gather (0).
Per token, forward: 2 x active matmul parameters (MLA q_a/q_b/kv_a/kv_b/out with their real
shapes, dense MLPs, shared experts, top_k routed experts, router gate, logits) + causal attention
scores and values. Differences from MaxText's figure, which `test_flops.py` asserts exactly:
  1. causal attention: query i attends i+1 keys, T(T+1)/2 pairs per sequence; MaxText counts
     T^2/2 (half of dense, Megatron's convention), so it is lower by 3 x heads x (qk_dim + v_dim)
     FLOPs per token and attention layer (1/(T+1) of the attention term);
  2. multi-token prediction (mtp_num_layers > 0): MaxText leaves out each MTP module's
     projection (2*emb -> emb) and its logits (shared weights still cost FLOPs).
"""

from __future__ import annotations

import dataclasses
import sys

from temoe import hardware, oneline
from temoe.tools import model_size

MODELLED_BLOCKS = ("deepseek", "mixtral", "qwen3_moe", "mistral", "llama2", "qwen3")
"""Decoder blocks whose layers are (MLA or GQA attention) + (dense MLP or MoE) and nothing else."""

PEAK_TFLOPS = {g.name.upper(): (g.bf16_tflops, g.fp8_tflops) for g in hardware.GPUS.values()}
"""GPU name -> (bf16, fp8) dense peak TFLOP/s, from temoe.hardware's catalog."""


@dataclasses.dataclass(frozen=True)
class Count:
  """Model FLOPs of one training step on one device, by part (each already x3 for training)."""

  tokens: float  # per device per step (batch x length x gradient accumulation)
  attention_proj: float
  attention_core: float
  dense_mlp: float
  shared_experts: float
  routed_experts: float
  router: float
  logits: float
  mtp_proj: float

  @property
  def total(self) -> float:
    return sum(v for k, v in dataclasses.asdict(self).items() if k != "tokens")

  @property
  def active_matmul_params(self) -> float:
    """Matmul parameters one token passes through (6 FLOPs each per trained token)."""
    return (self.total - self.attention_core) / (6 * self.tokens)

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "total": self.total, "active_matmul_params": self.active_matmul_params}


def _layers(c) -> tuple[int, int, int]:
  """(attention layers, dense-MLP layers, MoE layers), MTP modules included (DeepSeek's are MoE)."""
  block = getattr(c.decoder_block, "value", c.decoder_block)
  if block not in MODELLED_BLOCKS:
    modelled = ", ".join(MODELLED_BLOCKS)
    raise NotImplementedError(f"temoe.tools.flops: decoder_block={block} is not modelled; modelled: {modelled}")
  n = model_size.layers(c)
  if c.num_experts <= 1:
    return n.decoder + n.mtp, n.dense + n.mtp, 0
  return n.decoder + n.mtp, n.dense, n.moe + n.mtp


def _attention(c) -> tuple[int, int]:
  """(projection parameters, qk_dim + v_dim summed over heads) of one attention layer."""
  emb, heads = c.emb_dim, c.num_query_heads
  if c.attention_type == "mla":
    return model_size.mla_matmul_params(c), heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
  kv_heads = c.num_kv_heads * (1 if c.share_kv_projections else 2)
  return emb * (heads + kv_heads) * c.head_dim + heads * c.head_dim * emb, heads * 2 * c.head_dim


def count(c) -> Count:
  """Model FLOPs per training step per device of MaxText config `c` (HyperParameters)."""
  tokens = c.per_device_batch_size * c.max_target_length * c.gradient_accumulation_steps
  train = 6 * tokens  # 2 FLOPs per parameter and token forward, x3 with the backward pass
  attn_layers, dense_layers, moe_layers = _layers(c)
  proj, head_dims = _attention(c)
  mlp = model_size.mlp_params(c, 1)  # parameters per unit of hidden width
  causal_pairs_per_token = (c.max_target_length + 1) / 2
  return Count(
      tokens=tokens,
      attention_proj=train * proj * attn_layers,
      attention_core=train * head_dims * causal_pairs_per_token * attn_layers,
      dense_mlp=train * mlp * c.mlp_dim * dense_layers,
      shared_experts=train * mlp * c.moe_mlp_dim * c.shared_experts * moe_layers,
      routed_experts=train * mlp * c.moe_mlp_dim * c.num_experts_per_tok * moe_layers,
      router=train * c.emb_dim * c.num_experts * moe_layers,
      logits=train * c.emb_dim * c.vocab_size * (1 + c.mtp_num_layers),
      mtp_proj=train * 2 * c.emb_dim * c.emb_dim * c.mtp_num_layers,
  )


def maxtext_tflops(c) -> float:
  """MaxText's own figure for the same step (what it logs as perf/per_device_tflops)."""
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  return introspect.maxtext_tflops(c)


DENSE_FP8_QUANTIZATION = ("te_fp8_currentscaling", "te_mxfp8", "te_fp8_delayedscaling")
"""MaxText's TE recipes for its dense layers (`quantization=`), which run their projections in FP8."""


def fp8_flops(c, n: Count) -> float:
  """FLOPs run in FP8: the routed-expert GEMMs under temoe's FP8 recipes, and the attention projections,
  dense MLPs and shared experts under MaxText's TE FP8 `quantization` (attention's core, the router and
  the logits are counted at bf16)."""
  from temoe import recipes  # pylint: disable=import-outside-toplevel

  moe = getattr(c, "te_moe_block", False) and str(getattr(c, "te_gmm_quantization", "")) in recipes.FP8_RECIPES
  quantization = getattr(c, "quantization", "") or ""
  dense = str(getattr(quantization, "value", quantization)) in DENSE_FP8_QUANTIZATION
  return (n.routed_experts if moe else 0.0) + (n.attention_proj + n.dense_mlp + n.shared_experts if dense else 0.0)


def peak_for(device_kind: str) -> tuple[str, tuple[float, float]] | None:
  """(GPU name, (bf16, fp8) peak TFLOP/s) for a JAX device_kind such as 'NVIDIA H200', or None."""
  gpu = hardware.gpu_of_kind(device_kind)
  return (gpu.name.upper(), PEAK_TFLOPS[gpu.name.upper()]) if gpu else None


def effective_peak(total: float, fp8: float, peak: tuple[float, float]) -> float:
  """FLOP-weighted peak of a mixed step (TFLOP/s): total / the time if every GEMM ran at its own peak.

  So MFU = achieved / effective peak = (bf16 FLOPs / bf16 peak + fp8 FLOPs / fp8 peak) / step time.
  """
  bf16_peak, fp8_peak = peak
  return total / ((total - fp8) / bf16_peak + fp8 / fp8_peak)


def summary(c, device_kind: str | None = None, gpu: str | None = None) -> dict:
  """What the profile and the report record: the count by part, MaxText's figure, the peak used."""
  n = count(c)
  ours, theirs = n.total / 1e12, maxtext_tflops(c)
  fp8 = fp8_flops(c, n)
  found = (gpu.upper(), PEAK_TFLOPS[gpu.upper()]) if gpu else peak_for(device_kind or "")
  return {
      "model_tflops_per_step_per_device": ours,
      "maxtext_tflops_per_step_per_device": theirs,
      "difference_tflops": ours - theirs,
      "fp8_fraction": fp8 / n.total,
      "recipe": str(getattr(c, "te_gmm_quantization", "")) if getattr(c, "te_moe_block", False) else "maxtext",
      "parts_tflops": {k: v / 1e12 for k, v in n.as_dict().items() if k not in ("tokens", "active_matmul_params")},
      "tokens_per_step_per_device": n.tokens,
      "active_matmul_params": n.active_matmul_params,
      "device_kind": device_kind,
      "gpu": found[0] if found else None,
      "peak_tflops": effective_peak(n.total, fp8, found[1]) if found else None,
  }


def gpu_argument(argv: list[str]) -> str | None:
  """Takes `--gpu NAME` (or `--gpu=NAME`) out of `argv`: the catalog name, upper case, or None; InputError
  naming the valid GPUs (as `temoe plan --gpu` and `temoe report --gpu` refuse it)."""
  from temoe.run import inputs  # pylint: disable=import-outside-toplevel

  valid = ", ".join(sorted(k.lower() for k in PEAK_TFLOPS))
  found = [i for i, a in enumerate(argv) if a == "--gpu" or a.startswith("--gpu=")]
  if not found:
    return None
  at = found[-1]
  if "=" in argv[at]:
    name = argv.pop(at).split("=", 1)[1]
  elif at + 1 < len(argv):
    name = argv.pop(at + 1)
    argv.pop(at)
  else:
    raise inputs.InputError(f"argument --gpu: expected one argument; valid choices: {valid}")
  if name.upper() not in PEAK_TFLOPS:
    raise inputs.InputError(f"argument --gpu: invalid choice: {name!r}; valid choices: {valid}")
  return name.upper()


@oneline.guarded("temoe flops")
def main(argv: list[str] | None = None) -> int:
  """`python -m temoe.tools.flops <config.yml> [key=value ...] [--gpu H200]`: the count and MaxText's figure."""
  import json  # pylint: disable=import-outside-toplevel

  from temoe.run import inputs  # pylint: disable=import-outside-toplevel

  argv = list(sys.argv[1:] if argv is None else argv)
  usage = "python -m temoe.tools.flops <config.yml> [key=value ...] [--gpu NAME]"
  try:
    gpu = gpu_argument(argv)
    if not argv:
      raise inputs.InputError(f"usage: {usage}")
    inputs.check_config_file(argv[0])
    inputs.check_settings(argv[1:], usage)
  except inputs.InputError as exc:
    print(f"temoe flops: {exc}", file=sys.stderr)
    return 2
  from temoe import cli  # pylint: disable=import-outside-toplevel
  from temoe.run import preflight  # pylint: disable=import-outside-toplevel

  config, message = cli.config_or_message(["flops", *argv])
  try:
    if config is not None:
      preflight.check_numbers(config)  # a negative batch would count negative FLOPs
  except preflight.PreflightError as exc:
    message = str(exc)
  if message:
    print(f"temoe flops: {message}", file=sys.stderr)
    return 2
  print(json.dumps(summary(config, gpu=gpu), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
