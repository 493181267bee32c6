"""Opt-in non-finite guard (`te_moe_check_finite=true`): a NaN/Inf in a MoE layer's output, or in
the gradient reaching it, stops the step with the layer's name instead of surfacing later as a
NaN loss. An identity with a custom VJP: one reduction each way and a host callback."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


class NonFiniteError(FloatingPointError):
  """A MoE layer produced or received non-finite values."""


def _report(finite, what: str, name: str) -> None:
  if not bool(finite):
    raise NonFiniteError(f"temoe: non-finite values in the {what} of {name}.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def guard(x: jax.Array, name: str) -> jax.Array:
  jax.debug.callback(functools.partial(_report, what="output", name=name), jnp.isfinite(x).all())
  return x


def _guard_fwd(x, name):
  return guard(x, name), None


def _guard_bwd(name, _, g):
  jax.debug.callback(functools.partial(_report, what="gradient", name=name), jnp.isfinite(g).all())
  return (g,)


guard.defvjp(_guard_fwd, _guard_bwd)
