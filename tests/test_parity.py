"""temoe's block against MaxText's native dropless MoE (sparse_matmul + ragged_dot), float32.

Same config but for `te_moe_block`, same seed, so both layers hold the same parameters; fresh
random inputs each run. Forward output, load-balance loss, routed-bias update and gradients with
respect to the input and every parameter must agree to 1e-5 relative error.
"""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import maxtext_config

ROUTERS = {
    # DeepSeek-V3: sigmoid scores, routed bias + its loss-free update, 4 groups / top-2 groups,
    # top-4 experts, routed_scaling_factor 2.5, aux loss on.
    "deepseek3": (),
    # Mixtral-style: softmax over the top-2 logits, no bias, no groups, aux loss on.
    "softmax_top2": (
        "model_name=default",
        "decoder_block=mixtral",
        "base_emb_dim=64",
        "base_moe_mlp_dim=32",
        "base_mlp_dim=32",
        "base_num_query_heads=4",
        "base_num_kv_heads=4",
        "base_num_decoder_layers=2",
        "num_experts=8",
        "num_experts_per_tok=2",
        "routed_score_func=''",
        "routed_bias=false",
        "routed_bias_update_rate=0.0",
        "n_routing_groups=-1",
        "topk_routing_group=-1",
        "load_balance_loss_weight=0.01",
    ),
}


def relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def build(cfg, seed: int):
  """MaxText's RoutedMoE for `cfg` on a mesh of this process's devices."""
  from maxtext.layers import initializers, moe  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  layer = moe.RoutedMoE(
      config=cfg,
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      mesh=mesh,
      kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
      kernel_axes=("embed", None),
      intermediate_dim=cfg.moe_mlp_dim,
      weight_dtype=cfg.weight_dtype,
      dtype=cfg.dtype,
      rngs=nnx.Rngs(params=seed),
  )
  return layer, mesh


def forward_and_grads(layer, mesh, x, cotangent):
  """Output, aux loss, bias update and grads of <out, cotangent> + aux wrt x and every Param."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    model = nnx.merge(graphdef, params, rest)
    out, lb_loss, bias_updates = model(x)
    sown = nnx.state(model, nnx.Intermediate)
    objective = jnp.sum(out * cotangent) + (0.0 if lb_loss is None else lb_loss)
    return objective, (out, lb_loss, bias_updates, sown)

  with mesh:
    (_, (out, lb_loss, bias_updates, sown)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x
    )
  if bias_updates is None:  # temoe sows the update where MaxText's train step looks for it
    leaves = [v for p, v in jax.tree_util.tree_leaves_with_path(sown) if "moe_bias_updates" in jax.tree_util.keystr(p)]
    bias_updates = leaves[0] if leaves else None
  return out, lb_loss, bias_updates, grads, sown


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_block_matches_maxtext_native_moe(router):
  seed = secrets.randbits(31)
  common = ("dtype=float32", "weight_dtype=float32", "matmul_precision=highest", *ROUTERS[router])
  native_cfg = maxtext_config("te_moe_block=false", *common)
  temoe_cfg = maxtext_config("te_moe_block=true", *common)
  native, mesh = build(native_cfg, seed)
  ours, _ = build(temoe_cfg, seed)

  native_params = nnx.state(native, nnx.Param)
  our_params = nnx.state(ours, nnx.Param)
  assert jax.tree.structure(native_params) == jax.tree.structure(our_params)
  for a, b in zip(jax.tree.leaves(native_params), jax.tree.leaves(our_params)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  if native_cfg.routed_bias:  # a trained bias, so routing depends on it
    bias = jax.random.normal(jax.random.key(seed + 1), ours.gate.bias.shape) * 0.05
    native.gate.bias.value, ours.gate.bias.value = bias, bias

  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((4, 32, native_cfg.emb_dim)), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  n_out, n_lb, n_bias, n_grads, _ = forward_and_grads(native, mesh, x, cotangent)
  t_out, t_lb, t_bias, t_grads, sown = forward_and_grads(ours, mesh, x, cotangent)

  assert relative_error(t_out, n_out) < 1e-5, f"seed {seed}"
  assert float(jnp.linalg.norm(n_out)) > 0
  assert (n_lb is None) == (t_lb is None)
  if n_lb is not None:
    assert relative_error(t_lb, n_lb) < 1e-5, f"seed {seed}"
  assert (n_bias is None) == (t_bias is None) == (not native_cfg.routed_bias)
  if n_bias is not None:
    np.testing.assert_array_equal(np.asarray(t_bias).reshape(-1), np.asarray(n_bias).reshape(-1))
  n_dx, t_dx = n_grads[1], t_grads[1]
  assert relative_error(t_dx, n_dx) < 1e-5, f"seed {seed}"
  n_flat = dict(jax.tree_util.tree_leaves_with_path(n_grads[0]))
  t_flat = dict(jax.tree_util.tree_leaves_with_path(t_grads[0]))
  assert n_flat.keys() == t_flat.keys() and len(n_flat) >= 3  # gate kernel, wi, wo
  for path, n_g in n_flat.items():
    assert float(jnp.linalg.norm(n_g)) > 0, jax.tree_util.keystr(path)
    assert relative_error(t_flat[path], n_g) < 1e-5, f"{jax.tree_util.keystr(path)} seed {seed}"

  # What MaxText's train step reads with te_moe_block=true: no overflow in a dropless block.
  named = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(sown)}
  recv = [v for k, v in named.items() if "te_moe_total_recv_tokens" in k]
  overflow = [v for k, v in named.items() if "te_moe_capacity_overflow" in k]
  assert int(recv[0]) == x.shape[0] * x.shape[1] * temoe_cfg.num_experts_per_tok
  assert not bool(overflow[0])
