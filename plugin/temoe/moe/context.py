"""The frozen context the MoE core computes one routed-MoE layer with.

Built once per layer call at the MaxText seam (`temoe.maxtext.adapter`) from MaxText's RoutedMoE
and config, so the core never reads a MaxText object; the one MaxText code it calls is the
activation hook (`activation`: MaxText's `apply_ffn_activation`). Tests and benchmarks build it directly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up, MaxText's default MoE activation; what tests and benchmarks use."""
  return (jax.nn.silu(gate) * up).astype(gate.dtype)


@dataclasses.dataclass(frozen=True)
class MoEContext:
  """What the core needs to know about one routed-MoE layer.

  num_experts: global expert count; top_k: experts per token.
  dtype: the expert MLP's compute and output dtype (MaxText's `dtype`).
  recipe / kernel / align: the `te_gmm_quantization` recipe, the expert kernel computing it
    (temoe.moe.experts.<kernel>) and the rows every expert group is padded to (temoe.recipes).
  activation: (gate, up) -> hidden, e.g. SwiGLU (MaxText's `apply_ffn_activation`).
  float32_weight_sum: combine each token's expert outputs in float32.
  mesh / token_spec: the device mesh and the sharding of (batch, seq, emb) activations on it;
    None for one device. ep_axis / ep_size: the expert-parallel mesh axis and its size.
  buffer_factor: MaxText's ragged_buffer_factor: <= 0 sizes EP receive buffers for the worst case.
  exchange: the expert-parallel exchange strategy (temoe.moe.exchange), "auto" by default.
  ep_node_size: ranks per node along the expert axis (the hierarchical exchange's node boundary).
  chunks: the routed experts run in this many token chunks, each with its own exchange, so one chunk's
    exchange has no data dependence on another's GEMMs (XLA's scheduler may overlap them).
  check_finite / name: stop on NaN/Inf in this layer's output or gradient, naming it so.
  fp8_weights: MaxText's te_moe_fp8_weights: "remat" (the backward casts the expert weights to FP8
    again from the forward's scales) or "device" / "offload" (the backward reads the forward's copies).
  """

  num_experts: int
  top_k: int
  dtype: jax.typing.DTypeLike
  recipe: str = "te_no_quant"
  kernel: str = "xla"
  align: int = 1
  activation: Callable[[jax.Array, jax.Array], jax.Array] = swiglu
  float32_weight_sum: bool = True
  mesh: Mesh | None = None
  token_spec: PartitionSpec | None = None
  ep_axis: str | tuple[str, ...] | None = None
  ep_size: int = 1
  buffer_factor: float = 0.0
  exchange: str = "auto"
  ep_node_size: int = 8
  chunks: int = 1
  check_finite: bool = False
  name: str = "MoE layer"
  fp8_weights: str = "remat"

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.ep_size
