"""Parameter counts of a DeepSeek-style MaxText config, from its shapes alone (nothing is built).

A preset's size and per-token compute follow from its shapes; computing them lets a test prove
that a YAML really describes DeepSeek-V3 (671B total, 37B active per token) without building a
671B model. Counts follow the parameters MaxText's DeepSeek decoder creates: MLA projections and
their norms, dense MLP layers, routed experts (gated: wi_0, wi_1, wo), shared experts, the router
kernel, decoder norms, the embedding and the unembedding.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelSize:
  total: int
  active: int  # parameters one token passes through: every non-expert one, top-k routed experts

  def __str__(self) -> str:
    return f"{self.total / 1e9:.1f}B parameters, {self.active / 1e9:.1f}B active per token"


_REQUIRED = object()


def _get(config, key, default=_REQUIRED):
  if isinstance(config, dict):
    return config[key] if default is _REQUIRED else config.get(key, default)
  return getattr(config, key) if default is _REQUIRED else getattr(config, key, default)


@dataclasses.dataclass(frozen=True)
class Layers:
  """How MaxText's decoder splits its `decoder` layers into `dense` and `moe` ones; `mtp` modules apart."""

  decoder: int
  dense: int
  moe: int
  mtp: int


def layers(config) -> Layers:
  """The one count of a config's dense-MLP and MoE layers every estimate uses: MaxText's DeepSeek
  decoder makes its first `first_num_dense_layers` dense, its other MoE decoders route every layer, a
  config without experts has dense MLPs only (how the decoder scans them: hbm.layer_counts)."""
  decoder, mtp = _get(config, "num_decoder_layers"), _get(config, "mtp_num_layers", 0)
  if _get(config, "num_experts") <= 1:
    return Layers(decoder, decoder, 0, mtp)
  block = _get(config, "decoder_block", "deepseek")
  dense = _get(config, "first_num_dense_layers") if getattr(block, "value", block) == "deepseek" else 0
  return Layers(decoder, dense, decoder - dense, mtp)


def mla_matmul_params(c) -> int:
  """Multi-head latent attention's projection weights: low-rank query and key/value, output."""
  emb, heads = _get(c, "emb_dim"), _get(c, "num_query_heads")
  qk_head = _get(c, "qk_nope_head_dim") + _get(c, "qk_rope_head_dim")
  q_rank, kv_rank = _get(c, "q_lora_rank"), _get(c, "kv_lora_rank")
  query = emb * q_rank + q_rank * heads * qk_head if q_rank > 0 else emb * heads * qk_head
  key_value = emb * (kv_rank + _get(c, "qk_rope_head_dim"))
  key_value += kv_rank * heads * (_get(c, "qk_nope_head_dim") + _get(c, "v_head_dim"))
  return query + key_value + heads * _get(c, "v_head_dim") * emb


def mla_params(c) -> int:
  """MLA's projections and the norms of its low-rank query and key/value."""
  return mla_matmul_params(c) + max(_get(c, "q_lora_rank"), 0) + _get(c, "kv_lora_rank")


def mlp_params(c, hidden: int) -> int:
  """One MLP: as many input projections as activations (gated SwiGLU: two), one output projection."""
  return (len(_get(c, "mlp_activations")) + 1) * _get(c, "emb_dim") * hidden


def count(config) -> ModelSize:
  """Total and per-token parameters of a MaxText DeepSeek config (HyperParameters or a dict)."""
  c = config
  emb, experts = _get(c, "emb_dim"), _get(c, "num_experts")
  split = layers(c)
  expert = mlp_params(c, _get(c, "moe_mlp_dim"))
  router = emb * experts  # the routed bias is state MaxText updates, not a trained parameter
  shared = mlp_params(c, _get(c, "moe_mlp_dim") * _get(c, "shared_experts"))
  per_layer = mla_params(c) + 2 * emb  # attention, pre-attention and pre-MLP norms
  embeddings = _get(c, "vocab_size") * emb * (1 if _get(c, "logits_via_embedding") else 2) + emb  # + final norm
  common = split.decoder * per_layer + split.dense * mlp_params(c, _get(c, "mlp_dim")) + embeddings
  total = common + split.moe * (experts * expert + router + shared)
  active = common + split.moe * (_get(c, "num_experts_per_tok") * expert + router + shared)
  return ModelSize(total=total, active=active)
