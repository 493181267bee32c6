"""Profiling scopes on MaxText's own layers (op metadata only: numerics unchanged), so `temoe
profile` splits MaxText's attention, native MoE stages and optimizer step as it splits temoe's block
(whose stages carry the same `temoe_*` scope names)."""

from __future__ import annotations

import functools


def _scoped(fn, name: str):
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    import jax  # pylint: disable=import-outside-toplevel

    with jax.named_scope(name):
      return fn(*args, **kwargs)

  wrapper.temoe_scope = name
  return wrapper


def scope_maxtext() -> None:
  """Names MaxText's attention, MoE stages and optimizer step (op metadata only: numerics unchanged)."""
  import temoe  # pylint: disable=import-outside-toplevel

  temoe.register()  # first: it points MaxText at its packaged assets before MaxText is imported
  from maxtext.common import train_state_nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import attention_mla, attentions, moe  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  for owner, attr, scope in (
      (attentions.Attention, "__call__", "temoe_attention"),
      (attention_mla.MLA, "__call__", "temoe_attention"),
      # MaxText's own MoE (te_moe_block=false), so its breakdown compares with temoe's block
      (moe.RoutedMoE, "sparse_matmul", "temoe_experts"),
      (moe.GateLogit, "__call__", "temoe_router"),
      (moe.RoutedMoE, "get_topk", "temoe_router"),
      (moe.RoutedMoE, "permute", "temoe_dispatch"),
      (moe.RoutedMoE, "local_permute", "temoe_dispatch"),
      (moe.RoutedMoE, "unpermute", "temoe_combine"),
      (train_state_nnx.TrainStateNNX, "apply_gradients", "temoe_optimizer"),
      (maxtext_utils, "apply_gradient_clipping", "temoe_optimizer"),
  ):
    fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    if not hasattr(fn, "temoe_scope"):
      setattr(owner, attr, _scoped(fn, scope))
