"""Compares temoe's block with MaxText's native dropless MoE on this process's devices.

Same config but for `te_moe_block`, same seed, so both layers hold the same parameters; fresh
random inputs each call. `python parity_check.py ROUTER [key=value ...]` prints the comparison as
JSON (the multi-device tests run it in a process with several host devices).
"""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np
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
  """As MaxText's train step calls it: under the mesh and the config's logical axis rules."""
  from flax.linen import partitioning as nn_partitioning  # pylint: disable=import-outside-toplevel

  with nn_partitioning.axis_rules(layer.config.logical_axis_rules):
    return _forward_and_grads(layer, mesh, x, cotangent)


def _forward_and_grads(layer, mesh, x, cotangent):
  """Output, aux loss, bias update and grads of <out, cotangent> + aux wrt x and every Param."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    model = nnx.merge(graphdef, params, rest)
    out, lb_loss, bias_updates = model(x)
    sown = nnx.state(model, nnx.Intermediate)
    objective = jnp.sum(out * cotangent) + (0.0 if lb_loss is None else lb_loss)
    return objective, (out, lb_loss, bias_updates, sown)

  with jax.set_mesh(mesh):
    (_, (out, lb_loss, bias_updates, sown)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x
    )
  if bias_updates is None:  # temoe sows the update where MaxText's train step looks for it
    leaves = [v for p, v in jax.tree_util.tree_leaves_with_path(sown) if "moe_bias_updates" in jax.tree_util.keystr(p)]
    bias_updates = leaves[0] if leaves else None
  return out, lb_loss, bias_updates, grads, sown


def compare(router: str, *extra: str, native_extra: tuple[str, ...] | None = None) -> dict:
  """Forward, aux loss, bias update and gradients of both blocks: relative errors and checks.

  `extra` overrides both configs (e.g. the mesh); `native_extra`, if given, replaces it for
  MaxText's block (whose expert-parallel path does not run on CPU), so temoe's EP layout is
  checked against MaxText's data-parallel one: same parameters, same math, other sharding.
  """
  seed = secrets.randbits(31)
  common = ("dtype=float32", "weight_dtype=float32", "matmul_precision=highest", *ROUTERS[router])
  native_cfg = maxtext_config("te_moe_block=false", *common, *(extra if native_extra is None else native_extra))
  temoe_cfg = maxtext_config("te_moe_block=true", *common, *extra)
  native, native_mesh = build(native_cfg, seed)
  ours, mesh = build(temoe_cfg, seed)
  report = {"seed": seed, "devices": int(mesh.size), "mesh": dict(mesh.shape)}

  native_params = nnx.state(native, nnx.Param)
  our_params = nnx.state(ours, nnx.Param)
  same_structure = jax.tree.structure(native_params) == jax.tree.structure(our_params)
  report["same_params"] = same_structure and all(
      a.shape == b.shape and a.dtype == b.dtype and bool(jnp.array_equal(a, b))
      for a, b in zip(jax.tree.leaves(native_params), jax.tree.leaves(our_params))
  )
  if native_cfg.routed_bias:  # a trained bias, so routing depends on it
    bias = jax.random.normal(jax.random.key(seed + 1), ours.gate.bias.shape) * 0.05
    native.gate.bias.value, ours.gate.bias.value = bias, bias

  rng = np.random.default_rng(seed)
  batch = max(4, int(mesh.size))
  x = jnp.asarray(rng.standard_normal((batch, 32, native_cfg.emb_dim)), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  n_out, n_lb, n_bias, n_grads, _ = forward_and_grads(native, native_mesh, x, cotangent)
  t_out, t_lb, t_bias, t_grads, sown = forward_and_grads(ours, mesh, x, cotangent)

  report["out"] = relative_error(t_out, n_out)
  report["out_norm"] = float(jnp.linalg.norm(n_out))
  report["lb_loss"] = None if n_lb is None or t_lb is None else relative_error(t_lb, n_lb)
  report["lb_loss_present"] = [n_lb is not None, t_lb is not None]
  report["bias_update_present"] = [n_bias is not None, t_bias is not None]
  report["bias_update_equal"] = (
      None if n_bias is None or t_bias is None else bool(np.array_equal(np.ravel(t_bias), np.ravel(n_bias)))
  )
  report["dx"] = relative_error(t_grads[1], n_grads[1])
  n_flat = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(n_grads[0])}
  t_flat = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(t_grads[0])}
  report["same_grad_leaves"] = n_flat.keys() == t_flat.keys()
  report["param_grads"] = {k: relative_error(t_flat[k], g) for k, g in n_flat.items() if k in t_flat}
  report["param_grad_norms"] = {k: float(jnp.linalg.norm(g)) for k, g in n_flat.items()}
  named = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(sown)}
  report["received"] = [int(v) for k, v in named.items() if "te_moe_total_recv_tokens" in k]
  report["overflow"] = [bool(v) for k, v in named.items() if "te_moe_capacity_overflow" in k]
  report["routed_rows"] = batch * 32 * temoe_cfg.num_experts_per_tok
  return report


if __name__ == "__main__":
  import json
  import sys

  args = sys.argv[2:]
  split = args.index("--native") if "--native" in args else len(args)
  native = tuple(args[split + 1 :]) if split < len(args) else None
  print("PARITY " + json.dumps(compare(sys.argv[1], *args[:split], native_extra=native)))
