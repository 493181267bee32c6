"""What one training step's activations hold per device, for `temoe.tools.hbm`: the tensors a layer keeps
for the backward under MaxText's remat policy (probed with the names MaxText's layers give them),
and the working set of the layer being differentiated, temoe's MoE buffers included.

Tokens per device follow MaxText's activation sharding; heads and MLP widths split over the tensor
axis; MoE rows follow temoe's dispatch (rows = tokens * top_k, padded per expert to the recipe's
alignment; expert-parallel receive buffers at their dropless worst case unless ragged_buffer_factor
bounds them, as `temoe.moe.block` sizes them).

A MoE layer's backward runs in steps (the remat recompute of its forward, then the backward of the
down GEMM, then of the gate/up GEMM), and each step holds its own buffers: the working set is the
largest step, not the sum of every buffer the layer ever allocates. FP8 recipes add the quantized
copies each step reads (recipes.py's operand_bytes per element, both layouts where a GEMM and its
wgrad read both).
"""

from __future__ import annotations

import dataclasses
import functools

from temoe import recipes
from temoe.tools import model_size

GIB = 2**30

CONTEXT_NAMING_KERNELS = ("cudnn_flash_jax",)
"""GPU attention kernels whose output MaxText 0.2.5 names `context` (cudnn_flash_te's, the TE bridge, is unnamed)."""


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


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of a layer's forward that MaxText names for remat: saved if any of its names is."""

  names: tuple[str, ...]
  elements: int  # per device
  itemsize: float = 0.0  # bytes per element (scales included); 0: the activation dtype's


def attention_tensors(config, s: Shapes) -> list[Tensor]:
  """A layer's input and its attention block's named tensors."""
  c, t = config, s.tokens
  heads, kv_heads = max(c.num_query_heads // s.tp, 1), max(c.num_kv_heads // s.tp, 1)
  mla = str(getattr(c.attention_type, "value", c.attention_type)) == "mla"
  qk = c.qk_nope_head_dim + c.qk_rope_head_dim if mla else c.head_dim
  v = c.v_head_dim if mla else c.head_dim
  kv_heads = heads if mla else kv_heads
  out = [Tensor(("decoder_layer_input",), t * s.emb), Tensor(("query_proj",), t * heads * qk),
         Tensor(("key_proj",), t * kv_heads * qk), Tensor(("value_proj",), t * kv_heads * v),
         Tensor(("attention_out",), t * heads * v), Tensor(("out_proj",), t * s.emb)]
  if str(c.attention) in CONTEXT_NAMING_KERNELS:
    out.append(Tensor(("context",), t * heads * v))
  if mla:
    out += [Tensor(("query_wa_proj",), t * c.q_lora_rank), Tensor(("mla_q",), t * c.q_lora_rank),
            Tensor(("kv_wa_proj",), t * (c.kv_lora_rank + c.qk_rope_head_dim)), Tensor(("mla_kv",), t * c.kv_lora_rank)]
  else:
    out.append(Tensor(("qkv_proj",), t * (heads + 2 * kv_heads) * c.head_dim))
  return out


def mlp_tensors(s: Shapes, width: int) -> list[Tensor]:
  """MaxText's MlpBlock (dense layers, shared experts): gate, up and down outputs."""
  return [Tensor(("mlpwi_0",), s.tokens * width), Tensor(("mlpwi_1",), s.tokens * width),
          Tensor(("mlpwo",), s.tokens * s.emb)]


def layer_tensors(config, s: Shapes, moe: bool, rows: int, backend: str) -> list[Tensor]:
  """Elements per device of the tensors one layer names for remat (checkpoint_name).

  The routed experts' gate half carries mlpwi_0 and moe_mlpwi_0, the up half only moe_mlpwi_1, the
  down output mlpwo and moe_mlpwo: MaxText 0.2.5's sparse path names them so and temoe's block
  (moe/experts/parts.py) the same, so minimal_with_context keeps the gate half and the down output
  but not the up half."""
  c = config
  out = attention_tensors(config, s)
  if not moe:
    return out + mlp_tensors(s, c.mlp_dim // s.tp)
  out += [Tensor(("mlpwi_0", "moe_mlpwi_0"), rows * c.moe_mlp_dim), Tensor(("moe_mlpwi_1",), rows * c.moe_mlp_dim),
          Tensor(("mlpwo", "moe_mlpwo"), rows * s.emb)]
  if backend == "gmm":  # MaxText's own sparse path names its expert-sorted input
    out.append(Tensor(("moe_x_sorted",), rows * s.emb))
  out += quantized_residuals(config, s, rows, backend, up_recomputed=_up_recomputed(config))
  if c.shared_experts:
    out += mlp_tensors(s, c.shared_experts * c.moe_mlp_dim // s.tp)
  return out


def quantized_residuals(config, s: Shapes, rows: int, backend: str, up_recomputed: bool = True) -> list[Tensor]:
  """The FP8 copies temoe's Hopper kernels keep for a MoE layer's backward, named `quantization` as
  MaxText names its own (moe/experts/parts.py): x^T and h^T, and wi and wo as stored, with their scales
  (what the backward reads; under current scaling only te_moe_fp8_weights keeps those, else the backward
  casts the weights again), and, where the policy recomputes the gate/up GEMM (up_recomputed: it keeps
  neither or one half of its output), x and wi^T (what that recompute reads; the down GEMM's output,
  mlpwo, is kept, so h and wo^T are not). The weights' copies are also named te_moe_fp8_weights, which
  temoe's flag of that name keeps alone. A 128 x 128 weight block's scale is 1/128 of the bytes of a
  1 x 128 activation block's; w and w^T share theirs."""
  from temoe.moe.experts import parts  # pylint: disable=import-outside-toplevel

  q = operand_bytes(config, backend)
  if backend != "mosaic" or not q:
    return []
  scaling = recipes.REGISTRY[str(config.te_gmm_quantization)].scaling
  local = config.num_experts // s.ep
  # as the copies are padded: emb, the expert ffn, and the fused [gate | up] width
  e, m, m2 = (recipes.mosaic_copy_dim(d, scaling) for d in (s.emb, config.moe_mlp_dim, 2 * config.moe_mlp_dim))
  weight_q = 1.0 + (q - 1.0) / 128
  act, weights = (parts.QUANTIZED,), (parts.QUANTIZED, parts.FP8_WEIGHTS)
  # current scaling's backward casts the weights again from the saved scales unless te_moe_fp8_weights
  # keeps its copies (mosaic_gemm.grouped_matmul's keep_fp8_weights): only that name keeps them
  stored = (parts.FP8_WEIGHTS,) if scaling == "current" else weights
  backward = [Tensor(act, rows * e, q), Tensor(act, rows * m, q),
              Tensor(stored, local * e * m2, weight_q), Tensor(stored, local * m * e, weight_q)]
  if not up_recomputed:
    return backward
  return backward + [Tensor(act, rows * e, q), Tensor(weights, local * e * m2, 1.0)]


def _up_recomputed(config) -> bool:
  """Whether the backward recomputes the routed experts' gate/up GEMM: the policy keeps not both halves."""
  policy = remat_policy(config)
  halves = (Tensor(("mlpwi_0", "moe_mlpwi_0"), 0), Tensor(("moe_mlpwi_1",), 0))
  return any(kept(policy, half, config) == "remat" for half in halves)


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

  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  if not introspect.checkpointed(config):  # unscanned, remat_policy none: everything the step computes is kept
    return "device"  # (scanned ones are wrapped with policy None: everything recomputed)
  decision = policy(_name_primitive(), jax.ShapeDtypeStruct((1,), "float32"), name=name) if policy else False
  if hasattr(decision, "dst"):  # an Offloadable(src, dst) decision (jax.checkpoint_policies' offload policies)
    return "host" if decision.dst == "pinned_host" else "device"
  if decision is True or type(decision).__name__ == "SaveableType" or name == "decoder_layer_input":
    return "device"  # decoder_layer_input: each layer's remat start point, kept by the scan unless offloaded
  return "remat"


def kept(policy, tensor: Tensor, config) -> str:
  """Where a tensor with several names is kept: on the device if any name is, else on the host if any is."""
  where = {placement(policy, n, config) for n in tensor.names}
  return "device" if "device" in where else "host" if "host" in where else "remat"


@dataclasses.dataclass(frozen=True)
class Saved:
  """What every layer keeps for the backward, per device: bytes on device for the dense and the MoE layers."""

  dense: float
  moe: float
  host: float
  names: tuple[str, ...]

  def part(self, config) -> Part:
    note = f"remat_policy={config.remat_policy}: {', '.join(self.names) or 'nothing'} per layer"
    host = f"; {self.host / GIB:.2f} GiB offloaded to host" if self.host else ""
    if "quantization" in self.names:
      note += " (quantization: the expert GEMMs' FP8 copies; MaxText's dense FP8 layers' own are not counted)"
    elif "te_moe_fp8_weights" in self.names:
      note += " (te_moe_fp8_weights: the expert weights' FP8 copies)"
    return Part("saved activations", self.dense + self.moe, note + host)


def saved_activations(config, s: Shapes, rows: int, backend: str) -> Saved:
  """Bytes every layer keeps for the backward under the remat policy, all layers, split dense / MoE."""
  policy = remat_policy(config)
  moe_layers = model_size.layers(config).moe
  total, host, names = {False: 0.0, True: 0.0}, 0.0, set()
  for moe, count in ((False, config.num_decoder_layers - moe_layers), (True, moe_layers)):
    if count <= 0:
      continue
    for tensor in layer_tensors(config, s, moe, rows, backend):
      where = kept(policy, tensor, config)
      size = count * tensor.elements * (tensor.itemsize or s.act)
      if where == "device":
        names.add(next(n for n in tensor.names if placement(policy, n, config) == "device"))
        total[moe] += size
      elif where == "host":
        host += size
  return Saved(total[False], total[True], host, tuple(sorted(names)))


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


def exchange_bytes(config, s: Shapes, device_platform: str) -> float:
  """The expert-parallel exchange's buffers, there and back: each direction a send and a receive buffer
  (temoe.moe.exchange): a device sends its routed rows (dedup: one per token and destination rank); the
  ragged transport receives into its capacity, XLA:CPU's padded one keeps a slot of the send rows per
  sender on both sides. hier has two of each (`hier_rows`)."""
  from temoe.moe import exchange  # pylint: disable=import-outside-toplevel
  from temoe.moe.exchange import dedup_plan  # pylint: disable=import-outside-toplevel

  if s.ep == 1:
    return 0.0
  top_k, local = config.num_experts_per_tok, config.num_experts // s.ep
  node = int(getattr(config, "te_moe_ep_node_size", 8))
  name = exchange.resolve(str(config.te_moe_exchange), s.ep, device_platform, top_k=top_k, local_experts=local,
                          node_size=node)
  routed = s.tokens * top_k
  capacity = exchange.receive_capacity(routed, s.ep, config.ragged_buffer_factor)
  if name == "hier":
    return 2 * sum(hier_rows(s.tokens, top_k, s.ep, local, node, capacity, device_platform)) * s.emb * s.act
  sent = dedup_plan.send_rows(s.tokens, top_k, s.ep) if name == "dedup" else routed
  if device_platform == "cpu" or name == "padded":
    send = receive = sent * s.ep
  else:
    send, receive = sent, min(capacity, sent * s.ep)
  return 2 * (send + receive) * s.emb * s.act


def hier_rows(tokens: int, top_k: int, ep: int, local: int, node: int, capacity: int,
              device_platform: str) -> tuple[int, int, int, int]:
  """Rows of hier's four exchange buffers (temoe.moe.exchange.hier.run, static shapes): the scale-out hop's send
  (one per token and node it may reach), the relay's receive (its pair capacity, one row a pair at most), the
  in-node hop's send (one per relayed row and rank of the node it may reach, capped at the relay's pair capacity:
  `hier.hop2_rows`) and the expert rank's receive; the combine moves the same rows back. XLA:CPU's padded
  transport sends and receives a slot of a hop's rows for every device of the axis."""
  from temoe.moe.exchange import dedup_plan, hier  # pylint: disable=import-outside-toplevel

  rows1, width = dedup_plan.send_rows(tokens, top_k, ep // node), dedup_plan.slots(top_k, node * local)
  if device_platform == "cpu":
    rows2 = hier.hop2_rows(capacity, rows1 * ep, width, node)
    return rows1 * ep, rows1 * ep, rows2 * ep, rows2 * ep
  relay = min(capacity, rows1 * (ep // node))
  rows2 = hier.hop2_rows(capacity, relay, width, node)
  return rows1, relay, rows2, min(capacity, rows2 * node)


def from_tokens(config, s: Shapes, backend: str, device_platform: str = "gpu") -> bool:
  """Whether the layer's expert MLP starts from the tokens (temoe.moe.experts.mosaic_tokens: the quantizers
  gather x's rows and dy's as they read), so no bf16 buffer of dispatched rows or of their incoming
  gradient is ever written: the block's own test (mosaic_tokens.applies_to, exchange.TOKENS_MLP)."""
  from temoe.moe import exchange  # pylint: disable=import-outside-toplevel
  from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel

  if not mosaic_tokens.applies_to(backend, str(config.te_gmm_quantization), bool(config.mlp_bias)):
    return False
  top_k, local = config.num_experts_per_tok, config.num_experts // s.ep
  name = exchange.resolve(str(config.te_moe_exchange), s.ep, device_platform, top_k=top_k, local_experts=local,
                          node_size=int(getattr(config, "te_moe_ep_node_size", 8)))
  return name in exchange.TOKENS_MLP


def operand_bytes(config, backend: str) -> float:
  """Bytes per element of a quantized GEMM operand copy (recipes.py), 0 where the GEMMs read bf16 as stored."""
  recipe = recipes.REGISTRY.get(str(config.te_gmm_quantization))
  return recipe.operand_bytes if recipe is not None and recipe.fp8 and backend in ("te", "mosaic") else 0.0


def moe_layer(config, s: Shapes, backend: str, device_platform: str = "gpu") -> tuple[float, str]:
  """One MoE layer's backward, bytes per device beyond what it saved (`chunk_layer`). With te_moe_chunks=C the
  block runs C chunks of tokens / C, each with its own dispatch buffers, capacity and exchange (padded per expert
  each): every chunk's buffers are counted live at once (the unrolled chunks leave XLA's scheduler free to keep
  them all), the router's scores once."""
  chunks = max(int(getattr(config, "te_moe_chunks", 1) or 1), 1)
  router = s.tokens * config.num_experts * 4 * 3  # float32 scores, probabilities and their gradient
  if chunks == 1 or s.tokens % chunks:
    part, note = chunk_layer(config, s, backend, device_platform)
    return router + part, note
  part, note = chunk_layer(config, dataclasses.replace(s, tokens=s.tokens // chunks), backend, device_platform)
  return router + chunks * part, f"{chunks} chunks of {note}"


def chunk_layer(config, s: Shapes, backend: str, device_platform: str = "gpu") -> tuple[float, str]:
  """The routed block's share of a MoE layer's backward on `s.tokens` tokens: its largest step (note says which).

  Steps, per buffer row (e = emb, m = expert ffn, a = activation bytes, q = a quantized copy's bytes):
  recompute of gate/up: dispatched rows (e*a), their quantized copy both ways (2e*q), gate|up output
  (2m*a, unless the policy saves both halves), with the gate/up weights quantized both ways; down's backward: the incoming gradient rows
  (e*a) and its quantized copy both ways, the activation's gradient (m*a), the residual operands of
  both GEMMs (the activation and the dispatched rows: quantized, or as stored in bf16), with the
  quantized weights dgrad reads; gate/up's backward: the dispatched rows' residual, the gate|up
  gradient (2m*a) and its quantized copy both ways, the dispatched rows' gradient (e*a), with the
  gate/up weights' dgrad copy. Tensors the remat policy does not save (gate|up output, down output)
  are live through the down step. Where the MLP starts from the tokens (`from_tokens`), neither the
  dispatched rows nor the incoming gradient rows exist in bf16. Every step also holds the router's float32 scores and the
  dispatch plan's int32 maps; expert-parallel exchange buffers there and back; on the xla backend
  the dense ragged_dot products and two copies of the layer's expert weights in the layouts XLA's
  dot wants (the XLA:CPU buffer assignment of the train step at its peak).
  """
  c = config
  routed, rows, _ = moe_rows(c, s, backend)
  local = c.num_experts // s.ep
  e, m, a = s.emb, c.moe_mlp_dim, s.act
  q = operand_bytes(c, backend)
  wi, wo = local * e * 2 * m, local * m * e  # expert weight elements
  policy = remat_policy(c)
  tensors = {t.names[-1]: kept(policy, t, c) for t in layer_tensors(c, s, True, rows, backend)}
  # FP8 residuals a policy saves are counted there: the activations' copies, and the weights' (named
  # te_moe_fp8_weights too, keyed by that name), which no step then quantizes again
  from temoe.moe.experts import parts  # pylint: disable=import-outside-toplevel

  kept_q = tensors.get(parts.QUANTIZED) == "device"
  kept_w = tensors.get(parts.FP8_WEIGHTS) == "device"
  x_res, act_res = (0, 0) if kept_q else (e * (q or a), m * (q or a))  # the residual operand of each GEMM's wgrad
  res_w = 0 if kept_w or kept_q else 1
  gate_up = 2 * m * a if "remat" in (tensors["moe_mlpwi_0"], tensors["moe_mlpwi_1"]) else 0  # recomputed
  recomputed = gate_up + (e * a if tensors["moe_mlpwo"] == "remat" else 0)
  # the weights' FP8 copies the backward makes: recomputed with the forward (wi both ways, wo), or, under
  # current scaling, each cast at its own GEMM's backward from the saved scales (and wi^T only where the
  # gate/up GEMM is recomputed)
  cast_in_backward = q and recipes.REGISTRY[str(c.te_gmm_quantization)].scaling == "current" and not kept_w
  if cast_in_backward:
    remade, down_w, up_w = (q * wi if gate_up else 0), q * wo, q * wi
  else:
    remade, down_w, up_w = (0 if kept_w else q * (2 * wi + wo)), res_w * q * (wi + wo), res_w * q * wi
  gathered = 0 if from_tokens(c, s, backend, device_platform) else e * a  # the bf16 dispatched / gradient rows
  steps = {
      "recompute of gate/up": rows * (gathered + 2 * e * q + gate_up) + remade,
      "down GEMM backward": rows * (gathered + 2 * e * q + m * a + act_res + x_res + recomputed) + down_w,
      "gate/up GEMM backward": rows * (x_res + 2 * m * a + 4 * m * q + e * a) + up_w,
  }
  step, biggest = max(steps.items(), key=lambda kv: kv[1])
  always = 4 * (3 * routed + rows)  # dispatch maps
  always += exchange_bytes(c, s, device_platform)
  if backend == "xla":
    always += xla_ragged_dot_bytes(rows, local, e, m, a) + 2 * (wi + wo) * a
  note = f"{rows} buffer rows x emb {e}{', from the tokens' if not gathered and e * a else ''}, largest step: {step}"
  return biggest + always, note


def attention(config, s: Shapes) -> float:
  """One attention block's forward tensors and their gradients, plus the score matrix if materialized."""
  tensors = sum(t.elements for t in attention_tensors(config, s) if t.names != ("decoder_layer_input",)) * s.act
  kernel = str(config.attention)
  dense = kernel == "dot_product" or (kernel == "autoselected" and (config.hardware == "cpu" or s.seq < 128))
  heads = max(config.num_query_heads // s.tp, 1)
  scores = s.batch * heads * s.seq * s.seq * 4 * 2 if dense else 0
  return 2 * tensors + scores


def dense_mlp(config, s: Shapes) -> float:
  return 2 * s.tokens * (3 * config.mlp_dim // s.tp + s.emb) * s.act


def shared_experts(config, s: Shapes) -> float:
  """The shared experts' MLP forward tensors and their gradients."""
  return 2 * s.tokens * config.shared_experts * config.moe_mlp_dim // s.tp * 3 * s.act


def loss(config, s: Shapes) -> float:
  """Logits, float32 log-softmax and one-hot targets, and their gradient (bytes per device)."""
  tokens = s.tokens / max(config.num_vocab_tiling, 1)
  vocab = config.vocab_size / s.tp
  return tokens * vocab * (s.act + 3 * 4)
