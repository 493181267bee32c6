"""temoe's MoE block: router -> dispatch -> experts -> combine, on MaxText's own parameters.

Called by the seam in place of MaxText's TE MoE block whenever `te_moe_block=true`: no NCCL EP
bootstrap, any number of devices per process, one device included. Routing runs on the global
arrays (MaxText's semantics, its aux loss and bias update over the whole batch); on several
devices the rest runs per device under `shard_map`, on the device's own tokens, with experts
sharded over MaxText's expert mesh axis and rows exchanged by `expert_parallel`. The block sows
what MaxText's train step reads with te_moe_block (te_moe_total_recv_tokens /
_recv_capacity_per_rank / _capacity_overflow) and, for loss-free balancing, `moe_bias_updates`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from temoe.maxtext import metrics
from temoe import recipes
from temoe import hardware
from temoe.moe import dispatch, expert_parallel, finite_guard
from temoe.maxtext import router
from temoe.moe.routing import Routing
from temoe.moe.experts import xla as experts


def backend_for(cfg) -> str:
  """The backend this process runs for `cfg` (`te` or `xla`), or a TemoeConfigError."""
  return recipes.resolve_backend(cfg.te_moe_backend, str(cfg.te_gmm_quantization), hardware.detect())


def expert_backend(backend: str):
  """The module computing the expert MLP for a non-reference backend (imported only when used)."""
  if backend == "te":
    from temoe.moe.experts import te as te_experts  # pylint: disable=import-outside-toplevel

    return te_experts
  raise recipes.TemoeConfigError(f"te_moe_backend={backend!r}; valid choices: {', '.join(recipes.BACKENDS)}.")


@dataclasses.dataclass(frozen=True)
class Layout:
  """How this layer's work is laid out: backend, group alignment, expert-parallel axis and size."""

  backend: str
  align: int
  ep_axis: str | tuple[str, ...] | None
  ep_size: int
  buffer_factor: float  # MaxText's ragged_buffer_factor: <= 0 sizes EP receive buffers for the worst case


def expert_mlp(layer, layout: Layout, x, p: dispatch.DispatchPlan, wi, wo, biases):
  rows_expert = dispatch.row_experts(p) if any(b is not None for b in biases) else None
  if layout.backend == "xla":
    return experts.mlp_xla(layer, x, p.padded_group_sizes, wi, wo, biases, rows_expert)
  return expert_backend(layout.backend).mlp(layer, x, p, wi, wo, biases, rows_expert)


def moe_rows(layer, layout: Layout, x, expert_ids, weights, wi, wo, *biases):
  """Dispatch -> experts -> combine on one device's tokens.

  Returns (output, stats): per-device (1,) arrays `received`, `capacity`, `overflow` and
  `padded`/`real` (rows at the expert GEMMs with and without alignment padding).
  """
  shape = x.shape
  top_k = expert_ids.shape[-1]
  x, expert_ids, weights = x.reshape(-1, shape[-1]), expert_ids.reshape(-1, top_k), weights.reshape(-1, top_k)
  if layout.ep_size == 1:
    with jax.named_scope("temoe_dispatch"):
      p = dispatch.plan(expert_ids, layer.num_experts, layout.align)
      buf = dispatch.dispatch(x, p, top_k)
    with jax.named_scope("temoe_experts"):
      y = expert_mlp(layer, layout, buf, p, wi, wo, biases)
    received, capacity, overflow = jnp.sum(p.padded_group_sizes), p.buffer_rows, jnp.bool_(False)
    gemm_plan = p
  else:
    with jax.named_scope("temoe_dispatch"):
      p = dispatch.plan(expert_ids, layer.num_experts)
      rows = dispatch.dispatch(x, p, top_k)
      capacity = p.routed_rows * layout.ep_size
      if layout.buffer_factor > 0:
        capacity = min(capacity, math.ceil(p.routed_rows * layout.buffer_factor))
      padded = expert_parallel.uses_padded_exchange()
      ex = expert_parallel.plan_exchange(p.group_sizes, layout.ep_axis, layout.ep_size, capacity)
      local_experts = wi.shape[0]
      if padded:
        received_rows = expert_parallel.send_padded(rows, ex, layout.ep_size, layout.ep_axis)
        local_ids = expert_parallel.local_expert_of_padded_rows(ex, p.routed_rows)
      else:
        received_rows = expert_parallel.send(rows, ex, capacity, layout.ep_axis)
        local_ids = expert_parallel.local_expert_of_rows(ex, capacity)
      local_plan = dispatch.plan(local_ids[:, None], local_experts + 1, layout.align)  # + sentinel group
      buf = dispatch.dispatch(received_rows, local_plan, 1)
    gemm_plan = dispatch.with_groups(local_plan, local_experts)
    with jax.named_scope("temoe_experts"):
      y = expert_mlp(layer, layout, buf, gemm_plan, wi, wo, biases)
    with jax.named_scope("temoe_combine"):
      y = dispatch.undispatch(y, local_plan)
      if padded:
        y = expert_parallel.receive_back_padded(y, ex, layout.ep_size, layout.ep_axis)
      else:
        y = expert_parallel.receive_back(y, ex, p.routed_rows, layout.ep_axis)
    received, overflow = ex.received, ex.overflow
  with jax.named_scope("temoe_combine"):
    out = dispatch.combine(y, p, weights, layer.config.float32_weight_sum).reshape(shape).astype(layer.dtype)
  stats = {
      "received": jnp.reshape(received, (1,)).astype(jnp.int32),
      "capacity": jnp.full((1,), capacity, jnp.int32),
      "overflow": jnp.reshape(overflow, (1,)),
      "padded": jnp.reshape(jnp.sum(gemm_plan.padded_group_sizes), (1,)).astype(jnp.int32),
      "real": jnp.reshape(jnp.sum(gemm_plan.group_sizes), (1,)).astype(jnp.int32),
  }
  return out, stats


def run(layer, inputs, wi, wo, w0_bias=None, w1_bias=None, wo_bias=None, out_sharding=None):
  """Computes MaxText RoutedMoE `layer` on `inputs` (batch, seq, emb) with temoe.

  Returns MaxText's (output, load-balance loss or None, None): the third slot, where MaxText's
  TE block returns receive counts for the decoder layer to sow, is sown here instead, so every
  decoder block (DeepSeek, Mixtral, ...) gets the same metrics.
  """
  cfg = layer.config
  backend = backend_for(cfg)
  mesh = layer.mesh
  ep_size = layer.get_expert_parallelism_size() if mesh is not None else 1
  layout = Layout(
      backend=backend,
      align=1 if backend == "xla" else expert_backend(backend).row_alignment(cfg),
      ep_axis=layer._expert_parallelism_name,  # pylint: disable=protected-access
      ep_size=ep_size,
      buffer_factor=cfg.ragged_buffer_factor,
  )
  biases = (w0_bias, w1_bias, wo_bias)
  with jax.named_scope("temoe_router"):
    routing = router.route(layer, inputs)
  compute = functools.partial(moe_rows, layer, layout)
  args = (inputs, routing.experts, routing.weights, wi, wo, *biases)
  if mesh is None or mesh.size == 1:
    out, stats = compute(*args)
  else:
    tokens = layer._logical_to_mesh_axes(("activation_batch", "activation_norm_length", None))  # pylint: disable=protected-access
    experts_axis = layout.ep_axis if ep_size > 1 else None
    per_device = P(tuple(mesh.axis_names))
    in_specs = (tokens, tokens, tokens, P(experts_axis), P(experts_axis)) + tuple(
        None if b is None else P(experts_axis) for b in biases
    )
    out, stats = jax.shard_map(
        compute,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(tokens, per_device),
        check_vma=False,
    )(*args)
  if out_sharding is not None:
    out = jax.lax.with_sharding_constraint(out, out_sharding)
  if cfg.te_moe_check_finite:
    out = finite_guard.guard(out, finite_guard.layer_name(layer))
  sow_step_outputs(layer, jnp.max(stats["received"]), jnp.min(stats["capacity"]), jnp.any(stats["overflow"]), routing)
  if metrics.enabled(cfg):
    padded = jnp.sum(stats["padded"])
    metrics.sow(layer, routing.experts, routing.scores, 1.0 - jnp.sum(stats["real"]) / jnp.maximum(padded, 1))
  return out, routing.lb_loss, None


def sow_step_outputs(layer, received, capacity, overflow, routing: Routing) -> None:
  """Sows what MaxText's train step reads for te_moe_block, and the routed-bias update."""
  layer.sow(nnx.Intermediate, "te_moe_total_recv_tokens", received.astype(jnp.int32))
  layer.sow(nnx.Intermediate, "te_moe_recv_capacity_per_rank", capacity.astype(jnp.int32))
  layer.sow(nnx.Intermediate, "te_moe_capacity_overflow", overflow | (received > capacity))
  if routing.bias_update is not None:
    layer.sow(nnx.Intermediate, "moe_bias_updates", routing.bias_update)
