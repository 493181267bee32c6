"""Per-device HBM of one MaxText training step with temoe's MoE block, estimated without a device.

What MaxText builds is read from MaxText: the train state (parameters, optimizer state) is
train_compile's abstract state, sharded by the config's logical axis rules over its mesh (an
AbstractMesh will do: nothing is allocated). What no API reports is modelled, in
`temoe.tools.hbm_activations`: gradients (one copy of the trainable parameters), the activations the
remat policy keeps, the working set of the layer being differentiated (FSDP's gathered weights and
full gradients of that layer included), and the loss's logits.

peak = parameters + optimizer state + gradients + saved activations + max(layer, loss).
"""

from __future__ import annotations

import dataclasses
import math

from temoe.tools import hbm_activations as act
from temoe.tools.hbm_activations import Part, moe_rows, saved_activations, shapes

@dataclasses.dataclass(frozen=True)
class Estimate:
  resident: tuple[Part, ...]  # held through the whole step
  layers: tuple[Part, ...]  # transient: one of these at a time
  host: float  # bytes MaxText places in host memory (offloaded state)

  @property
  def transient(self) -> Part:
    return max(self.layers, key=lambda p: p.bytes)

  @property
  def peak(self) -> float:
    return sum(p.bytes for p in self.resident) + self.transient.bytes


def tiles(leaf, keep=None) -> list[int]:
  """How many ways each dimension of `leaf` is split over its mesh (only the axes `keep` accepts, if given)."""
  sharding = getattr(leaf, "sharding", None)
  if sharding is None or not hasattr(sharding, "spec"):
    return [1] * len(leaf.shape)
  mesh, out = dict(sharding.mesh.shape), []
  for i, dim in enumerate(leaf.shape):
    axes = sharding.spec[i] if i < len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    out.append(math.prod(mesh[a] for a in axes if keep is None or keep(a, dim)))
  return out


def shard_bytes(leaf, keep=None) -> int:
  """Bytes of `leaf` on one device; an uneven split rounds up, as XLA pads it."""
  return math.prod(-(-dim // t) for dim, t in zip(leaf.shape, tiles(leaf, keep))) * leaf.dtype.itemsize


def on_host(leaf) -> bool:
  return getattr(getattr(leaf, "sharding", None), "memory_kind", None) == "pinned_host"


def abstract_state(config, mesh):
  """MaxText's abstract train state (nnx.State of ShapeDtypeStructs with shardings), nothing allocated."""
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  return introspect.abstract_state(config, mesh)


SCANNED_BLOCKS = {"layers", "dense_layers", "moe_layers"}
"""Where MaxText's decoder keeps layer-stacked (scanned) parameters."""

KEPT_AXES = {"tensor", "tensor_sequence"}
"""Mesh axes whose weight shards a layer computes on as they are; the others (FSDP's) are all-gathered."""


def gathered_bytes(leaf, num_experts: int) -> int:
  """Bytes of `leaf` on a device once its FSDP-style axes are all-gathered (experts stay on their axis)."""
  return shard_bytes(leaf, keep=lambda axis, dim: axis in KEPT_AXES or (axis == "expert" and dim == num_experts))


def state_parts(state, config) -> tuple[list[Part], dict]:
  """Parameters, optimizer state and gradients per device, from the abstract state."""
  import jax  # pylint: disable=import-outside-toplevel

  sums = {"params": 0, "trainable": 0, "opt": 0, "host": 0, "count": 0, "stacked": 0}
  params = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if on_host(leaf):
      sums["host"] += shard_bytes(leaf)
    elif keys[0] == "model":
      sums["params"] += shard_bytes(leaf)
      params[tuple(keys[1:])] = leaf
      for block in set(keys) & SCANNED_BLOCKS:  # per block: all layers, as held and as gathered
        sums["stacked"] += shard_bytes(leaf)
        extra = gathered_bytes(leaf, config.num_experts) - shard_bytes(leaf)
        sums[f"{block}_gather"] = sums.get(f"{block}_gather", 0) + extra
    elif keys[0] == "optimizer":
      sums["opt"] += shard_bytes(leaf)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state["optimizer"]["opt_state"])[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if "mu" in keys:  # Adam's first moment mirrors exactly the trainable parameters
      param = params.get(tuple(keys[keys.index("mu") + 1:]))
      if param is not None:
        sums["trainable"] += shard_bytes(param)
        sums["count"] += param.size
  parts = [
      Part("parameters", sums["params"], f"{count_text(sums['count'])} trainable, sharded as MaxText shards them"),
      Part("optimizer state", sums["opt"], "as the optimizer MaxText builds (Adam: mu, nu)"),
      Part("gradients", sums["trainable"], "one copy of the trainable parameters"),
  ]
  return parts, sums


def count_text(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def gathered_layer(config, sums: dict, block: str) -> float:
  """FSDP: one layer's weights all-gathered, and its full gradients before the reduce-scatter (the
  extra over the shards already counted). MaxText stacks all layers in `layers` unless DeepSeek's
  dense/MoE split applies."""
  dense = config.first_num_dense_layers
  counts = {"dense_layers": dense, "moe_layers": config.num_decoder_layers - dense, "layers": config.num_decoder_layers}
  if f"{block}_gather" not in sums:
    block = "layers"
  return 2 * sums.get(f"{block}_gather", 0) / max(counts[block], 1)


def estimate(config, mesh, backend: str, device_platform: str = "gpu") -> Estimate:
  """The estimate for `config` on `mesh` (a jax Mesh or AbstractMesh) with MoE backend `backend`:
  temoe's `te`, `mosaic` or `xla`, or `gmm` (MaxText's own MoE on a grouped-GEMM kernel: no dense expansion)."""
  state = abstract_state(config, mesh)
  resident, sums = state_parts(state, config)
  if device_platform == "cpu" and config.scan_layers:
    resident.append(Part("scanned weights, layer-major", 2 * sums["stacked"],
                         "XLA:CPU copies stacked weights and their gradients to layer-major for the scan"))
  s = shapes(config, mesh)
  moe = config.num_experts > 1 and config.num_decoder_layers > config.first_num_dense_layers
  routed = moe_rows(config, s, backend)[1] if moe else 0
  resident.append(saved_activations(config, s, routed))
  attention = act.attention(config, s)
  dense = attention + act.dense_mlp(config, s) + gathered_layer(config, sums, "dense_layers")
  layers = [Part("layer working set (dense layer)", dense,
                 f"{config.attention} attention + MLP, recomputed and differentiated")]
  if moe:
    routed_moe = attention + act.moe_layer(config, s, backend) + gathered_layer(config, sums, "moe_layers")
    layers.append(Part("layer working set (MoE layer)", routed_moe,
                       f"attention + {backend} MoE: {routed} buffer rows x emb {s.emb}"))
  layers.append(act.loss(config, s))
  return Estimate(tuple(resident), tuple(layers), sums["host"])
