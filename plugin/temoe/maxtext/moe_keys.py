"""Every MoE-affecting key of MaxText 0.2.5's config, classified for te_moe_block=true.

Which keys: the fields of MaxText's "Mixture of Experts" schema sections (`MoEGeneral`,
`MoEKernels`, `DeepSeekMoE`, `Qwen3Next`) plus every `MaxTextConfig` field that
`maxtext/layers/moe.py` (RoutedMoE, GateLogit, get_topk, the aux and bias losses,
RoutedAndSharedMoE) reads as `config.<key>`, `cfg.<key>` or `getattr(config, "<key>")`.
Each is `supported` (temoe computes what native computes; `case` names the parity case of
tests/parity_check.py covering it), `refused` (a config-time error; `refuse` is an override that
triggers it) or `irrelevant` (the block's math does not depend on it; the reason says why).
`DECODER_BLOCKS` does the same for the decoder families. A test fails when MaxText grows a key
or a decoder block this table does not classify.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

SUPPORTED, REFUSED, IRRELEVANT = "supported", "refused", "irrelevant"


@dataclasses.dataclass(frozen=True)
class Key:
  status: str
  reason: str
  case: str | None = None  # supported: the parity case covering it
  refuse: tuple[str, ...] = ()  # refused: overrides that get the config-time error
  message: str = ""  # refused: a fragment of that error


def _s(case, reason):
  return Key(SUPPORTED, reason, case=case)


def _r(reason, refuse, message):
  return Key(REFUSED, reason, refuse=tuple(refuse), message=message)


def _i(reason):
  return Key(IRRELEVANT, reason)


_NATIVE_KERNEL = "tiling/kernel choice of MaxText's native grouped GEMMs; temoe's backends run their own GEMMs"
_NATIVE_DISPATCH = "a strategy of MaxText's native dispatch/exchange; temoe's block replaces it (same math, dropless)"
_SPARSECORE = "TPU SparseCore placement of native collectives; no effect on the math, unused by temoe"
_SHARDING = "parameter/activation sharding only: same values, other layout (4-device parity cases)"
_INFERENCE = "serving path (vLLM / fused_moe / quantized serving weights); not the training block"
_QWEN3_NEXT_ATTN = "Qwen3-Next gated-delta-net attention, outside the MoE block"
_EP4_RAGGED = ("use_ring_of_experts=true", "use_ragged_sort=true", "ici_expert_parallelism=4", "ici_fsdp_parallelism=1")
"""Native's ring-of-experts ragged dispatch, which several native-only flags need (any device count at config time)."""
_ROUTED = "read by MaxText's own router code (GateLogit / get_topk), which temoe calls"

KEYS: dict[str, Key] = {
    # The switch and the recipe.
    "te_moe_block": _s("deepseek3", "the switch: temoe's block serves MaxText's te_moe_block path"),
    "te_gmm_quantization": _s("deepseek3", "temoe's recipe for the expert GEMMs (te_no_quant is the parity reference)"),
    "te_ep_overflow_check_every_n_steps": _i("how often MaxText's train step checks the sown EP overflow flag"),
    # Shapes.
    "num_experts": _s("deepseek3", "expert count; every case"),
    "num_experts_per_tok": _s("envy", "top-k; 1 (envy), 2 (mixtral), 4 (the others)"),
    "moe_mlp_dim": _s("deepseek3", "expert MLP width"),
    "base_moe_mlp_dim": _s("deepseek3", "expert MLP width before scaling"),
    "padded_base_moe_mlp_dim": _s("deepseek3", "MaxText pads the parameters; temoe computes on them as given"),
    "moe_expert_input_dim": _s("deepseek3", "expert input width (defaults to emb_dim): the layer's parameter shapes"),
    "emb_dim": _s("deepseek3", "model width"),
    "shared_experts": _s("deepseek3_shared_skewed", "shared experts are MaxText's own MlpBlock beside the routed block"),
    "mlp_bias": _s("gpt_oss_skewed", "expert biases (wi_0/wi_1/wo), passed to temoe's block by MaxText"),
    "mlp_activations": _s("gpt_oss_skewed", "the layer's apply_ffn_activation (silu; sigmoid for gpt_oss)"),
    "mlp_activations_limit": _s("deepseek4", "clipping in the layer's apply_ffn_activation (gpt_oss, deepseek4)"),
    "prefuse_moe_weights": _r("MaxText needs the fused wi for te_moe_block", ["prefuse_moe_weights=false"],
                              "requires prefuse_moe_weights=True"),
    "sparse_matmul": _r("MaxText needs the dropless sparse path for te_moe_block", ["sparse_matmul=false"],
                        "requires sparse_matmul=True"),
    "capacity_factor": _i("token dropping of the dense (sparse_matmul=false) path, which te_moe_block excludes"),
    "num_moe_emb_chunks": _i("overlap of native's all-gather with its GMMs (needs use_gmm_v2); same math"),
    "num_moe_token_chunks": _r("native averages the Switch aux loss over sequence chunks",
                               ["num_moe_token_chunks=2", *_EP4_RAGGED], "num_moe_token_chunks=2"),
    "moe_chunk_barrier": _i("scheduling barrier between native's token chunks (identity)"),
    "first_num_dense_layers": _i("which decoder layers are MoE; each MoE layer is served the same way"),
    "interleave_moe_layer_step": _i("which decoder layers are MoE; each MoE layer is served the same way"),
    "first_num_hash_layers": _r("DeepSeek-V4 hash routing needs token ids the te_moe_block path drops",
                                ["override_model_config=true", "decoder_block=deepseek4", "first_num_hash_layers=1"],
                                "first_num_hash_layers=1"),
    "decoder_block": _s("deepseek4", "routing/activation family; see DECODER_BLOCKS (gemma4, llama4 refused)"),
    "model_name": _s("kimi_k2_shared", "GateLogit/get_topk switch on deepseek3/deepseek4/kimi-k2 name prefixes"),
    # Router.
    "routed_score_func": _s("deepseek4", "sigmoid (deepseek3), softmax (deepseek2), sqrtsoftplus (deepseek4), none"),
    "routed_bias": _s("gpt_oss_skewed", "routed bias: MoEBiasVar (DeepSeek) or a trained Param (gpt_oss)"),
    "routed_bias_update_rate": _s("deepseek3", "loss-free balancing update, bit-equal to native's"),
    "routed_scaling_factor": _s("deepseek2", "DeepSeek weight scaling (2.5, 2.0, 1.5, 2.827)"),
    "n_routing_groups": _s("deepseek3", "group-limited routing (4 groups)"),
    "topk_routing_group": _s("deepseek3", "group-limited routing (top-2 groups)"),
    "norm_topk_prob": _s("qwen3_moe", "top-k weight normalisation"),
    "float32_gate_logits": _s("deepseek3", "the gate's dtype: temoe routes through the layer's GateLogit"),
    "float32_weight_sum": _s("deepseek3", "combine precision; temoe's combine reads it"),
    "router_topk_matmul_vjp": _s("deepseek3", _ROUTED + "; changes the VJP's form, not its value"),
    "moe_routing_maps": _s("deepseek3", _ROUTED + "; saves routing maps across remat, values unchanged"),
    "use_random_routing": _r("debug routing needing an RNG", ["use_random_routing=true", *_EP4_RAGGED],
                             "does not support use_random_routing"),
    "load_balance_loss_weight": _s("deepseek3", "Switch-style aux loss, MaxText's load_balance_loss"),
    "moe_use_megatron_seq_aux_loss": _s(
        "deepseek3_megatron_aux_grad_accum",
        "MaxText's megatron_seq_aux_loss; refused unless temoe's seam makes the train step sum it over layers"),
    "gradient_accumulation_steps": _s("deepseek3_megatron_aux_grad_accum",
                                      "bias signal = raw expert counts per microbatch, as native"),
    "fuse_expert_scales": _i("per_expert_scale folding for inference; per_expert_scale exists only for gemma4"),
    "model_call_mode": _i("inference-only folding of per_expert_scale (gemma4) and quantized serving"),
    "dropout_rate": _s("deepseek3_shared_skewed", "dropout of MaxText's shared-expert MlpBlock"),
    "vocab_size": _i("size of DeepSeek-V4's hash-routing table (hash routing is refused)"),
    "return_routed_experts": _i(_INFERENCE),
    # Numerics.
    "dtype": _s("deepseek3", "activation dtype (float32 parity)"),
    "weight_dtype": _s("deepseek3", "parameter dtype (float32 parity)"),
    "matmul_precision": _s("deepseek3", "the gate's and combine's precision"),
    "activations_in_float32": _i("read only by the dense (capacity) path"),
    "quantization": _i("MaxText's te_moe_block contract: expert GEMMs follow te_gmm_quantization, the gate is "
                       "the layer's own GateLogit either way"),
    "use_qwix_quantization": _i("as quantization: the te_moe_block path's expert GEMMs follow te_gmm_quantization"),
    "act_quantization_calibration_method": _i(_INFERENCE),
    "weight_block_size": _i(_INFERENCE),
    # Native dispatch and exchange.
    "use_ring_of_experts": _i(_NATIVE_DISPATCH),
    "use_ragged_sort": _i(_NATIVE_DISPATCH),
    "use_custom_sort_vjp": _i(_NATIVE_DISPATCH),
    "moe_topk_before_ep_all_gather": _i(_NATIVE_DISPATCH),
    "moe_use_direct_token_gather": _i(_NATIVE_DISPATCH),
    "moe_dispatch_no_expert_sharding": _i(_NATIVE_DISPATCH),
    "moe_quantize_token_all_gather": _i(_NATIVE_DISPATCH + "; quantizes native's token all-gather"),
    "moe_quantize_combine_bwd_method": _i(_NATIVE_DISPATCH + "; quantizes native's combine backward"),
    "moe_fsdp_use_two_stage_all_gather": _i(_NATIVE_DISPATCH),
    "ragged_gather_fallback": _i(_NATIVE_DISPATCH),
    "ragged_gather_reduce_fallback": _i(_NATIVE_DISPATCH),
    "ragged_gather_cost_estimate_flops": _i(_NATIVE_DISPATCH),
    "ragged_gather_cost_estimate_bytes_accessed": _i(_NATIVE_DISPATCH),
    "ragged_gather_reduce_cost_estimate_flops": _i(_NATIVE_DISPATCH),
    "ragged_gather_reduce_cost_estimate_bytes_accessed": _i(_NATIVE_DISPATCH),
    "use_gather_mosaic_kernel": _i(_NATIVE_DISPATCH),
    "defer_small_all_reduces": _i("defers native's ring-of-experts count all-reduce; the train step rewrites only "
                                  "its stacked partial counts, not temoe's per-layer update"),
    "custom_mesh_and_rule": _s("deepseek3", "picks the layer's expert mesh axis, which temoe's block uses"),
    "ragged_buffer_factor": _s("deepseek3", "sizes temoe's EP receive buffers; overflow is sown as "
                                            "te_moe_capacity_overflow for MaxText's check (dropless in parity)"),
    "eval_ragged_buffer_factor": _r("MaxText refuses it with te_moe_block", ["eval_ragged_buffer_factor=2.0", *_EP4_RAGGED],
                                    "does not support eval_ragged_buffer_factor"),
    "first_phase_ragged_buffer_factor": _r(
        "MaxText refuses it with te_moe_block",
        ["first_phase_ragged_buffer_factor=2.0", "retry_dropless_first_steps=1", "moe_dropless_fallback=step",
         "ragged_buffer_factor=1.0", *_EP4_RAGGED], "first_phase_ragged_buffer_factor"),
    "log_required_ragged_buffer_factor": _r("MaxText refuses it with te_moe_block",
                                            ["log_required_ragged_buffer_factor=true", *_EP4_RAGGED],
                                            "log_required_ragged_buffer_factor=True is not supported"),
    "moe_log_max_load_ratio": _r("MaxText refuses it with te_moe_block", ["moe_log_max_load_ratio=true", *_EP4_RAGGED],
                                 "te_moe_block=False"),
    "moe_dropless_fallback": _r(
        "native's overflow retry of its own ring-of-experts dispatch",
        ["moe_dropless_fallback=step", "ragged_buffer_factor=2.0", *_EP4_RAGGED], "moe_dropless_fallback='step'"),
    "retry_dropless_first_steps": _r(
        "needs moe_dropless_fallback=step (refused)",
        ["retry_dropless_first_steps=1", "moe_dropless_fallback=step", "ragged_buffer_factor=2.0", *_EP4_RAGGED],
        "moe_dropless_fallback='step'"),
    "log_step_diagnostics": _i("logging of native step diagnostics"),
    "log_moe_bias_norms": _i("logs the routed-bias norm; reads the parameter, not the block"),
    "warmup_programs_in_init": _i("compiles native's fallback programs ahead; no effect on values"),
    "batch_split_factor": _i("DeepSeek batch-split schedule (use_batch_split_schedule), a native layer body"),
    "use_batch_split_schedule": _i("a native DeepSeek layer body that bypasses RoutedMoE.__call__; not te_moe_block"),
    "use_lineage": _i("wo sharding under the batch-split schedule"),
    # Native grouped-GEMM kernels and tiling.
    **{k: _i(_NATIVE_KERNEL) for k in (
        "megablox", "use_tokamax_gmm", "use_gmm_v2", "use_gmm_v2_heuristic_tiling", "merge_gating_gmm",
        *(f"{w}_tile_{p}_{d}" for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")
          for d in ("batch_seq", "embed_dim", "mlp_dim")),
        *(f"eval_{w}_tile_fwd_{d}" for w in ("wi", "wo") for d in ("batch_seq", "embed_dim", "mlp_dim")),
    )},
    # TPU SparseCore placement.
    **{k: _i(_SPARSECORE) for k in (
        "moe_ep_all_gather_sparse_core_id", "moe_fsdp_all_gather_sparse_core_id", "moe_pin_sparse_core_all_gathers",
        "moe_pin_sparse_core_ep_all_gathers", "moe_pin_sparse_core_fsdp_all_gathers",
        "moe_pin_sparse_core_fsdp_all_gathers_fwd_only", "ragged_sort_use_single_sparsecore",
    )},
    # Sharding.
    **{k: _i(_SHARDING) for k in (
        "shard_exp_on_fsdp", "use_2d_fsdp_sharding", "shard_embed_moe_on_fsdp", "shard_mode", "debug_sharding",
        "check_vma",
    )},
    # Serving.
    "attention": _i("only vllm_rpa / vllm_batched_rpa (serving) change the MoE block"),
    "enable_dp_attention": _i(_INFERENCE),
    # Qwen3-Next's attention, in MaxText's MoE schema section.
    **{k: _i(_QWEN3_NEXT_ATTN) for k in (
        "gdn_chunk_size", "gdn_conv_kernel_dim", "gdn_key_head_dim", "gdn_mamba_block_size", "gdn_num_key_heads",
        "gdn_num_value_heads", "gdn_value_head_dim", "use_qk_norm_in_gdn", "partial_rotary_factor",
    )},
}

DECODER_BLOCKS: dict[str, Key] = {
    "deepseek": _s("deepseek3_shared_skewed", "DeepSeek-V2/V3, Kimi-K2 (deepseek2/kimi_k2 cases too)"),
    "deepseek4": _s("deepseek4_shared_skewed", "DeepSeek-V4 without hash layers (first_num_hash_layers=0)"),
    "mixtral": _s("mixtral_skewed", "softmax over the top-k logits"),
    "qwen3_moe": _s("qwen3_moe", "normalised top-k"),
    "qwen3_custom_moe": _s("qwen3_custom_moe", "normalised top-k"),
    "qwen3_next": _s("qwen3_next_skewed", "routed block; the shared expert and its gate stay MaxText's"),
    "qwen3_5": _s("qwen3_5", "routed block; the shared expert and its gate stay MaxText's"),
    "gpt_oss": _s("gpt_oss_skewed", "trained routed bias, expert biases, clipped sigmoid GLU"),
    "envy": _s("envy", "top-1 Switch routing"),
    "gemma4": _r("routes on separate gate inputs, which the te_moe_block path refuses",
                 ["override_model_config=true", "decoder_block=gemma4", "routed_bias_update_rate=0.0"], "decoder_block=gemma4"),
    "llama4": _r("scales expert inputs by sigmoid(router logit); MaxText refuses it with te_moe_block",
                 ["override_model_config=true", "decoder_block=llama4", "routed_bias_update_rate=0.0",
                  "num_experts_per_tok=1", "n_routing_groups=-1", "topk_routing_group=-1"], "Llama4 routing semantics"),
    **{k: _i("a dense family: no routed MoE block") for k in (
        "default", "llama2", "mistral", "gemma", "gemma2", "gemma3", "gemma4_small", "qwen2", "qwen3", "gpt3",
        "simple", "simple_mlp", "olmo3",
    )},
}


def _maxtext():
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel
  import maxtext  # pylint: disable=import-outside-toplevel

  return types, pathlib.Path(maxtext.__file__).parent


def config_reads(source: str, fields) -> set[str]:
  """Config fields a module reads: `config.<key>`, `cfg.<key>`, `self.config.<key>`, `getattr(config, "<key>")`."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and node.attr in fields:
      owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
      if owner in ("config", "cfg"):
        found.add(node.attr)
    elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2
          and isinstance(node.args[1], ast.Constant) and node.args[1].value in fields):
      found.add(node.args[1].value)
  return found


def maxtext_moe_keys() -> set[str]:
  """The installed MaxText's MoE-affecting config keys, by the rule in this module's docstring."""
  types, root = _maxtext()
  fields = set(types.MaxTextConfig.model_fields)
  sections = set()
  for section in (types.MoEGeneral, types.MoEKernels, types.DeepSeekMoE, types.Qwen3Next):
    sections |= set(section.model_fields)
  return (sections & fields) | config_reads((root / "layers" / "moe.py").read_text(), fields)


def maxtext_decoder_blocks() -> set[str]:
  types, _ = _maxtext()
  return {block.value for block in types.DecoderBlockType}
