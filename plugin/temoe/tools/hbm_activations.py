"""What one training step's activations hold per device, for `temoe.tools.hbm`: the tensors a layer keeps
for the backward under MaxText's remat policy (probed with the names MaxText's layers give them),
and the working set of the layer being differentiated, temoe's MoE buffers included.

Tokens per device follow MaxText's activation sharding; heads and MLP widths split over the tensor
axis; MoE rows follow temoe's dispatch (rows = tokens * top_k, padded per expert to the recipe's
alignment; expert-parallel receive buffers at their dropless worst case unless ragged_buffer_factor
bounds them, as `temoe.moe.block` sizes them).
"""

from __future__ import annotations

import dataclasses
import functools

from temoe import recipes

GIB = 2**30



def xla_ragged_dot_bytes(rows: int, experts: int, emb: int, mlp: int, act: int) -> int:
  """XLA lowers jax.lax.ragged_dot densely, every row against every expert: [rows, experts * n]
  products in the activation dtype. At a MoE layer's backward five are live (the smoke train
  step's XLA:CPU buffer assignment): the forward's gate|up (n = 2 * mlp) and down (n = emb)
  products, the gradients through down (n = mlp) and gate|up (n = emb), one more of the widest."""
  return rows * experts * act * (2 * mlp + emb + mlp + emb + max(2 * mlp, emb))


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  bytes: float
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The per-device sizes the activation model needs, from the config and its mesh."""

  tokens: int  # tokens per device (micro batch)
  batch: int  # sequences per device
  seq: int
  emb: int
  tp: int  # tensor-parallel size: heads and MLP widths are split over it
  ep: int  # expert-parallel size
  act: int  # activation bytes per element (config dtype)


def shapes(config, mesh) -> Shapes:
  """Tokens per device from MaxText's activation sharding; tensor and expert axis sizes from the mesh."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import linen as nn  # pylint: disable=import-outside-toplevel

  axes = ("activation_batch", "activation_length", "activation_embed")
  spec = nn.logical_to_mesh_axes(axes, config.logical_axis_rules)
  batch = int(config.micro_batch_size_to_train_on)
  b, s, _ = jax.sharding.NamedSharding(mesh, spec).shard_shape((batch, config.max_target_length, config.emb_dim))

  return Shapes(
      tokens=b * s, batch=b, seq=s, emb=config.emb_dim, tp=dict(mesh.shape).get("tensor", 1),
      ep=dict(mesh.shape).get("expert", 1), act=np.dtype(config.dtype).itemsize,
  )


def named_tensors(config, s: Shapes, moe: bool, rows: int) -> dict[str, int]:
  """Elements per device of the tensors MaxText's layers name for remat (checkpoint_name), one layer."""
  c, t = config, s.tokens
  heads, kv_heads = max(c.num_query_heads // s.tp, 1), max(c.num_kv_heads // s.tp, 1)
  mla = str(getattr(c.attention_type, "value", c.attention_type)) == "mla"
  qk = c.qk_nope_head_dim + c.qk_rope_head_dim if mla else c.head_dim
  v = c.v_head_dim if mla else c.head_dim
  kv_heads = heads if mla else kv_heads
  names = {
      "decoder_layer_input": t * s.emb, "query_proj": t * heads * qk, "key_proj": t * kv_heads * qk,
      "value_proj": t * kv_heads * v, "context": t * heads * v, "attention_out": t * heads * v, "out_proj": t * s.emb,
  }
  if mla:
    names.update(mla_q=t * c.q_lora_rank, query_wa_proj=t * c.q_lora_rank,
                 mla_kv=t * c.kv_lora_rank, kv_wa_proj=t * (c.kv_lora_rank + c.qk_rope_head_dim))
  else:
    names["qkv_proj"] = t * (heads + 2 * kv_heads) * c.head_dim
  if moe:
    shared = t * c.shared_experts * c.moe_mlp_dim // s.tp
    names.update(mlpwi_0=rows * c.moe_mlp_dim + shared, mlpwi_1=rows * c.moe_mlp_dim + shared,
                 mlpwo=rows * s.emb + (t * s.emb if c.shared_experts else 0),
                 moe_mlpwi_0=rows * c.moe_mlp_dim, moe_mlpwi_1=rows * c.moe_mlp_dim, moe_mlpwo=rows * s.emb)
  else:
    names.update(mlpwi_0=t * c.mlp_dim // s.tp, mlpwi_1=t * c.mlp_dim // s.tp, mlpwo=t * s.emb)
  return names


def remat_policy(config):
  """MaxText's checkpoint policy for this config (None: save nothing but the layer inputs)."""
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  return introspect.remat_policy(config)


@functools.cache
def _name_primitive():
  """The primitive `checkpoint_name` binds (what remat policies are asked about), found by tracing."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.ad_checkpoint import checkpoint_name  # pylint: disable=import-outside-toplevel

  return jax.make_jaxpr(lambda x: checkpoint_name(x, "probe"))(1.0).eqns[0].primitive


def placement(policy, name: str, config) -> str:
  """Where the policy keeps a named tensor: 'device', 'host' or 'remat' (recomputed)."""
  import jax  # pylint: disable=import-outside-toplevel

  if config.remat_policy == "none":
    return "device"
  decision = policy(_name_primitive(), jax.ShapeDtypeStruct((1,), "float32"), name=name) if policy else False
  if hasattr(decision, "dst"):  # an Offloadable(src, dst) decision (jax.checkpoint_policies' offload policies)
    return "host" if decision.dst == "pinned_host" else "device"
  if decision is True or type(decision).__name__ == "SaveableType" or name == "decoder_layer_input":
    return "device"  # decoder_layer_input: each layer's remat start point, kept by the scan unless offloaded
  return "remat"


def saved_activations(config, s: Shapes, rows: int) -> Part:
  """Bytes every layer keeps on device for the backward under the remat policy, all layers."""
  policy = remat_policy(config)
  moe_layers = config.num_decoder_layers - config.first_num_dense_layers if config.num_experts > 1 else 0
  total, host, kept = 0, 0, set()
  for moe, count in ((False, config.num_decoder_layers - moe_layers), (True, moe_layers)):
    if count <= 0:
      continue
    names = named_tensors(config, s, moe, rows)
    where = {n: placement(policy, n, config) for n in names}
    for twin in ("mlpwi_0", "mlpwi_1", "mlpwo"):  # temoe and MaxText give these tensors two names
      if where[twin] != "remat":
        where[f"moe_{twin}"] = "remat"
    kept.update(n for n, w in where.items() if w == "device")
    total += count * sum(names[n] for n, w in where.items() if w == "device") * s.act
    host += count * sum(names[n] for n, w in where.items() if w == "host") * s.act
  note = f"remat_policy={config.remat_policy}: {', '.join(sorted(kept)) or 'nothing'} per layer"
  return Part("saved activations", total, note + (f"; {host / GIB:.2f} GiB offloaded to host" if host else ""))


def moe_rows(config, s: Shapes, backend: str) -> tuple[int, int, int]:
  """(routed rows, rows of the expert buffer, expert-parallel receive capacity) per device, for
  expert kernel `backend` (temoe's: xla, te, mosaic; MaxText's own MoE: gmm, unpadded)."""
  from temoe.moe import dispatch, exchange  # pylint: disable=import-outside-toplevel

  routed = s.tokens * config.num_experts_per_tok
  recipe = str(config.te_gmm_quantization)
  align = recipes.row_alignment(recipe, backend) if recipe in recipes.REGISTRY and backend in recipes.KERNELS else 1
  if s.ep == 1:
    return routed, dispatch.buffer_rows(routed, config.num_experts, align), 0
  capacity = exchange.receive_capacity(routed, s.ep, config.ragged_buffer_factor)
  return routed, dispatch.buffer_rows(capacity, config.num_experts // s.ep + 1, align), capacity


def moe_layer(config, s: Shapes, backend: str) -> float:
  """temoe's block, one layer: its forward buffers, recomputed, and the widest gradients (bytes per device)."""
  c = config
  routed, rows, capacity = moe_rows(c, s, backend)
  local = c.num_experts // s.ep
  m, e, a = c.moe_mlp_dim, s.emb, s.act
  forward = rows * (e + 2 * m + m + e) * a  # dispatched rows, fused gate|up, activation, expert output
  forward += routed * e * (4 if c.float32_weight_sum else a)  # per-choice outputs the combine weighs
  forward += s.tokens * c.num_experts * 4 * 3  # router logits, scores, top-k in float32
  if capacity:
    forward += 2 * (routed + capacity) * e * a  # exchange there and back
  extra = 0.0
  if backend == "xla":
    extra = xla_ragged_dot_bytes(rows, local, e, m, a)
  elif backend in ("te", "mosaic"):
    extra = recipes.REGISTRY[str(c.te_gmm_quantization)].quantized_copy_bytes(local * (e * 2 * m + m * e), rows, e, m)
  in_flight = rows * (e + 2 * m) * a  # the backward's widest gradients: of the dispatched rows and of gate|up
  shared = s.tokens * c.shared_experts * m // s.tp * 3 * a
  return forward + in_flight + extra + 2 * shared


def attention(config, s: Shapes) -> float:
  """One attention block's forward tensors and their gradients, plus the score matrix if materialized."""
  names = named_tensors(config, s, False, 0)
  tensors = sum(v for k, v in names.items() if not k.startswith("mlp") and k != "decoder_layer_input") * s.act
  kernel = str(config.attention)
  dense = kernel == "dot_product" or (kernel == "autoselected" and (config.hardware == "cpu" or s.seq < 128))
  heads = max(config.num_query_heads // s.tp, 1)
  scores = s.batch * heads * s.seq * s.seq * 4 * 2 if dense else 0
  return 2 * tensors + scores


def dense_mlp(config, s: Shapes) -> float:
  return 2 * s.tokens * (3 * config.mlp_dim // s.tp + s.emb) * s.act


def loss(config, s: Shapes) -> Part:
  tokens = s.tokens / max(config.num_vocab_tiling, 1)
  vocab = config.vocab_size / s.tp
  return Part("loss (logits)", tokens * vocab * (s.act + 3 * 4),
              "logits; float32 log-softmax, one-hot targets, gradient")
