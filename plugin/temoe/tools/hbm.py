"""Per-device HBM of one MaxText training step with temoe's MoE block, estimated without a device.

What MaxText builds is read from MaxText: the train state (parameters, optimizer state) is
train_compile's abstract state, sharded by the config's logical axis rules over its mesh (an
AbstractMesh will do: nothing is allocated). What no API reports is modelled, in
`temoe.tools.hbm_activations`: the activations the remat policy keeps, the working set of the layer
being differentiated (FSDP's gathered weights and full gradients of that layer included), and the
loss's logits.

The step's memory is followed through its phases, since what is live changes between them:

  loss         parameters, optimizer state, layer-major copies, saved activations, the logits
  MoE layers   ... + the gradients of the loss head and of the MoE layers, one MoE layer's working set
  dense layers ... + the dense layers' gradients; the MoE layers' activations and copy are gone
  optimizer    parameters, optimizer state, every gradient

Layer-major copies: MaxText stacks each scanned block's parameters on axis `param_scan_axis` (1) and
moves that axis first for jax.lax.scan (nnx_decoders' moveaxis); XLA materializes the moved stack
(the H200 profile of the 1-GPU proxy shows the transpose of the experts' stack once per step, the
XLA:CPU buffer assignment a copy of every stack), and the backward scan reads it again, so it lives
until that block's backward ends. Gradients exist only from the backward that computes them on: at
a MoE layer's backward the embedding's and the dense layers' are not computed yet (the XLA:CPU
buffer assignment at the train step's peak holds neither).

The rows `temoe plan` prints: the resident ones (parameters, optimizer state, layer-major copies,
gradients, saved activations) are each at their largest; each phase row is what that phase holds
beyond them, net of what is not live then (so it can be negative).
peak = resident rows + the largest phase row.
"""

from __future__ import annotations

import dataclasses
import math
import re

from temoe.tools import hbm_activations as act
from temoe.tools import model_size
from temoe.tools.hbm_activations import GIB, Part, moe_rows, saved_activations, shapes


@dataclasses.dataclass(frozen=True)
class Estimate:
  resident: tuple[Part, ...]  # each at its largest during the step
  layers: tuple[Part, ...]  # one per phase: what it holds beyond the resident rows, net
  host: float  # bytes MaxText places in host memory (offloaded state)
  state: object = dataclasses.field(default=None, repr=False, compare=False)  # the abstract train state it read

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
  from temoe.tools import shardings  # pylint: disable=import-outside-toplevel

  mesh, out = dict(sharding.mesh.shape), []
  for i, dim in enumerate(leaf.shape):
    out.append(math.prod(mesh[a] for a in shardings.spec_axes(sharding.spec, i) if keep is None or keep(a, dim)))
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


SCANNED_BLOCKS = ("layers", "dense_layers", "moe_layers")
"""Where MaxText's decoder keeps layer-stacked (scanned) parameters."""

KEPT_AXES = {"tensor", "tensor_sequence"}
"""Mesh axes whose weight shards a layer computes on as they are; the others (FSDP's) are all-gathered."""


def gathered_bytes(leaf, num_experts: int) -> int:
  """Bytes of `leaf` on a device once its FSDP-style axes are all-gathered (experts stay on their axis)."""
  return shard_bytes(leaf, keep=lambda axis, dim: axis in KEPT_AXES or (axis == "expert" and dim == num_experts))


UNROLLED_LAYER = re.compile(rf"^({'|'.join(SCANNED_BLOCKS)})_\d+$")
"""One layer of a block with scan_layers=false: MaxText registers each as `<block>_<i>`."""


def block_of(keys: list[str]) -> str:
  """Which part of the model a parameter path belongs to: a layer block (scanned, or unrolled into
  `<block>_<i>`), the embedding, or the head (final norm, logits: everything after the layers)."""
  for key in keys:
    if key in SCANNED_BLOCKS:
      return key
    unrolled = UNROLLED_LAYER.match(key)
    if unrolled:
      return unrolled.group(1)
  return "embedding" if "token_embedder" in keys else "head"


def layer_counts(config) -> dict[str, int]:
  """Layers per scanned block of MaxText's decoder: DeepSeek's builds dense_layers then moe_layers
  (whatever the expert count), the others one `layers` block."""
  dense = config.first_num_dense_layers
  return {"dense_layers": dense, "moe_layers": config.num_decoder_layers - dense, "layers": config.num_decoder_layers}


EXPERT_WEIGHTS = ("wi", "wo", "wi_0", "wi_1")
"""A MoE block's expert weight parameters (MaxText's names under MoeBlock_0)."""


def state_parts(state, config, backend: str = "") -> tuple[list[Part], dict]:
  """Parameters, optimizer state, layer-major copies and gradients per device, from the abstract
  state; the sums by block in the dict (`grads`, `copies`, `<block>_gather`).

  MaxText's own grouped-GEMM MoE (backend `gmm`) holds a copy of its stacked expert weights even with
  param_scan_axis 0, where nothing is moved: on the H200, stock_best's peaks with param_scan_axis 0
  (bench/results/proxy_1gpu.scan0.json, 3 and 5 layers) exceed the plan without it by 5.8 and 11.2 GiB,
  the expert stacks being 5.3 and 10.5 GiB (temoe's block, in the same call, none). Those two rows are
  where the term comes from, not a check of it."""
  import jax  # pylint: disable=import-outside-toplevel

  sums = {"params": 0, "opt": 0, "host": 0, "count": 0, "grads": {}, "copies": {}}
  params = {}
  counts = layer_counts(config)
  moved = config.scan_layers and config.param_scan_axis != 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if on_host(leaf):
      sums["host"] += shard_bytes(leaf)
    elif keys[0] == "model":
      sums["params"] += shard_bytes(leaf)
      params[tuple(keys[1:])] = leaf
      block = block_of(keys)
      if block in SCANNED_BLOCKS:  # all its layers, as held and as gathered
        relaid = (config.scan_layers and backend == "gmm" and "MoeBlock_0" in keys
                  and any(k in EXPERT_WEIGHTS for k in keys))
        if (moved or relaid) and counts[block] > 1:  # moving an axis of length 1 first is a bitcast, not a copy
          sums["copies"][block] = sums["copies"].get(block, 0) + shard_bytes(leaf)
        extra = gathered_bytes(leaf, config.num_experts) - shard_bytes(leaf)
        sums[f"{block}_gather"] = sums.get(f"{block}_gather", 0) + extra
    elif keys[0] == "optimizer":
      sums["opt"] += shard_bytes(leaf)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state["optimizer"]["opt_state"])[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if "mu" in keys:  # Adam's first moment mirrors exactly the trainable parameters
      param = params.get(tuple(keys[keys.index("mu") + 1:]))
      if param is not None:
        block = block_of(keys)
        sums["grads"][block] = sums["grads"].get(block, 0) + shard_bytes(param)
        sums["count"] += param.size
  copies = sum(sums["copies"].values())
  parts = [
      Part("parameters", sums["params"], f"{count_text(sums['count'])} trainable, sharded as MaxText shards them"),
      Part("optimizer state", sums["opt"], "as the optimizer MaxText builds (Adam: mu, nu)"),
      Part("layer-major copies", copies, "each scanned block's stacked parameters, layer axis moved first for the "
                                         "scan (MaxText's grouped-GEMM MoE: its expert weights, whatever the axis): "
                                         "live until that block's backward ends"),
      Part("gradients", sum(sums["grads"].values()), "one copy of the trainable parameters, by the optimizer step"),
  ]
  return [p for p in parts if p.bytes or p.name != "layer-major copies"], sums


def count_text(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def gathered_layer(config, sums: dict, block: str) -> float:
  """FSDP: one layer's weights all-gathered, and its full gradients before the reduce-scatter (the
  extra over the shards already counted)."""
  if f"{block}_gather" not in sums:
    block = "layers"
  return 2 * sums.get(f"{block}_gather", 0) / max(layer_counts(config)[block], 1)


def gib(n: float) -> str:
  return f"{n / GIB:.2f}"


def retarget(state, mesh):
  """`state`'s leaves sharded as they are (the same PartitionSpecs) over another mesh of the same axis names: what
  MaxText builds for another layout of one config, whose logical axis rules do not change with the axes' sizes
  (`temoe plan --sweep` builds the state once per family of layouts; tests/unit/test_sweep.py checks it against
  a state built for each layout)."""
  import jax  # pylint: disable=import-outside-toplevel

  def leaf(x):
    s = x.sharding
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
        mesh, s.spec, memory_kind=getattr(s, "memory_kind", None)))

  return jax.tree.map(leaf, state)


def estimate(config, mesh, backend: str, device_platform: str = "gpu", state=None) -> Estimate:
  """The estimate for `config` on `mesh` (a jax Mesh or AbstractMesh) with MoE backend `backend`:
  temoe's `te`, `mosaic` or `xla`, or `gmm` (MaxText's own MoE on a grouped-GEMM kernel: no dense expansion);
  `state`: MaxText's abstract train state for this config and mesh where it is already built."""
  state = abstract_state(config, mesh) if state is None else state
  resident, sums = state_parts(state, config, backend)
  s = shapes(config, mesh)
  moe = model_size.layers(config).moe > 0
  rows = moe_rows(config, s, backend)[1] if moe else 0
  saved = saved_activations(config, s, rows, backend)
  resident.append(saved.part(config))
  grads, copies = sums["grads"], sums["copies"]
  split = "moe_layers" in grads  # DeepSeek's decoder: dense_layers then moe_layers, each scanned
  layers_block = "moe_layers" if split else "layers"
  not_yet = {"loss": sum(v for k, v in grads.items() if k != "head"),
             "moe": grads.get("embedding", 0) + grads.get("dense_layers", 0)}
  attention = act.attention(config, s)
  phases = []
  if moe:
    moe_set, where = act.moe_layer(config, s, backend, device_platform)
    working = attention + moe_set + act.shared_experts(config, s) + gathered_layer(config, sums, layers_block)
    # Unrolled layers free what each kept once its backward is done, so at the first MoE layer's backward (every
    # MoE gradient live) the later MoE layers' saved activations are gone; a scan frees its stacked ones at its end.
    freed = 0.0 if config.scan_layers else saved.moe * (1 - 1 / model_size.layers(config).moe)
    phases.append(Part("layer working set (MoE layer)", working - not_yet["moe"] - freed,
                       f"{gib(working)} GiB attention + {backend} MoE ({where}); less the gradients not computed yet "
                       f"(embedding{', dense layers' if split else ''}) {gib(not_yet['moe'])}"
                       + (f" and the later MoE layers' saved activations, freed (unrolled) {gib(freed)}" if freed else "")))
  dense_set = attention + act.dense_mlp(config, s) + gathered_layer(config, sums, "dense_layers" if split else "layers")
  if split or not moe:  # the dense layers' backward comes after the MoE layers': their copy and activations are gone
    gone = (copies.get("moe_layers", 0) + saved.moe) if split else 0.0
    phases.append(Part("layer working set (dense layer)", dense_set - grads.get("embedding", 0) - gone,
                       f"{gib(dense_set)} GiB {config.attention} attention + MLP, recomputed and differentiated; less the "
                       f"embedding's gradient not computed yet{' and what the MoE layers held' if split else ''} "
                       f"{gib(grads.get('embedding', 0) + gone)}"))
  logits = act.loss(config, s)
  phases.append(Part("loss (logits)", logits - not_yet["loss"],
                     f"{gib(logits)} GiB logits, float32 log-softmax, one-hot targets, gradient; less the gradients "
                     f"not computed yet (all but the head's) {gib(not_yet['loss'])}"))
  phases.append(Part("optimizer step", -(sum(copies.values()) + saved.dense + saved.moe),
                     "every gradient; no activations, no layer-major copies"))
  return Estimate(tuple(resident), tuple(phases), sums["host"], state)
