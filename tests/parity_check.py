"""Compares temoe's block with MaxText's native dropless MoE on this process's devices.

Same config but for `te_moe_block`, same seed, so both layers hold the same parameters; the inputs are
drawn from that seed too, a fixed one (SEED), so every run compares the same problem. `CASES` is the parity
matrix: MaxText's routed-MoE model families at tiny dims, routed-only (`RoutedMoE`) and with shared experts
(`RoutedAndSharedMoE`) where the family has them, plus skewed routing (one expert takes nearly all tokens,
others none).
`python parity_check.py CASE[,CASE...] [key=value ...] [--native key=value ...]` prints one
comparison per case as JSON; `python parity_check.py --runs NAME[,NAME...]` those of FOUR_DEVICE_RUNS (the
multi-device tests run it in a process with 4 host devices).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conftest import maxtext_config
from host_mesh import FAST_COMPILE  # both blocks compiled alike: the same HLO, XLA:CPU's LLVM at -O0


@dataclasses.dataclass(frozen=True)
class Case:
  """One parity case: config overrides and how the layer and its inputs are set up."""

  overrides: tuple[str, ...] = ()
  shared: bool = False  # RoutedAndSharedMoE (routed + MaxText's shared-expert MLP) instead of RoutedMoE
  skewed: bool = False  # gate and inputs set so one expert takes nearly all tokens and two take none
  megatron_seam: bool = False  # the train step's view of the Megatron seq aux loss, as the seam installs it


# The families' own routing keys, at tiny dims (the models/*.yml shapes are far too big for CPU).
_DEFAULT = ("model_name=default", "base_emb_dim=64", "base_mlp_dim=32", "base_moe_mlp_dim=32",
            "base_num_query_heads=4", "base_num_kv_heads=4", "base_num_decoder_layers=2",
            "routed_bias=false", "routed_bias_update_rate=0.0", "n_routing_groups=-1", "topk_routing_group=-1")
_SOFTMAX_TOPK = (*_DEFAULT, "routed_score_func=''", "num_experts=16", "num_experts_per_tok=4",
                 "load_balance_loss_weight=0.01")
DEEPSEEK3 = ()  # deepseek3-smoke: sigmoid, routed bias + loss-free update, 4 groups / top-2, top-4, x2.5
DEEPSEEK2 = (*_DEFAULT, "decoder_block=deepseek", "routed_score_func=softmax", "num_experts=16",
             "num_experts_per_tok=4", "routed_scaling_factor=2.0", "load_balance_loss_weight=0.01",
             "shared_experts=2")
DEEPSEEK4 = ("override_model_config=true", "decoder_block=deepseek4", "routed_score_func=sqrtsoftplus",
             "norm_topk_prob=true", "mlp_activations_limit=0.5", "routed_scaling_factor=1.5",
             "n_routing_groups=-1", "topk_routing_group=-1")
KIMI_K2 = ("override_model_config=true", "n_routing_groups=-1", "topk_routing_group=-1",
           "routed_scaling_factor=2.827")
MIXTRAL = (*_DEFAULT, "decoder_block=mixtral", "routed_score_func=''", "num_experts=8", "num_experts_per_tok=2",
           "load_balance_loss_weight=0.01")
QWEN3_MOE = (*_SOFTMAX_TOPK, "decoder_block=qwen3_moe", "norm_topk_prob=true")
GPT_OSS = (*_SOFTMAX_TOPK, "decoder_block=gpt_oss", "routed_bias=true", "mlp_bias=true",
           "mlp_activations=['sigmoid','linear']", "mlp_activations_limit=1.0")
ENVY = (*_DEFAULT, "decoder_block=envy", "routed_score_func=''", "num_experts=8", "num_experts_per_tok=1",
        "load_balance_loss_weight=0.01")

CASES = {
    "deepseek3": Case(DEEPSEEK3),
    "deepseek3_shared_skewed": Case(DEEPSEEK3, shared=True, skewed=True),
    "deepseek3_megatron_aux_grad_accum": Case(
        (*DEEPSEEK3, "moe_use_megatron_seq_aux_loss=true", "gradient_accumulation_steps=2"), megatron_seam=True
    ),
    "kimi_k2_shared": Case(KIMI_K2, shared=True),
    "deepseek2": Case(DEEPSEEK2),
    "deepseek2_shared_skewed": Case(DEEPSEEK2, shared=True, skewed=True),
    "deepseek4": Case(DEEPSEEK4),
    "deepseek4_shared_skewed": Case(DEEPSEEK4, shared=True, skewed=True),
    "mixtral": Case(MIXTRAL),
    "mixtral_skewed": Case(MIXTRAL, skewed=True),
    "qwen3_moe": Case(QWEN3_MOE),
    "qwen3_custom_moe": Case((*_SOFTMAX_TOPK, "decoder_block=qwen3_custom_moe", "norm_topk_prob=true")),
    "qwen3_next_skewed": Case((*_SOFTMAX_TOPK, "decoder_block=qwen3_next", "norm_topk_prob=true"), skewed=True),
    "qwen3_5": Case((*_SOFTMAX_TOPK, "decoder_block=qwen3_5", "norm_topk_prob=true")),
    "gpt_oss_skewed": Case(GPT_OSS, skewed=True),
    "envy": Case(ENVY),
}
ROUTERS = ("deepseek3", "mixtral")  # the cases the multi-device tests run


SEED = 0
"""The parameters' and inputs' seed. Fixed: with a fresh draw per run the outcome depended on the draw
(mixtral_skewed with seed 858803181: the gate kernel's gradient off by 1.6e-5 relative, where expert 0 takes
every token and the routing softmax's gradient is a difference of near-equal terms)."""


def relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def routed(layer):
  """The RoutedMoE inside `layer` (itself, or a RoutedAndSharedMoE's)."""
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  return layer.routed_moe if isinstance(layer, moe.RoutedAndSharedMoE) else layer


def build(cfg, seed: int, shared: bool = False):
  """MaxText's RoutedMoE (or RoutedAndSharedMoE) for `cfg` on a mesh of this process's devices."""
  from maxtext.layers import initializers, moe  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  init = initializers.nd_dense_init(1.0, "fan_in", "truncated_normal")
  if shared:
    return moe.RoutedAndSharedMoE(
        config=cfg, mesh=mesh, kernel_init=init, kernel_axes=("embed", None), weight_dtype=cfg.weight_dtype,
        dtype=cfg.dtype, rngs=nnx.Rngs(params=seed),
    ), mesh
  layer = moe.RoutedMoE(
      config=cfg,
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      mesh=mesh,
      kernel_init=init,
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
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), compiler_options=FAST_COMPILE)
    (_, (out, lb_loss, bias_updates, sown)), grads = step(params, x)
  if bias_updates is None:  # temoe sows the update where MaxText's train step looks for it
    leaves = [v for p, v in jax.tree_util.tree_leaves_with_path(sown) if "moe_bias_updates" in jax.tree_util.keystr(p)]
    bias_updates = leaves[0] if leaves else None
  return out, lb_loss, bias_updates, grads, sown


@contextlib.contextmanager
def megatron_seam():
  """MaxText's `uses_megatron_seq_aux_loss` as temoe's seam installs it, for the config check."""
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  from temoe.maxtext import router  # pylint: disable=import-outside-toplevel

  original = moe.uses_megatron_seq_aux_loss
  moe.uses_megatron_seq_aux_loss = router.uses_megatron_seq_aux_loss
  try:
    yield
  finally:
    moe.uses_megatron_seq_aux_loss = original


def skew(layers, x, rng):
  """Gate kernels and inputs such that expert 0 wins nearly every token and the last two none:
  every input gets the same component along a direction `u` the gate kernels weigh +-3."""
  emb = x.shape[-1]
  u = rng.standard_normal(emb)
  u /= np.linalg.norm(u)
  for layer in layers:
    gate = routed(layer).gate
    kernel = np.array(gate.kernel[...])
    kernel[:, 0] += 3.0 * u
    kernel[:, -2:] -= 3.0 * u[:, None]
    gate.kernel[...] = jnp.asarray(kernel, gate.kernel[...].dtype)
  u = jnp.asarray(u, x.dtype)
  return x - (x @ u)[..., None] * u + 3.0 * u


SKEW_DRAWS = 20
"""Directions `u` tried for a skewed case, until MaxText's router sends expert 0 at least 90% of the
tokens and the last two none (under group-limited sigmoid routing one draw in many falls short)."""


def skew_until_skewed(layers, mesh, x, rng):
  """`skew` with a new direction per draw (the gate kernels reset in between), until the native layer's
  router gives the skew the parity matrix asserts; raises if no draw does."""
  kernels = [np.array(routed(layer).gate.kernel[...]) for layer in layers]
  tokens = x.shape[0] * x.shape[1]
  for _ in range(SKEW_DRAWS):
    for layer, kernel in zip(layers, kernels):
      gate = routed(layer).gate
      gate.kernel[...] = jnp.asarray(kernel, gate.kernel[...].dtype)
    skewed = skew(layers, x, rng)
    counts = expert_counts(layers[0], mesh, skewed)
    if counts[0] >= 0.9 * tokens and counts[-1] == counts[-2] == 0:
      return skewed
  raise AssertionError(f"no skew of {SKEW_DRAWS} draws sends expert 0 90% of the tokens: {counts}")


def expert_counts(layer, mesh, x) -> list[int]:
  """Tokens per expert as MaxText's own router (GateLogit + get_topk) assigns them."""
  from flax.linen import partitioning as nn_partitioning  # pylint: disable=import-outside-toplevel

  moe = routed(layer)
  with nn_partitioning.axis_rules(moe.config.logical_axis_rules), jax.set_mesh(mesh):
    experts = jax.jit(lambda x: moe.get_topk(*moe.gate(x))[1], compiler_options=FAST_COMPILE)(x)
  return np.bincount(np.asarray(experts).ravel(), minlength=moe.num_experts).tolist()


def native_side(router: str, overrides: tuple[str, ...], seed: int, batch: int) -> dict:
  """MaxText's block for `router` with `overrides`: its initial parameters, the gate it ran with (skewed or
  not), the inputs, its expert counts, and its output, aux loss, bias update and gradients. Kept per process
  (`_NATIVE`): the 4-device runs compare temoe's block on several meshes against one native run."""
  key = (router, overrides, seed, batch)
  if key in _NATIVE:
    return _NATIVE[key]
  case = CASES[router]
  cfg = maxtext_config("te_moe_block=false", *overrides)
  native, mesh = build(cfg, seed, case.shared)
  params = nnx.state(native, nnx.Param)  # as initialized: the skew below moves the gate
  side = {"cfg": cfg, "params": (jax.tree.structure(params), jax.tree.leaves(params)), "bias": None}
  if cfg.routed_bias:  # a trained bias, so routing depends on it
    side["bias"] = jax.random.normal(jax.random.key(seed + 1), routed(native).gate.bias.shape) * 0.05
    routed(native).gate.bias[...] = side["bias"]
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((batch, 32, cfg.emb_dim)), jnp.float32)
  if case.skewed:
    x = skew_until_skewed((native,), mesh, x, rng)
  side["gate_kernel"] = np.array(routed(native).gate.kernel[...])
  side["x"], side["cotangent"] = x, jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  side["expert_counts"] = expert_counts(native, mesh, x)
  side["out"], side["lb_loss"], side["bias_update"], side["grads"], _ = forward_and_grads(
      native, mesh, x, side["cotangent"])
  _NATIVE[key] = side
  return side


_NATIVE: dict[tuple, dict] = {}


def compare(router: str, *extra: str, native_extra: tuple[str, ...] | None = None, seed: int = SEED) -> dict:
  """Forward, aux loss, bias update and gradients of both blocks: relative errors and checks.

  `extra` overrides both configs (e.g. the mesh); `native_extra`, if given, replaces it for
  MaxText's block (whose expert-parallel path does not run on CPU), so temoe's EP layout is
  checked against MaxText's data-parallel one: same parameters, same math, other sharding.
  """
  case = CASES[router]
  common = ("dtype=float32", "weight_dtype=float32", "matmul_precision=highest", *case.overrides)
  with megatron_seam() if case.megatron_seam else contextlib.nullcontext():
    temoe_cfg = maxtext_config("te_moe_block=true", *common, *extra)
  ours, mesh = build(temoe_cfg, seed, case.shared)
  batch = max(4, int(mesh.size))
  native = native_side(router, (*common, *(extra if native_extra is None else native_extra)), seed, batch)
  report = {"case": router, "seed": seed, "devices": int(mesh.size), "mesh": dict(mesh.shape), "extra": list(extra)}

  native_structure, native_params = native["params"]
  our_params = nnx.state(ours, nnx.Param)
  report["same_params"] = native_structure == jax.tree.structure(our_params) and all(
      a.shape == b.shape and a.dtype == b.dtype and bool(jnp.array_equal(a, b))
      for a, b in zip(native_params, jax.tree.leaves(our_params))
  )
  if native["bias"] is not None:
    routed(ours).gate.bias[...] = native["bias"]
  if case.skewed:  # the gate as skew_until_skewed left native's
    gate = routed(ours).gate
    gate.kernel[...] = jnp.asarray(native["gate_kernel"], gate.kernel[...].dtype)
  x, cotangent = native["x"], native["cotangent"]
  report["expert_counts"] = native["expert_counts"]
  n_out, n_lb, n_bias, n_grads = native["out"], native["lb_loss"], native["bias_update"], native["grads"]
  t_out, t_lb, t_bias, t_grads, sown = forward_and_grads(ours, mesh, x, cotangent)
  native_cfg = native["cfg"]

  report["out"] = relative_error(t_out, n_out)
  report["out_norm"] = float(jnp.linalg.norm(n_out))
  report["lb_loss"] = None if n_lb is None or t_lb is None else relative_error(t_lb, n_lb)
  report["lb_loss_present"] = [n_lb is not None, t_lb is not None]
  report["bias_update_present"] = [n_bias is not None, t_bias is not None]
  report["bias_update_equal"] = (
      None if n_bias is None or t_bias is None
      else bool(np.array_equal(np.ravel(t_bias), np.ravel(n_bias)) and np.asarray(t_bias).dtype == np.asarray(n_bias).dtype)
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
  report["top_k"] = temoe_cfg.num_experts_per_tok
  report["routed_bias_update"] = bool(native_cfg.routed_bias and native_cfg.routed_bias_update_rate > 0)
  return report


FSDP4 = ("ici_fsdp_parallelism=4",)
FOUR_DEVICE_RUNS = {  # name: (cases, temoe's overrides, MaxText's: its expert-parallel path does not run on CPU)
    "expert4": (ROUTERS, ("ici_expert_parallelism=4", "ici_fsdp_parallelism=1"), FSDP4),
    "fsdp2_expert2": (ROUTERS, ("ici_expert_parallelism=2", "ici_fsdp_parallelism=2"), FSDP4),
    "fsdp4": (ROUTERS, FSDP4, FSDP4),
    # TP 2 x EP 2, the hierarchical exchange (a node of one rank) in 2 token chunks, against TP 2 x FSDP 2
    "tensor2_expert2_hier": (("deepseek3_shared_skewed",),
                             ("ici_tensor_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=1",
                              "te_moe_exchange=hier", "te_moe_ep_node_size=1", "te_moe_chunks=2"),
                             ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=2")),
}
"""The 4-host-device comparisons (tests/unit/test_parity.py, test_exchange_tensor_parallel.py)."""


def four_device_reports(tmp_path_factory) -> dict:
  """Every FOUR_DEVICE_RUNS comparison from one subprocess on 4 host devices, once per test session:
  {"reports": {run: [report per case]}, "stderr": its tail}. One process imports MaxText once and runs
  MaxText's block once per case for all of temoe's meshes (`native_side`)."""
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel

  import scripts  # pylint: disable=import-outside-toplevel
  from conftest import once_per_session, xla_flags  # pylint: disable=import-outside-toplevel

  def produce(_):
    here = os.path.dirname(os.path.abspath(__file__))
    proc = scripts.run(os.path.join(here, "parity_check.py"), "--runs", ",".join(FOUR_DEVICE_RUNS),
                       env={"XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"})
    reports = {}
    for line in proc.stdout.splitlines():
      if line.startswith("PARITY "):
        r = json.loads(line.removeprefix("PARITY "))
        reports.setdefault(r["run"], []).append(r)
    return {"reports": reports, "stderr": proc.stderr[-3000:]}

  return once_per_session(tmp_path_factory, "parity-4-devices", produce)


def run_all(names: list[str]) -> None:
  """Prints each named run's reports (one per case, the run's name in it); a case that raises prints its
  traceback in its report and the others still run."""
  import json  # pylint: disable=import-outside-toplevel
  import traceback  # pylint: disable=import-outside-toplevel

  for name in names:
    cases, ours, native = FOUR_DEVICE_RUNS[name]
    for case in cases:
      try:
        r = compare(case, *ours, native_extra=native)
      except Exception:  # pylint: disable=broad-exception-caught
        r = {"case": case, "error": traceback.format_exc()[-3000:]}
      print("PARITY " + json.dumps({"run": name, **r}), flush=True)


if __name__ == "__main__":
  import json
  import sys

  if sys.argv[1] == "--runs":
    run_all(sys.argv[2].split(","))
    sys.exit(0)
  args = sys.argv[2:]
  split = args.index("--native") if "--native" in args else len(args)
  native = tuple(args[split + 1 :]) if split < len(args) else None
  for name in sys.argv[1].split(","):
    print("PARITY " + json.dumps(compare(name, *args[:split], native_extra=native)), flush=True)
