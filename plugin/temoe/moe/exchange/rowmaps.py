"""Row gathers that carry both index maps, so each gradient is the other direction's gather (custom
VJPs), never the scatter-add autodiff would make of a gather. `fan_out` copies source rows to the
rows they feed (one source may feed several); `fan_in` sums, for each output row, the rows listed for
it: its transpose. An index equal to the length of the indexed array reads a zero row."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def take(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[index] along axis 0, where index == len(x) reads zeros."""
  return jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])[index]


@jax.custom_vjp
def fan_out(x, sources, targets):
  """out[j] = x[sources[j]]. `targets` (len(x), fan): the out rows each x row feeds (len(out): none);
  it must list exactly the j with sources[j] == i. Gradient: gather by targets, summed over fan."""
  del targets
  return take(x, sources)


def _fan_out_fwd(x, sources, targets):
  return take(x, sources), (sources, targets)


def _fan_out_bwd(res, g):
  _, targets = res
  return take(g, targets).sum(axis=1, dtype=jnp.float32).astype(g.dtype), None, None


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


@jax.custom_vjp
def fan_in(y, targets, sources):
  """out[i] = sum over f of y[targets[i, f]] (len(y): nothing), summed in float32 and returned so.
  `sources` (len(y),): the out row each y row is summed into (len(out): none). Gradient: gather by
  sources."""
  del sources
  return take(y, targets).sum(axis=1, dtype=jnp.float32)


def _fan_in_fwd(y, targets, sources):
  return fan_in(y, targets, sources), (sources, jnp.zeros((0,), y.dtype))


def _fan_in_bwd(res, g):
  sources, like = res
  return take(g, sources).astype(like.dtype), None, None


fan_in.defvjp(_fan_in_fwd, _fan_in_bwd)
