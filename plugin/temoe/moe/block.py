"""temoe's MoE block: dispatch -> (exchange) -> experts -> (exchange back) -> combine, dropless.

Plain JAX on a frozen `MoEContext`; it never sees a MaxText object. Routing is done before it is
called, on the global arrays (MaxText's semantics: its aux loss and bias update see the whole
batch). On one device the block runs directly; on a mesh it runs per device under `shard_map`, on
the device's own tokens, with experts sharded over the expert-parallel axis and rows moved by the
context's exchange strategy (`temoe.moe.exchange`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from temoe.moe import dispatch, exchange, finite_guard
from temoe.moe.context import MoEContext


def expert_kernel(name: str):
  """The module computing the expert MLP (temoe.moe.experts.<name>), imported only when used."""
  return importlib.import_module(f"temoe.moe.experts.{name}")


def expert_mlp(ctx: MoEContext, x, p: dispatch.DispatchPlan, wi, wo, biases):
  """The context's kernel on the expert-sorted buffer `x` planned by `p`."""
  rows_expert = dispatch.row_experts(p) if any(b is not None for b in biases) else None
  return expert_kernel(ctx.kernel).mlp(ctx, x, p, wi, wo, biases, rows_expert)


def tokens_mlp(ctx: MoEContext, wi, wo, biases):
  """The context's kernel's MLP from tokens to combined outputs (dispatch and combine fused into it),
  where it offers one for this layer (`tokens_mlp(ctx, wi, wo, biases)`), else None."""
  offer = getattr(expert_kernel(ctx.kernel), "tokens_mlp", None)
  return offer(ctx, wi, wo, biases) if offer else None


def _per_device(ctx: MoEContext, strategy, x, expert_ids, weights, wi, wo, *biases):
  shape = x.shape
  top_k = expert_ids.shape[-1]
  mlp = functools.partial(expert_mlp, ctx, wi=wi, wo=wo, biases=biases)
  fused = tokens_mlp(ctx, wi, wo, biases) if strategy in (exchange.strategy(n) for n in exchange.TOKENS_MLP) else None
  x, expert_ids, weights = x.reshape(-1, shape[-1]), expert_ids.reshape(-1, top_k), weights.reshape(-1, top_k)
  size = chunk_tokens(ctx, x.shape[0])
  outs, parts = [], []
  for c in range(ctx.chunks):  # unrolled: chunk c + 1's exchange does not wait for chunk c's GEMMs
    rows = slice(c * size, (c + 1) * size)
    with jax.named_scope(f"temoe_chunk{c}") if ctx.chunks > 1 else contextlib.nullcontext():
      out, stats = strategy.run(ctx, x[rows], expert_ids[rows], weights[rows], mlp,
                                **({"tokens_mlp": fused} if fused else {}))
    outs.append(out)
    parts.append(stats)
  out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
  stats = {k: (functools.reduce(jnp.logical_or, (p[k] for p in parts)) if k == "overflow" else sum(p[k] for p in parts))
           for k in parts[0]}
  stats = {k: jnp.reshape(v, (1,)).astype(jnp.bool_ if k == "overflow" else jnp.int32) for k, v in stats.items()}
  return out.reshape(shape).astype(ctx.dtype), stats


def chunk_tokens(ctx: MoEContext, tokens: int) -> int:
  """Tokens per chunk of the routed experts (`ctx.chunks` of them), or one error naming what divides."""
  if ctx.chunks < 1 or tokens % ctx.chunks:
    divisors = [d for d in range(1, min(tokens, 64) + 1) if tokens % d == 0]
    raise ValueError(f"te_moe_chunks={ctx.chunks} does not divide the {tokens} tokens one device holds in "
                     f"{ctx.name}; choose one of {', '.join(map(str, divisors))}")
  return tokens // ctx.chunks


def stat_axes(mesh, tokens: P, experts_axis) -> tuple[str, ...]:
  """The mesh axes the per-device stats differ along: the tokens' and the expert axis, in mesh order. Not
  the others (tensor, or MaxText's pipeline stages, a vmap axis that shard_map's out_specs may not name):
  along those the block computes the same rows, so its stats are the same."""
  named = set()
  for entry in (*tokens, experts_axis):
    named |= set(entry) if isinstance(entry, tuple) else {entry} if entry else set()
  return tuple(a for a in mesh.axis_names if a in named)


def apply(ctx: MoEContext, x, expert_ids, weights, wi, wo, biases=(None, None, None)):
  """The routed-MoE layer's output for `x` (batch, seq, emb) routed to `expert_ids` with `weights`
  (batch, seq, top_k), on expert weights `wi` (experts, emb, 2 * ffn: [gate | up]) and `wo`
  (experts, ffn, emb), optional biases (w0, w1, wo). Returns (output, stats): stats over devices,
  `received` (max rows routed to one device), `capacity` (its receive buffer, min over devices),
  `overflow` (any), `padded` / `real` (rows at the expert GEMMs with / without alignment padding).
  """
  platform = jax.devices()[0].platform
  strategy = exchange.strategy(
      exchange.resolve(ctx.exchange, ctx.ep_size, platform, top_k=ctx.top_k, local_experts=ctx.local_experts,
                       node_size=ctx.ep_node_size)
  )
  compute = functools.partial(_per_device, ctx, strategy)
  args = (x, expert_ids, weights, wi, wo, *biases)
  if ctx.mesh is None or ctx.mesh.size == 1:
    out, stats = compute(*args)
  else:
    experts_axis = ctx.ep_axis if ctx.ep_size > 1 else None
    tokens = ctx.token_spec
    in_specs = (tokens, tokens, tokens, P(experts_axis), P(experts_axis)) + tuple(
        None if b is None else P(experts_axis) for b in biases
    )
    out, stats = jax.shard_map(
        compute,
        mesh=ctx.mesh,
        in_specs=in_specs,
        out_specs=(tokens, P(stat_axes(ctx.mesh, tokens, experts_axis))),
        check_vma=False,
    )(*args)
  if ctx.check_finite:
    out = finite_guard.guard(out, ctx.name)
  summary = {
      "received": jnp.max(stats["received"]),
      "capacity": jnp.min(stats["capacity"]),
      "overflow": jnp.any(stats["overflow"]) | jnp.any(stats["received"] > stats["capacity"]),
      "padded": jnp.sum(stats["padded"]),
      "real": jnp.sum(stats["real"]),
  }
  return out, summary
