"""Expert-parallel exchange: how one device's routed rows reach the devices owning their experts,
and the expert outputs come back. One interface, several strategies (`STRATEGIES`):

  local    one device, or no expert axis: dispatch -> experts -> combine, nothing crosses devices
  ragged   one row per (token, expert) pair, `jax.lax.ragged_all_to_all` both ways (GPU)
  padded   the same plan through a padded `all_to_all` (XLA:CPU has no ragged all-to-all)
  dedup    one row per distinct (token, rank), expanded and combined on the receiver (`dedup`);
           ragged all-to-all on GPUs, padded on XLA:CPU; `auto` where a rank holds several experts
  hier     dedup in two hops where the expert axis spans nodes (`hier`): one row per (token, node) over
           the scale-out network to a relay, then one per (token, rank) inside the node; `dedup` on one node

A strategy is `run(ctx, x, expert_ids, weights, mlp) -> (out, stats)` on one device's tokens inside
`shard_map`: x (tokens, emb), expert_ids / weights (tokens, top_k), `mlp(buffer, plan) -> buffer`
the expert MLP on this device's local experts. `stats` holds (1,) int32/bool arrays: `received`
((token, expert) pairs routed to this device before any capacity cut: its rows, but for dedup), `capacity`, `overflow`, and `padded` /
`real` (rows at the expert GEMMs with and without alignment padding). The TOKENS_MLP strategies also
take `tokens_mlp(rows, plan, weights, **layout) -> out`, the expert kernel's MLP from rows with the
gather and the weighted sum fused into it, in place of dispatch -> mlp -> combine.
"""

from __future__ import annotations

import importlib
import math

STRATEGIES = ("local", "ragged", "padded", "dedup", "hier")
"""The exchange strategies; `auto` resolves to one of them (`resolve`)."""

TOKENS_MLP = ("local", "dedup", "hier")
"""The strategies that take an expert kernel's MLP from tokens (`run(..., tokens_mlp=)`): where rows reach
the experts by one local gather (of the tokens, or of the received rows), which the kernel's quantizer
can do as it reads."""

CHOICES = ("auto", "ragged", "padded", "dedup", "hier")
"""What a run may ask for (MaxText's `te_moe_exchange`); one device, or no expert axis, is `local`."""


def check_choice(name: str) -> str:
  """`name` if it is one of CHOICES, else one error naming them."""
  if name not in CHOICES:
    raise ValueError(f"te_moe_exchange={name!r}; valid choices: {', '.join(CHOICES)}.")
  return name


def receive_capacity(routed_rows: int, ep_size: int, buffer_factor: float) -> int:
  """Rows one device's receive buffer holds: the worst case (every device sends it all its routed
  rows: dropless) unless MaxText's `ragged_buffer_factor` > 0 bounds it to that many times its own."""
  capacity = routed_rows * ep_size
  if buffer_factor > 0:
    capacity = min(capacity, math.ceil(routed_rows * buffer_factor))
  return capacity


def check_node_size(node_size: int, ep_size: int | None = None) -> int:
  """`node_size` (ranks per node along the expert axis) if it is >= 1 and, where the expert axis is known,
  divides it or holds it whole; else one error saying what fits."""
  if not isinstance(node_size, int) or node_size < 1:
    raise ValueError(f"te_moe_ep_node_size={node_size!r}: ranks per node along the expert axis, an integer >= 1.")
  if ep_size is not None and ep_size > node_size and ep_size % node_size:
    raise ValueError(f"te_moe_ep_node_size={node_size} does not divide the expert axis ({ep_size} ranks): "
                     f"set it to the ranks of the axis that share a node (ici_expert_parallelism).")
  return node_size


def resolve(name: str, ep_size: int, device_platform: str, top_k: int = 1, local_experts: int = 1,
            node_size: int = 8) -> str:
  """The strategy `name` (one of CHOICES) means for this expert axis and platform. `auto` is dedup
  where it sends fewer rows (a token can reach two experts of one rank: top_k > 1 and
  local_experts > 1; never more rows), else the row-per-pair exchange for the platform. `hier` is
  dedup where the axis fits one node (`node_size` ranks): there is no scale-out hop."""
  if ep_size == 1:
    return "local"
  if name not in CHOICES:
    raise ValueError(f"expert-parallel exchange {name!r}; valid choices: {', '.join(CHOICES)}.")
  if name == "auto":
    if top_k > 1 and local_experts > 1:
      return "dedup"
    return "padded" if device_platform == "cpu" else "ragged"
  if name == "hier":
    check_node_size(node_size, ep_size)
    return "hier" if ep_size > node_size else "dedup"
  return name


def strategy(name: str):
  """The module implementing strategy `name` (its `run`)."""
  return importlib.import_module(f"temoe.moe.exchange.{name}")
