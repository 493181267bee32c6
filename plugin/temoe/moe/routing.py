"""What routing hands the MoE core: per token its experts and combine weights, and the router's
side outputs. The router itself is MaxText's (`temoe.maxtext.router`): the core only consumes this."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Routing:
  """Per token: `experts` (batch, seq, top_k) int32 ids and their combine `weights`; and per layer:
  the load-balance loss (None when its weight is 0) and the routed-bias update (None when off)."""

  experts: jax.Array
  weights: jax.Array
  lb_loss: jax.Array | None
  bias_update: jax.Array | None
  scores: jax.Array  # (batch, seq, experts) router scores before the routed bias, for metrics
