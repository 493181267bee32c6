"""temoe's MoE block: router -> dispatch -> experts -> combine, on MaxText's own parameters.

Called by the seam in place of MaxText's TE MoE block whenever `te_moe_block=true`: no NCCL EP
bootstrap, any number of devices per process, one device included. The block sows what MaxText's
train step reads with te_moe_block (te_moe_total_recv_tokens / _recv_capacity_per_rank /
_capacity_overflow) and, for loss-free balancing, `moe_bias_updates`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from temoe import options, platform
from temoe.moe import dispatch, experts, router


def backend_for(cfg) -> str:
  """The backend this process runs for `cfg` (`te` or `xla`), or a TemoeConfigError."""
  return options.resolve_backend(cfg.te_moe_backend, str(cfg.te_gmm_quantization), platform.detect())


def run(layer, inputs, wi, wo, w0_bias=None, w1_bias=None, wo_bias=None, out_sharding=None):
  """Computes MaxText RoutedMoE `layer` on `inputs` (batch, seq, emb) with temoe.

  Returns MaxText's (output, load-balance loss or None, None): the third slot, where MaxText's
  TE block returns receive counts for the decoder layer to sow, is sown here instead, so every
  decoder block (DeepSeek, Mixtral, ...) gets the same metrics.
  """
  cfg = layer.config
  backend = backend_for(cfg)
  batch, seq, emb = inputs.shape
  top_k = layer.num_experts_per_tok
  biases = (w0_bias, w1_bias, wo_bias)

  with jax.named_scope("temoe_router"):
    routing = router.route(layer, inputs)
  with jax.named_scope("temoe_dispatch"):
    align = 1 if backend == "xla" else expert_backend(backend).row_alignment(cfg)
    p = dispatch.plan(routing.experts, layer.num_experts, align)
    x = dispatch.dispatch(inputs.reshape(batch * seq, emb), p, top_k)
    rows_expert = dispatch.row_experts(p) if any(b is not None for b in biases) else None
  with jax.named_scope("temoe_experts"):
    if backend == "xla":
      y = experts.mlp_xla(layer, x, p.padded_group_sizes, wi, wo, biases, rows_expert)
    else:
      y = expert_backend(backend).mlp(layer, x, p, wi, wo, biases, rows_expert)
  with jax.named_scope("temoe_combine"):
    out = dispatch.combine(y, p, routing.weights, cfg.float32_weight_sum)
  out = out.reshape(batch, seq, emb).astype(layer.dtype)
  if out_sharding is not None:
    out = jax.lax.with_sharding_constraint(out, out_sharding)

  sow_step_outputs(layer, p, routing)
  return out, routing.lb_loss, None


def expert_backend(backend: str):
  """The module computing the expert MLP for a non-reference backend (imported only when used)."""
  if backend == "te":
    from temoe.moe import te_experts  # pylint: disable=import-outside-toplevel

    return te_experts
  raise options.TemoeConfigError(f"te_moe_backend={backend!r}; valid choices: {', '.join(options.BACKENDS)}.")


def sow_step_outputs(layer, p: dispatch.DispatchPlan, routing: router.Routing) -> None:
  """Sows what MaxText's train step reads for te_moe_block, and the routed-bias update."""
  received = jnp.sum(p.padded_group_sizes).astype(jnp.int32)
  capacity = jnp.asarray(p.buffer_rows, jnp.int32)
  layer.sow(nnx.Intermediate, "te_moe_total_recv_tokens", received)
  layer.sow(nnx.Intermediate, "te_moe_recv_capacity_per_rank", capacity)
  layer.sow(nnx.Intermediate, "te_moe_capacity_overflow", received > capacity)
  if routing.bias_update is not None:
    layer.sow(nnx.Intermediate, "moe_bias_updates", routing.bias_update)
