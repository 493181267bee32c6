"""Expert-parallel exchange volume: rows and bytes one device sends per MoE layer, forward and
backward, per exchange strategy, from a config, its mesh and routing statistics.

Routing statistics are the mean number of distinct expert-parallel ranks a token's top-k experts
sit on (`distinct_ranks`): measured from expert ids (`measured_distinct_ranks`) or modelled
(`modelled_distinct_ranks`: experts uniform among the groups a group-limited router allows). The
row-per-pair exchange (ragged / padded) moves top_k rows per token each way; dedup moves
`distinct_ranks` rows plus `slots` expert ids and weights per row; hier moves `distinct_nodes` rows
over its scale-out hop (to the relays) and `distinct_ranks` inside the nodes. Rows count every row the
all-to-all moves, a device's rows to itself included; the plan's all-gathers are counted in bytes.
Rows per hop (`rows_scale_out` / `rows_in_node`, one dispatch) split them at the node boundary
(`node_size` ranks of the expert axis a node): a row leaves its node when its destination is on
another one, which the routing model makes (ep - node) / ep of a device's rows (nodes - 1) / nodes of
hier's relayed ones. hier's `hops` split its volume per hop: the scale-out hop (to the relays, the plans'
all-gathers with it) and the in-node hop (the relays' fan-out), which the step model prices one after the other.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from temoe.tools import model_size


def modelled_distinct_ranks(num_experts: int, top_k: int, ep_size: int, groups: int = 1, topk_group: int = 1) -> float:
  """E[distinct ranks per token] when a token's topk_group groups (of `groups` equal ones; 1 for no
  group limit) are uniform among the groups and its top_k experts uniform among theirs. Exact."""
  groups, topk_group = max(groups, 1), max(min(topk_group, groups), 1)
  local, size = num_experts // ep_size, num_experts // groups
  total = 0.0
  subsets = list(itertools.combinations(range(groups), topk_group))
  for chosen in subsets:
    pool = np.concatenate([np.arange(g * size, (g + 1) * size) for g in chosen])
    per_rank = np.bincount(pool // local, minlength=ep_size)
    total += sum(1.0 - math.comb(len(pool) - c, top_k) / math.comb(len(pool), top_k) for c in per_rank if c)
  return total / len(subsets)


def measured_distinct_ranks(expert_ids, local_experts: int) -> float:
  """Mean distinct ranks per token of routed `expert_ids` (..., top_k)."""
  ranks = np.sort(np.asarray(expert_ids).reshape(-1, np.shape(expert_ids)[-1]) // local_experts, axis=1)
  return float(np.mean(1 + np.sum(ranks[:, 1:] != ranks[:, :-1], axis=1)))


@dataclasses.dataclass(frozen=True)
class Volume:
  """One device, one MoE layer: rows and bytes its all-to-alls send forward and backward."""

  strategy: str
  rows_forward: float  # dispatch + return
  rows_backward: float  # their transposes
  bytes_forward: float
  bytes_backward: float
  rows_scale_out: float = 0.0  # one dispatch: rows that leave the device's node (the return moves as many)
  rows_in_node: float = 0.0  # one dispatch: rows that stay in it (NVLink, or the device itself)
  hops: tuple[Volume, ...] = ()  # hier: the scale-out hop's share, then the in-node hop's (they sum to this)

  @property
  def bytes(self) -> float:
    return self.bytes_forward + self.bytes_backward


def layer_volume(strategy: str, tokens: int, emb: int, top_k: int, ep_size: int, local_experts: int,
                 distinct_ranks: float, act_bytes: int = 2, weight_bytes: int = 4, node_size: int = 8,
                 distinct_nodes: float | None = None) -> Volume:
  """Per device and layer for `tokens` routed tokens of width `emb` in `act_bytes` per element; hier
  needs `distinct_nodes` (destination nodes per token) where the axis spans nodes of `node_size` ranks."""
  row = emb * act_bytes
  node = min(node_size, ep_size)
  leaves = (ep_size - node) / ep_size  # share of a device's destinations on other nodes
  if strategy == "hier" and ep_size <= node_size:  # one node: the exchange is dedup
    return dataclasses.replace(layer_volume("dedup", tokens, emb, top_k, ep_size, local_experts, distinct_ranks,
                                            act_bytes, weight_bytes, node_size), strategy="hier")
  if strategy == "hier":
    if distinct_nodes is None:
      raise ValueError("the hierarchical exchange's volume needs distinct_nodes (destination nodes per token)")
    nodes = ep_size // node_size
    rows1, rows2 = tokens * distinct_nodes, tokens * distinct_ranks
    width1, width2 = min(top_k, node_size * local_experts), min(top_k, local_experts)
    plan = ep_size * 3 * ep_size * 4 + ep_size * 2 * ep_size * 4  # both hops' plans gather over the whole axis
    out = rows1 * (nodes - 1) / nodes
    hops = tuple(Volume(strategy, 2 * rows, 2 * rows, 2 * rows * row + rows * width * (4 + weight_bytes) + gathered,
                        2 * rows * row + rows * width * weight_bytes, leave, rows - leave)
                 for rows, width, gathered, leave in ((rows1, width1, plan, out), (rows2, width2, 0, 0.0)))
    return Volume(strategy, *(sum(getattr(h, f) for h in hops) for f in ("rows_forward", "rows_backward",
                                                                          "bytes_forward", "bytes_backward")),
                  out, rows1 + rows2 - out, hops)
  if strategy == "dedup":
    rows, width = tokens * distinct_ranks, min(top_k, local_experts)
    meta = rows * width * (4 + weight_bytes)  # expert ids and weights, forward; weight grads back
    plan = ep_size * 2 * ep_size * 4
    fwd, bwd = 2 * rows * row + meta + plan, 2 * rows * row + rows * width * weight_bytes
  elif strategy in ("ragged", "padded"):
    rows = tokens * top_k
    plan = ep_size * ep_size * local_experts * 4
    fwd, bwd = 2 * rows * row + plan, 2 * rows * row
    if strategy == "padded":  # one slot of `rows` per peer, full
      fwd, bwd = 2 * ep_size * rows * row + plan, 2 * ep_size * rows * row
      rows = ep_size * rows
  else:
    raise ValueError(f"exchange strategy {strategy!r}; valid choices: ragged, padded, dedup, hier")
  return Volume(strategy, 2 * rows, 2 * rows, fwd, bwd, rows * leaves, rows * (1 - leaves))


def modelled_distinct_nodes(num_experts: int, top_k: int, ep_size: int, node_size: int, groups: int = 1,
                            topk_group: int = 1) -> float:
  """E[distinct destination nodes per token]: `modelled_distinct_ranks` over nodes of `node_size` ranks."""
  return modelled_distinct_ranks(num_experts, top_k, max(ep_size // node_size, 1), groups, topk_group)


def ep_size_of(mesh) -> int:
  return int(dict(mesh.shape).get("expert", 1))


def node_size_of(config) -> int:
  return int(getattr(config, "te_moe_ep_node_size", 8))


def config_volumes(config, mesh, distinct_ranks: float | None = None) -> dict[str, Volume]:
  """Per device and MoE layer, for ragged, dedup and hier (the GPU transports), from a MaxText config and
  mesh; distinct_ranks defaults to the config's router modelled (`modelled_distinct_ranks`)."""
  ep = ep_size_of(mesh)
  local = config.num_experts // ep
  groups = (config.n_routing_groups, config.topk_routing_group)
  if distinct_ranks is None:
    distinct_ranks = modelled_distinct_ranks(config.num_experts, config.num_experts_per_tok, ep, *groups)
  node = node_size_of(config)
  nodes = modelled_distinct_nodes(config.num_experts, config.num_experts_per_tok, ep, node, *groups)
  tokens = config.per_device_batch_size * config.max_target_length
  act = np.dtype(str(config.dtype)).itemsize if str(config.dtype) != "bfloat16" else 2
  return {s: layer_volume(s, int(tokens), config.emb_dim, config.num_experts_per_tok, ep, local, distinct_ranks, act,
                          node_size=node, distinct_nodes=nodes)
          for s in ("ragged", "dedup", "hier")}


def summary_lines(config, mesh) -> list[str]:
  """What `temoe plan` prints: the per-step all-to-all volume per device, each strategy, and its rows per hop
  (leaving the node / inside it) where the expert axis spans nodes."""
  ep = ep_size_of(mesh)
  if ep == 1 or config.num_experts <= 1:
    return ["  expert all-to-all: none (no expert-parallel axis)"]
  layers = model_size.layers(config).moe * max(config.gradient_accumulation_steps, 1)
  distinct = modelled_distinct_ranks(config.num_experts, config.num_experts_per_tok, ep,
                                     config.n_routing_groups, config.topk_routing_group)
  v = config_volumes(config, mesh, distinct)
  node = node_size_of(config)
  lines = [f"  expert all-to-all per step per device (EP {ep}, {layers} MoE layer passes, fwd + bwd; "
           f"{distinct:.2f} ranks/token modelled of top-{config.num_experts_per_tok}):"]
  for name in ("ragged", "dedup", "hier") if ep > node else ("ragged", "dedup"):
    hops = (f"; a dispatch: {v[name].rows_scale_out:,.0f} rows leave the node, {v[name].rows_in_node:,.0f} stay"
            if ep > node else "")
    lines.append(f"    {name:<7} {v[name].bytes * layers / 2**30:8.2f} GiB  "
                 f"({v[name].rows_forward * layers:,.0f} rows there and back in the forward pass{hops})")
  return lines
