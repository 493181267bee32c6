"""Step time of one MaxText training step on N GPUs, predicted before the job runs from rates one GPU
measured (`temoe.tools.calibration`), for `temoe plan`.

Per device and step:
  compute    attention (projections at the dense GEMM rate of their dtype, the core at its kernel's rate),
             dense GEMMs (dense MLPs, shared experts, router, logits), routed experts (one measured MoE
             layer per expert path and shape class, split into its rows-proportional part and its FP8
             weight casts), dispatch/combine and the step's elementwise ops (bytes over HBM), optimizer;
             what the remat policy recomputes is added to each stage;
  comms      expert all-to-all (the exchange strategy's volume, `temoe.tools.exchange_volume`), FSDP
             all-gathers and reduce-scatters, data-parallel all-reduce, tensor-parallel gathers, pipeline
             transfers, host offload; each over the link its group crosses: NVLink inside one domain,
             the scale-out NIC across domains (devices in MaxText's hybrid-mesh order); the hierarchical
             exchange as its two all-to-alls one after the other (relays over the NIC, then NVLink);
  overlap    what the XLA flags in force allow (`OVERLAP_FLAGS`): FSDP collectives hide behind layer
             compute, the all-reduce behind the backward; the expert exchange, which each MoE layer
             waits for, hides inside temoe's layer behind the shared expert and, with te_moe_chunks,
             behind other chunks' expert GEMMs (`OVERLAP_ASSUMED`: assumed, not measured); every
             collective crossing the scale-out NIC shares it, so their summed time bounds the step
             (`nic_floor`);
  Megatron   a published Megatron-Core run (`Megatron`, set by bench/step_model_check.py) is priced as its
             recipe runs it: the distributed optimizer's once-per-step collectives instead of FSDP's, and
             the overlaps its recipe turns on (pipeline transfers, the expert exchange);
  bubble     (stages - 1) / (repeats * microbatches + stages - 1) of the pipelined time (MaxText's formula).
step = compute + exposed communication + bubble; tokens/s/GPU, TFLOP/s/GPU (temoe.tools.flops, MaxText's
count) and MFU against the FLOP-weighted peak follow.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

from temoe import hardware
from temoe.tools import calibration as cal
from temoe.tools import exchange_volume, flops, model_size

LINK_EFFICIENCY = {"nvlink": 0.80, "nvlink_all_to_all": 0.70, "scale_out": 0.80, "host": 0.80}
"""Achieved over nominal bandwidth, assumed (no multi-GPU measurement exists in this project): NVLink ring
collectives without NVLS (`NCCL_NVLS_ENABLE=0` in the profile; 8xH100 all-reduce bus bandwidth with NVLS
is reported at 460-480 GB/s of 450 nominal per direction), all-to-all lower, NIC rings at ~80%."""

ELEMENTWISE_PASSES = 45
"""Activation-sized passes (read or write of tokens x emb) per decoder layer outside attention, forward and
backward, estimated from the layer's ops (not measured): two RMSNorms, two residual adds, routing and the
shared expert's activation, and 12 for the FP8 casts of the MLP inputs under MaxText's TE quantization; the
backward twice the forward. The fitted elementwise efficiency absorbs how far the estimate is off."""

FP8_CAST_PASSES = 12
RECOMPUTE_PASSES = 15
"""The forward's elementwise passes again when a remat policy recomputes the layer's unnamed tensors."""

VOCAB_BYTES = 16
"""Bytes per token and vocabulary entry of the loss, estimated: logits read three times and float32
intermediates forward, logits read and their gradient written backward."""

WEIGHT_PASSES = (3, 1)
"""Passes over a device's own weights in the weight dtype (per microbatch, per step), counted from the
weight-sized ops among the profiled one-microbatch step's largest (bench/results/profile/temoe_fp8.json
top_ops): sliced out of the layer stack forward and backward and relaid out for the expert kernels, per
use; the gradient stack zeroed, once."""

OVERLAP_FLAGS = {
    "scheduler": "xla_gpu_enable_latency_hiding_scheduler",
    "all_gather": "xla_gpu_pipeline_all_gather",
    "reduce_scatter": "xla_gpu_pipeline_reduce_scatter",
    "all_reduce": "xla_gpu_pipeline_all_reduce",
    "streams": "xla_gpu_experimental_enable_collective_multi_streaming",
}
"""The XLA flags that decide which collectives may overlap compute (their values in the env profile)."""

NON_EXPERT_GATHER_AXES = ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")
"""Mesh axes MaxText shards non-expert weights over ('embed', 'q_lora', 'kv_lora'): all-gathered per layer."""
EXPERT_GATHER_AXES = ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses")
"""Mesh axes expert weights are sharded over besides 'expert' ('embed_no_exp'): all-gathered per layer."""
TENSOR_AXES = ("tensor", "tensor_transpose", "tensor_sequence")
REPLICA_AXES = ("data",)


class StepModelError(ValueError):
  """A config the step model does not price; the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class Megatron:
  """How a Megatron-Core job runs what MaxText's settings express differently, for pricing published Megatron
  runs (bench/step_model_check.py); temoe's own jobs have none and keep MaxText's pricing. Every Megatron-Bridge
  DeepSeek-V3 recipe uses the distributed optimizer (ZeRO-1: `ddp.use_distributed_optimizer=True`, bf16 gradients
  `grad_reduce_in_fp32=False`; NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/recipes/deepseek/deepseek_v3.py,
  h100/deepseek_v3.py since 26.06):
  weights replicated over data parallelism, gradients reduce-scattered and weights all-gathered once per step, not
  per microbatch. Its layers are separate modules (Megatron-LM megatron/core/transformer/transformer_block.py),
  so no weight is sliced out of a layer stack per microbatch."""

  overlap_grad_reduce: bool  # ddp.overlap_grad_reduce: the reduce-scatter behind the backward
  overlap_param_gather: bool  # ddp.overlap_param_gather: the all-gather behind the forward
  overlap_p2p: bool  # overlap_p2p_comm (on with VP > 1: Megatron-Bridge training/comm_overlap.py)
  overlap_expert_exchange: bool  # overlap_moe_expert_parallel_comm (with delay_wgrad_compute)


@dataclasses.dataclass(frozen=True)
class Job:
  """What the step model reads of one planned run (built by `temoe plan` from MaxText's config and mesh)."""

  config: Any  # MaxText HyperParameters
  ici: tuple[int, ...]  # per mesh axis (config.mesh_axes order), as MaxText fills them
  dcn: tuple[int, ...]
  slices: int
  backend: str  # temoe's expert kernel (mosaic, te, xla) or MaxText's own MoE (gmm, xla)
  dense_quantization: str  # MaxText's `quantization` as asked (planned without TE, the config may lack it)
  local_params: float  # trainable parameters held by one device
  optimizer_bytes: float  # optimizer state bytes on one device
  megatron: Megatron | None = None  # a published Megatron-Core run priced as Megatron runs it
  layer_overlap: bool = True  # temoe's MoE layer (`layer_overlap`); False: a published run of another MoE layer

  @property
  def devices(self) -> int:
    return math.prod(a * b for a, b in zip(self.ici, self.dcn))

  def size(self, axes) -> int:
    return math.prod(self.ici[i] * self.dcn[i] for i, a in enumerate(self.config.mesh_axes) if a in axes)


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  seconds: float
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Collective:
  name: str
  bytes: float  # per device and step, over the network (a device's rows to itself excluded)
  ranks: int
  link: str
  seconds: float
  exposed: float  # of `seconds`, what the step waits for
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Prediction:
  gpu: hardware.GPU
  calibration: cal.Calibration
  stages: tuple[Stage, ...]
  collectives: tuple[Collective, ...]
  bubble: float
  tokens: float  # per device and step
  model_flops: float  # per device and step (temoe.tools.flops: MaxText's count)
  peak_tflops: float  # FLOP-weighted peak of this step's precisions
  notes: tuple[str, ...] = ()

  @property
  def compute(self) -> float:
    return sum(s.seconds for s in self.stages)

  @property
  def step_seconds(self) -> float:
    return self.compute + sum(c.exposed for c in self.collectives) + self.bubble

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.step_seconds

  @property
  def tflops(self) -> float:
    return self.model_flops / self.step_seconds / 1e12

  @property
  def mfu(self) -> float:
    return self.tflops / self.peak_tflops


# --- links ------------------------------------------------------------------------------------------


def domain_slices(gpu: hardware.GPU, gpus_per_slice: int) -> int:
  """Slices of one NVLink domain a job's layout uses: the largest power of two that fits (NVL72 racks run
  16 of their 18 trays in power-of-two layouts); 1 where a slice is a domain or larger."""
  if gpus_per_slice >= gpu.nvlink_domain:
    return 1
  return 2 ** int(math.log2(gpu.nvlink_domain // gpus_per_slice))


def group_links(job: Job, axes, gpu: hardware.GPU) -> tuple[int, int]:
  """(ranks of one collective group over `axes`, of them in one NVLink domain). MaxText's hybrid mesh
  keeps ICI axes inside a slice and orders slices row-major over the DCN axes (the last one fastest)."""
  names = list(job.config.mesh_axes)
  ranks = job.size(axes)
  per_slice = job.devices // max(job.slices, 1)
  stride, span = 1, 1
  for i in reversed(range(len(names))):
    if names[i] in axes:
      span += (job.dcn[i] - 1) * stride
    stride *= job.dcn[i]
  inside = domain_slices(gpu, per_slice)
  if span <= inside:
    return ranks, min(ranks, gpu.nvlink_domain)
  ici = math.prod(job.ici[i] for i, a in enumerate(names) if a in axes)
  return ranks, max(ici, min(ranks, int(ranks * inside / span)))


def ring_seconds(gathered_bytes: float, ranks: int, in_domain: int, gpu: hardware.GPU) -> tuple[float, float, str]:
  """(seconds, network bytes, link) of an all-gather or reduce-scatter of `gathered_bytes` over `ranks`:
  (ranks-1)/ranks of it crosses each device's link. Across domains the ring's crossing edges carry it:
  NCCL runs one ring per NIC, so the group's `in_domain` NICs of a domain share them (rail-aligned), up to
  the NVLink bandwidth."""
  moved = gathered_bytes * (ranks - 1) / ranks
  nvlink = gpu.nvlink_gbps * 1e9 * LINK_EFFICIENCY["nvlink"]
  if in_domain >= ranks:
    return moved / nvlink, moved, "NVLink"
  nics = max(in_domain, 1) * gpu.scale_out_gbps * 1e9 * LINK_EFFICIENCY["scale_out"]
  return moved / min(nvlink, nics), moved, "scale-out"


def all_to_all_seconds(sent_bytes: float, ranks: int, in_domain: int, gpu: hardware.GPU) -> tuple[float, float, str]:
  """(seconds, network bytes, link) of an all-to-all where each device sends `sent_bytes` spread evenly over
  the group (its share to itself stays): the peers inside the domain over NVLink, the rest over the NIC."""
  moved = sent_bytes * (ranks - 1) / ranks
  local = sent_bytes * (in_domain - 1) / ranks
  remote = moved - local
  nvlink = local / (gpu.nvlink_gbps * 1e9 * LINK_EFFICIENCY["nvlink_all_to_all"])
  nic = remote / (gpu.scale_out_gbps * 1e9 * LINK_EFFICIENCY["scale_out"]) if remote > 0 else 0.0
  return max(nvlink, nic), moved, "NVLink" if remote <= 0 else "NVLink + scale-out"


# --- what the remat policy recomputes ---------------------------------------------------------------


def saved(placements: dict[str, str], *names: str) -> bool:
  """A tensor is kept (device or host) if any of its names is."""
  return any(placements.get(n, "remat") != "remat" for n in names)


def placements_of(config) -> dict[str, str]:
  """Where MaxText's remat policy keeps each named tensor (device, host or remat)."""
  from temoe.tools import hbm_activations as act  # pylint: disable=import-outside-toplevel

  policy = act.remat_policy(config)
  names = ("query_wa_proj", "mla_q", "query_proj", "key_proj", "value_proj", "qkv_proj", "kv_proj", "kv_wa_proj",
           "mla_kv", "out_proj", "context", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1",
           "moe_mlpwo", "decoder_layer_input", "attention_out", "quantization")
  return {n: act.placement(policy, n, config) for n in names}


def attention_gemms(c) -> list[tuple[float, tuple[str, ...]]]:
  """(parameters, names of its output) per attention projection GEMM, as MaxText names them."""
  emb, heads = c.emb_dim, c.num_query_heads
  if str(getattr(c.attention_type, "value", c.attention_type)) == "mla":
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    query = ([(emb * c.q_lora_rank, ("query_wa_proj", "mla_q")), (c.q_lora_rank * heads * qk, ("query_proj",))]
             if c.q_lora_rank > 0 else [(emb * heads * qk, ("query_proj",))])
    return [*query, (emb * (c.kv_lora_rank + c.qk_rope_head_dim), ("kv_wa_proj", "mla_kv")),
            (c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim), ("key_proj", "value_proj")),
            (heads * c.v_head_dim * emb, ("out_proj",))]
  kv = c.num_kv_heads * c.head_dim
  return [(emb * heads * c.head_dim, ("query_proj", "qkv_proj")), (emb * kv, ("key_proj", "kv_proj", "qkv_proj")),
          (emb * kv, ("value_proj", "kv_proj", "qkv_proj")), (heads * c.head_dim * emb, ("out_proj",))]


def recomputed_share(c, placements: dict[str, str]) -> dict[str, float]:
  """Of each stage's forward, the share the backward recomputes under the remat policy."""
  gemms = attention_gemms(c)
  total = sum(p for p, _ in gemms)
  out = {"attention_proj": sum(p for p, names in gemms if not saved(placements, *names)) / total,
         "attention_core": 0.0 if saved(placements, "context") else 1.0}
  mlp = [saved(placements, "mlpwi_0", "mlpwi"), saved(placements, "mlpwi_1", "mlpwi"), saved(placements, "mlpwo")]
  out["mlp"] = sum(not s for s in mlp) / 3
  # the routed experts' fused gate|up GEMM: recomputed unless both halves are kept (temoe names w0
  # mlpwi_0 and moe_mlpwi_0, w1 moe_mlpwi_1 only); down: mlpwo / moe_mlpwo
  out["gate_up"] = 0.0 if saved(placements, "mlpwi_0", "moe_mlpwi_0") and saved(placements, "moe_mlpwi_1") else 1.0
  out["down"] = 0.0 if saved(placements, "mlpwo", "moe_mlpwo") else 1.0
  out["layer"] = 0.0 if all(v == "device" for v in placements.values()) else 1.0  # unnamed tensors
  return out


# --- the MoE layer ----------------------------------------------------------------------------------


def expert_path(job: Job, gpu: hardware.GPU) -> tuple[str, str]:
  """(how the routed experts run, note): a calibrated grouped-MLP path, or MaxText's dense lowerings."""
  c = job.config
  if not c.te_moe_block:
    if not c.sparse_matmul:
      return "dense_capacity", "MaxText's capacity-factor einsums, priced at the dense bf16 rate"
    if c.megablox or c.use_tokamax_gmm:
      return "tokamax_bf16", ""
    return "ragged_dot", "jax.lax.ragged_dot lowered densely by XLA (every row against every expert)"
  recipe = str(c.te_gmm_quantization)
  fp8 = recipe in ("te_fp8_current", "te_mxfp8")
  if job.backend == "xla":
    return "ragged_dot", "temoe's xla backend: ragged_dot lowered densely by XLA"
  if job.backend == "mosaic":
    return ("temoe_fp8" if fp8 else "temoe_bf16"), ""
  if gpu.compute_capability >= (10, 0):  # TE's grouped GEMM on Blackwell: not measured by this project
    path = "temoe_fp8" if fp8 else "temoe_bf16"
    return path, f"TE's {recipe} grouped GEMM on {gpu.name} not measured: priced as H200 {path} at {gpu.name}'s peaks"
  if fp8:
    return "te_fp8", ""
  return "temoe_bf16", "TE's bf16 grouped GEMM not measured: priced as temoe_bf16"


def dispatch_bytes(tokens: float, rows: float, emb: int, act: int) -> float:
  """Dispatch and combine of one MoE layer, fwd+bwd: rows written then read, tokens read then written."""
  return 2 * (rows + tokens) * emb * act


def layer_parts(calib: cal.Calibration, path: str, hidden: int, ffn: int, experts: int) -> tuple[float, float, str]:
  """(seconds per routed row, seconds per local expert weight element, note) of one MoE layer, fwd+bwd, on
  a calibrated grouped-MLP path: the class's time less its weight casts and its dispatch/combine (bytes
  at the measured bandwidth), per row; its weight casts per weight element. Scaled to the GPU: rows by
  the path dtype's dense peak, weights by HBM bandwidth."""
  entry, note = calib.grouped_class(path, hidden, ffn, experts)
  class_rows = entry["tokens"] * entry["top_k"]
  reference_bw = calib.measured_tbps() / calib.bandwidth_scale() * 1e12
  class_dispatch = dispatch_bytes(entry["tokens"], class_rows, entry["hidden"], 2) / reference_bw
  rows_s = (entry["layer_ms"] - entry.get("weight_cast_ms", 0.0)) / 1e3 - class_dispatch
  per_row = rows_s / class_rows / calib.compute_scale(cal.PATH_DTYPE[path])
  weights = entry["experts"] * 3 * entry["hidden"] * entry["expert_ffn"]
  per_weight = entry.get("weight_cast_ms", 0.0) / 1e3 / weights / calib.bandwidth_scale()
  return per_row, per_weight, note


def layer_seconds(calib: cal.Calibration, path: str, hidden: int, ffn: int, experts: int, tokens: float,
                  top_k: int) -> float:
  """One MoE layer (dispatch, expert MLP, combine; fwd+bwd, no recompute), as bench/moe_layer.py times it."""
  per_row, per_weight, _ = layer_parts(calib, path, hidden, ffn, experts)
  rows = tokens * top_k
  return (per_row * rows + per_weight * experts * 3 * hidden * ffn
          + dispatch_bytes(tokens, rows, hidden, 2) / (calib.measured_tbps() * 1e12))


def grouped_moe_seconds(job: Job, calib: cal.Calibration, path: str, tokens: float, share: dict) -> tuple[float, float, str]:
  """(expert seconds, dispatch/combine seconds, note) of all MoE layers of one device and step on a
  calibrated grouped-MLP path (`layer_parts`), with what the remat policy recomputes: the forward of the
  recomputed GEMMs (gate|up: 2/9 of the layer's GEMM time, down: 1/9) and w_i's casts with gate|up."""
  c = job.config
  local = c.num_experts // job.size(("expert",))
  per_row, per_weight, note = layer_parts(calib, path, c.emb_dim, c.moe_mlp_dim, local)
  rows = tokens * c.num_experts_per_tok
  local_weights = local * 3 * c.emb_dim * c.moe_mlp_dim / job.size(TENSOR_AXES)
  layer_rows = per_row * rows * (1 + share["gate_up"] * 2 / 9 + share["down"] / 9)
  layer_weights = per_weight * local_weights * (1 + share["gate_up"] * 2 / 3)
  layers = moe_layers(c)
  dispatch = layers * dispatch_bytes(tokens, rows, c.emb_dim, 2) * (1 + share["layer"] / 3) / (calib.measured_tbps() * 1e12)
  return layers * (layer_rows + layer_weights), dispatch, note


def moe_layers(c) -> int:
  return model_size.layers(c).moe


def dense_moe_flops(job: Job, path: str, tokens: float, share: dict) -> float:
  """FLOPs of MaxText's dense MoE lowerings (priced at the dense bf16 rate): ragged_dot computes every row
  against every local expert; the capacity path runs dispatch/combine einsums and the experts on
  capacity-padded rows (MaxText's expert_capacity_per_batch)."""
  c = job.config
  per_row = 2 * 3 * c.emb_dim * c.moe_mlp_dim  # forward FLOPs of one row through one expert
  rows = tokens * c.num_experts_per_tok
  if path == "ragged_dot":
    forward = rows * per_row * (c.num_experts // job.size(("expert",)))
  else:
    seq = c.max_target_length
    capacity = int(max(math.ceil(seq * c.num_experts_per_tok / c.num_experts) * c.capacity_factor, c.capacity_factor))
    einsum = 2 * tokens * c.num_experts * capacity * c.emb_dim  # BSM,BSEC->EBCM, and the combine back
    forward = tokens / seq * c.num_experts * capacity * per_row + 2 * einsum
  return moe_layers(c) * forward * (3 + share["layer"])


# --- the model --------------------------------------------------------------------------------------


def dense_dtype(job: Job) -> str:
  return "fp8" if job.dense_quantization in flops.DENSE_FP8_QUANTIZATION else "bf16"


def pipeline(job: Job) -> tuple[int, int, int]:
  """(stages, repeats, microbatches) of MaxText's circular pipeline; (1, 1, 1) without one."""
  c = job.config
  stages = job.size(("stage",))
  if stages <= 1 or not c.using_pipeline_parallelism:
    return 1, 1, 1
  return stages, max(int(c.num_pipeline_repeats), 1), max(int(c.num_pipeline_microbatches), stages)


def microbatches(job: Job) -> int:
  """Forward-backward passes per step: gradient accumulation steps, pipeline microbatches."""
  return max(int(job.config.gradient_accumulation_steps), 1) * pipeline(job)[2]


def check_supported(job: Job) -> None:
  c = job.config
  block = getattr(c.decoder_block, "value", c.decoder_block)
  if block not in flops.MODELLED_BLOCKS:
    raise StepModelError(f"decoder_block={block} is not modelled; modelled: {', '.join(flops.MODELLED_BLOCKS)}")
  context = job.size(("context", "context_usp_ulysses", "context_autoregressive"))
  if context > 1:
    raise StepModelError(f"context parallelism ({context}) is not modelled by the step time")


@dataclasses.dataclass(frozen=True)
class Work:
  """What one device does in one step before any fitted rate: FLOPs per GEMM class (remat recompute
  included), bytes of the memory-bound stages, and the routed experts' seconds (from measured layers)."""

  proj_flops: float
  core_flops: float
  dense_flops: float  # dense MLPs and shared experts, in `dtype`
  bf16_flops: float  # router, logits, MTP projections; MaxText's dense MoE lowerings
  dtype: str
  experts_s: float
  dispatch_s: float
  experts_note: str
  elementwise_bytes: float
  optimizer_bytes: float


def weight_passes(job: Job) -> int:
  """Passes over a device's weights per step (`WEIGHT_PASSES`); a Megatron run has no layer stack to slice
  per microbatch (`Megatron`), its gradient buffer is zeroed once."""
  return WEIGHT_PASSES[1] + (0 if job.megatron else WEIGHT_PASSES[0] * microbatches(job))


def local_params(job: Job) -> float:
  """Trainable parameters one device holds: MaxText's sharding, or a Megatron run's (`megatron_local_params`)."""
  return sum(megatron_local_params(job)) if job.megatron else job.local_params


def work(job: Job, calib: cal.Calibration) -> Work:
  c = job.config
  count = flops.count(c)
  tokens = count.tokens
  share = recomputed_share(c, placements_of(c))
  dtype = dense_dtype(job)
  act = 2 if str(c.dtype) == "bfloat16" else 4
  weight_bytes = 2 if str(c.weight_dtype) == "bfloat16" else 4
  experts_s = dispatch_s = extra = 0.0
  note = ""
  if moe_layers(c):
    path, note = expert_path(job, calib.gpu)
    if path in cal.PATH_DTYPE:
      experts_s, dispatch_s, class_note = grouped_moe_seconds(job, calib, path, tokens, share)
      note = "; ".join(filter(None, [note, class_note]))
    else:
      extra = dense_moe_flops(job, path, tokens, share)
    note = path + (f": {note}" if note else "")
  passes = ELEMENTWISE_PASSES - (0 if dtype == "fp8" else FP8_CAST_PASSES) + RECOMPUTE_PASSES * share["layer"]
  layers = c.num_decoder_layers + c.mtp_num_layers
  return Work(
      proj_flops=count.attention_proj * (1 + share["attention_proj"] / 3),
      core_flops=count.attention_core * (1 + share["attention_core"] / 3),
      dense_flops=(count.dense_mlp + count.shared_experts) * (1 + share["mlp"] / 3),
      bf16_flops=count.router + count.logits + count.mtp_proj + extra,
      dtype=dtype, experts_s=experts_s, dispatch_s=dispatch_s, experts_note=note,
      elementwise_bytes=(passes * tokens * layers * c.emb_dim * act
                         + VOCAB_BYTES * tokens * c.vocab_size / job.size(TENSOR_AXES)
                         + weight_passes(job) * local_params(job) * weight_bytes),
      optimizer_bytes=job.local_params * 3 * weight_bytes + 2 * job.optimizer_bytes,
  )


def predict(job: Job, calib: cal.Calibration, xla_flags: dict[str, str]) -> Prediction:
  """The step of `job` on `calib.gpu` with the XLA flags `xla_flags` (name -> value) in force."""
  check_supported(job)
  c, gpu = job.config, calib.gpu
  w = work(job, calib)
  core_rate, core_note = calib.attention_core_tflops(str(c.attention))
  dense_rate, bf16_rate = calib.dense_tflops(w.dtype) * 1e12, calib.dense_tflops("bf16") * 1e12
  stages = [
      Stage("attention", w.proj_flops / dense_rate + w.core_flops / (core_rate * 1e12),
            f"{w.dtype} projections, {c.attention} core" + (f"; {core_note}" if core_note else "")),
      Stage("dense", w.dense_flops / dense_rate + w.bf16_flops / bf16_rate,
            f"dense MLPs and shared experts {w.dtype}; router and logits bf16"
            + ("; MaxText's MoE einsums bf16" if moe_layers(c) and not w.experts_s else "")),
  ]
  if w.experts_s:
    stages += [Stage("experts", w.experts_s, w.experts_note),
               Stage("dispatch/combine", w.dispatch_s, "rows gathered and scattered, over HBM")]
  stages += [Stage("elementwise", w.elementwise_bytes / (calib.elementwise_tbps() * 1e12),
                   "norms, residuals, casts, loss, weight slices: bytes over HBM"),
             Stage("optimizer", w.optimizer_bytes / (calib.optimizer_tbps() * 1e12), "AdamW over this device's parameters")]
  count = flops.count(c)
  share = recomputed_share(c, placements_of(c))
  act = 2 if str(c.dtype) == "bfloat16" else 4
  layers = c.num_decoder_layers + c.mtp_num_layers
  layer_compute = sum(s.seconds for s in stages if s.name != "optimizer")
  shared = count.shared_experts * (1 + share["mlp"] / 3) / dense_rate
  collectives = expert_exchange(job, gpu, count.tokens, share, layer_compute, (w.experts_s, shared))
  if job.megatron:
    collectives += distributed_optimizer(job, gpu, layer_compute)
  else:
    collectives += fsdp(job, gpu, microbatches(job), layer_compute, collectives, xla_flags)
    collectives += data_parallel(job, gpu, layer_compute / microbatches(job), xla_flags)
  collectives += tensor_parallel(job, gpu, count.tokens, layers, share, act)
  collectives += pipeline_transfers(job, gpu, count.tokens, act)
  collectives += host_offload(job, gpu, count.tokens, act, layer_compute)
  collectives += nic_floor(collectives, sum(s.seconds for s in stages))
  stages_n, repeats, micro = pipeline(job)
  bubble = 0.0
  if stages_n > 1:
    fraction = (stages_n - 1) / (repeats * micro + stages_n - 1)
    if c.pipeline_delay_activation_forwarding:  # MaxText: delaying the forwarding doubles the bubble
      fraction = 2 * (stages_n - 1) / (repeats * micro + 2 * (stages_n - 1))
    bubble = (layer_compute + sum(x.exposed for x in collectives)) * fraction / (1 - fraction)
  fp8 = flops.fp8_flops(types.SimpleNamespace(te_moe_block=c.te_moe_block, te_gmm_quantization=c.te_gmm_quantization,
                                              quantization=job.dense_quantization), count)
  peak = flops.effective_peak(count.total, fp8, (gpu.bf16_tflops, gpu.fp8_tflops))
  notes = (calib.describe(),) + ((w.experts_note,) if ":" in w.experts_note else ())
  return Prediction(gpu, calib, tuple(stages), tuple(collectives), bubble, count.tokens, count.total, peak, notes)


def exchange_exposed(p: Prediction) -> float:
  """Seconds of the step the expert exchange leaves exposed: its own, and its share (by NIC time) of what the shared
  scale-out NIC adds (`nic_floor`)."""
  exchange = [x for x in p.collectives if x.name.startswith("expert all-to-all")]
  own = sum(x.exposed for x in exchange)
  floor = next((x for x in p.collectives if x.name == NIC_FLOOR), None)
  if floor is None:
    return own
  nic = [x for x in p.collectives if "scale-out" in x.link and x is not floor]
  share = sum(x.seconds for x in exchange if x in nic) / max(sum(x.seconds for x in nic), 1e-30)
  return own + floor.exposed * share


NIC_FLOOR = "scale-out NIC shared"


def nic_floor(collectives: list[Collective], compute: float) -> list[Collective]:
  """A device's scale-out NIC carries every collective that crosses the NVLink domain (FSDP's and the data-parallel
  rings, the expert exchange's remote rows, pipeline transfers), so however much of each hides behind compute, the
  step lasts at least their summed time: what the NIC needs beyond the step as priced is exposed here."""
  nic = [x for x in collectives if "scale-out" in x.link]
  busy = sum(x.seconds for x in nic)
  step = compute + sum(x.exposed for x in collectives)
  if busy <= step:
    return []
  return [Collective(NIC_FLOOR, 0.0, 1, "scale-out", busy, busy - step,
                     f"{busy * 1e3:,.0f} ms of the collectives above cross it; the step waits for "
                     f"{(busy - step) * 1e3:,.0f} ms beyond their exposed time")]


def flag_on(xla_flags: dict[str, str], key: str) -> bool:
  return xla_flags.get(OVERLAP_FLAGS[key], "").lower() in ("true", "on", "1", "auto")


def steady_share(job: Job) -> float:
  """Of a step's forward (and backward) passes, the share Megatron's schedule pairs with a pass of another
  microbatch: all but the warm-up forwards and cool-down backwards, (stages - 1) + (chunks - 1) x stages per
  rank on average in the interleaved schedule (Megatron-LM core/pipeline_parallel/schedules.py,
  num_warmup_microbatches), the circular pipeline's repeats standing for the virtual chunks; all but one without
  pipelining."""
  stages, repeats, micro = pipeline(job)
  passes = repeats * micro if stages > 1 else microbatches(job)
  warmup = (stages - 1) + (repeats - 1) * stages if stages > 1 else 1
  return max(0.0, 1 - min(warmup, passes) / passes)


def expert_exchange(job: Job, gpu, tokens: float, share: dict, compute: float = 0.0,
                    beside: tuple[float, float] = (0.0, 0.0)) -> list[Collective]:
  """The expert all-to-all of every MoE layer. Each MoE layer waits for its rows, but inside temoe's layer the
  exchange may overlap what does not depend on it (`layer_overlap`, with `beside` = (routed expert GEMM seconds,
  shared expert seconds) of the step); MaxText's own MoE layer hides none of it. A Megatron run with
  `overlap_moe_expert_parallel_comm` overlaps one microbatch's dispatch and combine with another's computation in
  the 1F1B schedule (Megatron-Core MoE docs, "EP communication overlap"), which hides it behind `compute` on the
  passes the schedule pairs (`steady_share`). The hierarchical exchange is two all-to-alls one after the other
  (`hier_hops`)."""
  c = job.config
  ep = job.size(("expert",))
  if ep <= 1 or not moe_layers(c):
    return []
  from temoe.moe import exchange  # pylint: disable=import-outside-toplevel

  local = c.num_experts // ep
  node = exchange_volume.node_size_of(c)
  strategy = "ragged" if not c.te_moe_block else exchange.resolve(str(c.te_moe_exchange), ep, "gpu",
                                                                   c.num_experts_per_tok, local, node_size=node)
  groups = (c.n_routing_groups, c.topk_routing_group)
  distinct = exchange_volume.modelled_distinct_ranks(c.num_experts, c.num_experts_per_tok, ep, *groups)
  nodes = (exchange_volume.modelled_distinct_nodes(c.num_experts, c.num_experts_per_tok, ep, node, *groups)
           if strategy == "hier" else None)
  volume = exchange_volume.layer_volume(strategy, tokens, c.emb_dim, c.num_experts_per_tok, ep, local, distinct,
                                        node_size=node, distinct_nodes=nodes)
  ranks, inside = group_links(job, ("expert",), gpu)
  if strategy == "hier":
    parts = hier_hops(volume, ep, node, inside, gpu, moe_layers(c), share)
    hop1, hop2 = volume.hops
    notes = (f"{nodes:.2f} nodes/token modelled: {hop1.rows_forward / 2:,.0f} rows a dispatch to the relays (one a node), "
             f"{hop1.rows_scale_out:,.0f} of them leave the node",
             f"{distinct:.2f} ranks/token modelled: {hop2.rows_forward / 2:,.0f} rows a dispatch from the relays "
             f"to their node's ranks")
    names = ("hop 1", "hop 2")
    parts = [(f"expert all-to-all ({strategy}) {name}", *part, note) for name, part, note in zip(names, parts, notes)]
  else:
    sent = moe_layers(c) * (volume.bytes + share["gate_up"] * volume.bytes_forward / 2)  # dispatch again if recomputed
    parts = [(f"expert all-to-all ({strategy})", ranks, *all_to_all_seconds(sent, ranks, inside, gpu),
              f"{distinct:.2f} ranks/token modelled")]
  out = []
  if c.te_moe_block and job.layer_overlap and not job.megatron:
    chunks = max(int(getattr(c, "te_moe_chunks", 1) or 1), 1)
    exposed, why = layer_overlap([p[2] for p in parts], chunks, *beside, hops=strategy == "hier")
    total = sum(p[2] for p in parts) or 1.0
    return [Collective(name, moved, group, link, seconds, seconds * exposed / total, f"{note}; {why}")
            for name, group, seconds, moved, link, note in parts]
  for name, group, seconds, moved, link, note in parts:
    if job.megatron and job.megatron.overlap_expert_exchange:
      paired = steady_share(job)
      exposed = seconds * (1 - paired) + max(0.0, (seconds - compute) * paired)
      out.append(Collective(name, moved, group, link, seconds, exposed,
                            f"{note}; overlapped with another microbatch's compute "
                            f"(overlap_moe_expert_parallel_comm) on {paired:.0%} of the passes"))
    else:
      out.append(Collective(name, moved, group, link, seconds, seconds,
                            f"{note}; never hidden: each MoE layer waits for its rows"))
  return out


OVERLAP_ASSUMED = ("the exchange's overlap inside temoe's MoE layer is assumed, not measured: the shared expert "
                   "depends on no all-to-all of the layer (tests/unit/test_moe_overlap.py checks it in the compiled "
                   "program), so its time hides as much exchange; with te_moe_chunks=C, chunk k+1's exchange runs "
                   "during chunk k's expert GEMMs, so (1 - 1/C) of the routed GEMM time hides exchange (the first "
                   "chunk's dispatch and the last one's combine wait), and hier's two hops, on different links, "
                   "pipeline across chunks; no slowdown of the GEMMs by the exchange's kernels is priced")
"""How `layer_overlap` prices the overlap the layer allows where no compiled GPU schedule is measured (bench/one_rank.py
replaces it with the measured schedule's)."""


def layer_overlap(seconds: list[float], chunks: int, experts: float, shared: float, hops: bool = False
                  ) -> tuple[float, str]:
  """(exposed seconds, note) of an exchange taking `seconds` per part over a step's MoE layers (hier: its two hops,
  `hops`), inside temoe's layer with `chunks` token chunks, `experts` seconds of routed expert GEMMs and `shared`
  seconds of shared expert in the step (`OVERLAP_ASSUMED`)."""
  total = sum(seconds)
  pipelined = 0.0
  if hops and chunks > 1 and len(seconds) > 1:  # chunk k's in-node hop beside chunk k+1's scale-out hop
    pipelined = (total - max(seconds)) * (1 - 1 / chunks)
  behind_shared = min(total - pipelined, shared)
  behind_gemms = min(total - pipelined - behind_shared, experts) * (1 - 1 / chunks)
  exposed = total - pipelined - behind_shared - behind_gemms
  parts = [f"the shared expert {behind_shared * 1e3:.1f} ms"]
  if chunks > 1:
    parts.append(f"{chunks} chunks' expert GEMMs {behind_gemms * 1e3:.1f} ms")
  if pipelined:
    parts.append(f"the hops pipelined over chunks {pipelined * 1e3:.1f} ms")
  return exposed, "assumed hidden behind " + ", ".join(parts) + " (temoe's layer; not measured)"


def hier_hops(volume: exchange_volume.Volume, ep: int, node: int, inside: int, gpu, layers: int,
              share: dict) -> list[tuple[int, float, float, str]]:
  """(ranks, seconds, network bytes, link) of each hop of the hierarchical exchange over all MoE layers, each an
  all-to-all as `all_to_all_seconds` prices one: hop 1 among the `ep // node` relays of a device's local index
  (one a node: the peers inside the device's NVLink domain, `inside` ranks of the expert axis, over NVLink, the
  rest over the device's NIC), hop 2 among the `node` ranks of the node (over NVLink where the node is inside
  the domain). Hop 2 starts on hop 1's rows (and the combine's hop 1 on hop 2's), so the hops add."""
  node = min(node, ep)
  groups = ((ep // node, max(inside // node, 1)), (node, min(node, inside)))
  out = []
  for hop, (ranks, in_domain) in zip(volume.hops, groups):
    sent = layers * (hop.bytes + share["gate_up"] * hop.bytes_forward / 2)  # dispatch again if recomputed
    seconds, moved, link = all_to_all_seconds(sent, ranks, in_domain, gpu)
    if in_domain <= 1 and ranks > 1:
      link = "scale-out"  # no peer of this hop shares the domain
    out.append((ranks, seconds, moved, link))
  return out


def layer_weights(c, tp: int, ep: int) -> tuple[float, float]:
  """(non-expert, expert) parameters all layers hold once gathered on one device."""
  moe = moe_layers(c)
  dense = c.num_decoder_layers - moe
  attention = model_size.mla_params(c) if str(getattr(c.attention_type, "value", c.attention_type)) == "mla" \
      else sum(p for p, _ in attention_gemms(c))
  non_expert = (c.num_decoder_layers * attention + dense * model_size.mlp_params(c, c.mlp_dim)
                + moe * (model_size.mlp_params(c, c.moe_mlp_dim * c.shared_experts) + c.emb_dim * c.num_experts)
                + c.vocab_size * c.emb_dim * (1 if c.logits_via_embedding else 2))
  expert = moe * c.num_experts // ep * model_size.mlp_params(c, c.moe_mlp_dim)
  return non_expert / tp, expert / tp


def fsdp(job: Job, gpu, micro: int, layer_compute: float, earlier: list, xla_flags) -> list[Collective]:
  """All-gathers of the weights (forward and again in the backward) and reduce-scatters of their gradients,
  once per microbatch, over the axes each weight is sharded on; weights gathered in the activation dtype,
  gradients reduced in the weight dtype."""
  c = job.config
  stages = pipeline(job)[0]
  act = 2 if str(c.dtype) == "bfloat16" else 4
  grad = 2 if str(c.weight_dtype) == "bfloat16" else 4
  non_expert, expert = layer_weights(c, job.size(TENSOR_AXES), job.size(("expert",)))
  out = []
  for label, params, axes in (("non-expert", non_expert, NON_EXPERT_GATHER_AXES), ("expert", expert, EXPERT_GATHER_AXES)):
    ranks, inside = group_links(job, axes, gpu)
    if ranks <= 1 or params <= 0:
      continue
    params_here = params / stages  # a pipeline stage holds its own layers
    gather, moved_g, link = ring_seconds(params_here * act, ranks, inside, gpu)
    reduce, moved_r, _ = ring_seconds(params_here * grad, ranks, inside, gpu)
    out.append(Collective(f"FSDP all-gather ({label} weights)", 2 * micro * moved_g, ranks, link, 2 * micro * gather, 0.0,
                          "forward and backward, every microbatch"))
    out.append(Collective(f"FSDP reduce-scatter ({label} grads)", micro * moved_r, ranks, link, micro * reduce, 0.0,
                          "every microbatch"))
  if not out:
    return out
  # overlap: pipelined all-gathers / reduce-scatters hide behind layer compute (and, on another link with
  # multi-streaming, behind the expert exchange); the first layer's gather always waits
  budget = layer_compute if flag_on(xla_flags, "scheduler") else 0.0
  if flag_on(xla_flags, "streams"):
    budget += sum(x.seconds for x in earlier if x.link != out[0].link)
  layers = c.num_decoder_layers / stages
  exposed = []
  for x in out:
    kind = "all_gather" if "all-gather" in x.name else "reduce_scatter"
    hidden = flag_on(xla_flags, kind) and budget > 0
    take = min(x.seconds * (1 - 1 / max(layers, 1)), budget) if hidden else 0.0
    budget -= take
    exposed.append(dataclasses.replace(x, exposed=x.seconds - take,
                                       note=x.note + ("; hidden by " + OVERLAP_FLAGS[kind] if hidden else "; exposed")))
  return exposed


def megatron_local_params(job: Job) -> tuple[float, float]:
  """(non-expert, expert) parameters one device of a Megatron run holds: its pipeline stage's layers,
  non-expert weights split by tensor parallelism only (replicated over data parallelism), expert weights
  as the job's layout splits them."""
  non_expert, expert = layer_weights(job.config, job.size(TENSOR_AXES), job.size(("expert",)))
  stages = pipeline(job)[0]
  return non_expert / stages, expert / stages


def distributed_optimizer(job: Job, gpu, layer_compute: float) -> list[Collective]:
  """Megatron's distributed optimizer (ZeRO-1, `Megatron`): once per step the bf16 gradients are
  reduce-scattered and the updated bf16 weights all-gathered over each weight's data-parallel group (non-expert
  weights: every rank of the stage but its tensor-parallel peers; expert weights: those holding the same
  experts); bucketed, each hidden behind the backward / the next forward when its overlap setting is on, all
  but the last bucket (one layer's share)."""
  m = job.megatron
  non_expert, expert = megatron_local_params(job)
  replica = [a for a in job.config.mesh_axes if a not in TENSOR_AXES + ("stage",)]
  layers = job.config.num_decoder_layers / pipeline(job)[0]
  out, budget = [], layer_compute
  for label, params, axes in (("non-expert", non_expert, tuple(replica)),
                              ("expert", expert, tuple(a for a in replica if a != "expert"))):
    ranks, inside = group_links(job, axes, gpu)
    if ranks <= 1 or params <= 0:
      continue
    seconds, moved, link = ring_seconds(params * 2, ranks, inside, gpu)  # bf16 weights and gradients
    for kind, overlap in (("reduce-scatter", m.overlap_grad_reduce), ("all-gather", m.overlap_param_gather)):
      take = min(seconds * (1 - 1 / max(layers, 1)), budget) if overlap else 0.0
      budget -= take
      what = "grads" if kind == "reduce-scatter" else "weights"
      setting = "overlap_grad_reduce" if kind == "reduce-scatter" else "overlap_param_gather"
      out.append(Collective(f"distributed-optimizer {kind} ({label} {what})", moved, ranks, link, seconds,
                            seconds - take, "once per step; " + (f"hidden ({setting})" if overlap else "exposed")))
  return out


def data_parallel(job: Job, gpu, micro_compute: float, xla_flags) -> list[Collective]:
  """All-reduce of every gradient once per step over the replica axes (and the stage axis where it acts as
  data); hidden behind the last microbatch's backward with the pipelined all-reduce."""
  c = job.config
  axes = REPLICA_AXES + (("stage",) if pipeline(job)[0] == 1 else ())
  ranks, inside = group_links(job, axes, gpu)
  if ranks <= 1:
    return []
  grad = 2 if str(c.weight_dtype) == "bfloat16" else 4
  seconds, moved, link = ring_seconds(job.local_params * grad, ranks, inside, gpu)
  seconds, moved = 2 * seconds, 2 * moved  # reduce-scatter + all-gather
  hidden = flag_on(xla_flags, "scheduler") and flag_on(xla_flags, "all_reduce")
  exposed = max(0.0, seconds - 2 / 3 * micro_compute) if hidden else seconds
  return [Collective("data-parallel all-reduce", moved, ranks, link, seconds, exposed,
                     "once per step" + ("; hidden behind the backward" if hidden else "; exposed"))]


def tensor_parallel(job: Job, gpu, tokens, layers, share, act) -> list[Collective]:
  tp = job.size(TENSOR_AXES)
  if tp <= 1:
    return []
  ranks, inside = group_links(job, TENSOR_AXES, gpu)
  per = tokens * tp * job.config.emb_dim * act  # one gathered activation of the tensor-parallel group
  count = layers * (8 + 4 * share["layer"])  # gather + scatter around attention and MLP, forward and backward
  seconds, moved, link = ring_seconds(per, ranks, inside, gpu)
  return [Collective("tensor-parallel all-gather/reduce-scatter", count * moved, ranks, link, count * seconds,
                     count * seconds, "8 per layer (and 4 per recomputed layer); exposed (no collective matmul)")]


def pipeline_transfers(job: Job, gpu, tokens, act) -> list[Collective]:
  stages, repeats, micro = pipeline(job)
  if stages <= 1:
    return []
  ranks, inside = group_links(job, ("stage",), gpu)
  per_micro = tokens * stages / micro * job.config.emb_dim * act  # one microbatch's activations on a stage
  moved = 2 * repeats * micro * per_micro  # forward activations and backward gradients, every repeat
  bandwidth = gpu.nvlink_gbps * LINK_EFFICIENCY["nvlink"] if inside >= ranks else gpu.scale_out_gbps * LINK_EFFICIENCY["scale_out"]
  seconds = moved / (bandwidth * 1e9)
  delayed = bool(job.config.pipeline_delay_activation_forwarding)  # MaxText: transfers off the critical path
  why = "pipeline_delay_activation_forwarding" if delayed else ""
  if job.megatron and job.megatron.overlap_p2p:  # Megatron's interleaved schedule sends while it computes
    delayed, why = True, "overlap_p2p_comm"
  return [Collective("pipeline send/receive", moved, ranks, "NVLink" if inside >= ranks else "scale-out", seconds,
                     0.0 if delayed else seconds, "stage to stage, every microbatch and repeat; "
                     + (f"overlapped ({why})" if delayed else "exposed"))]


def host_offload(job: Job, gpu, tokens, act, layer_compute) -> list[Collective]:
  """Tensors the remat policy offloads go to host memory in the forward and back in the backward,
  asynchronously: hidden unless the link needs longer than the compute."""
  c = job.config
  placements = placements_of(c)
  offloaded = [n for n, where in placements.items() if where == "host"]
  if not offloaded:
    return []
  from temoe.tools import hbm_activations as act_model  # pylint: disable=import-outside-toplevel

  shapes = act_model.Shapes(tokens=int(tokens), batch=1, seq=c.max_target_length, emb=c.emb_dim,
                            tp=job.size(TENSOR_AXES), ep=job.size(("expert",)), act=act)
  policy = act_model.remat_policy(c)
  total = 0.0
  for moe, count in ((False, c.num_decoder_layers - moe_layers(c)), (True, moe_layers(c))):
    tensors = act_model.layer_tensors(c, shapes, moe, int(tokens * c.num_experts_per_tok), job.backend)
    total += count * sum(t.elements * (t.itemsize or act) for t in tensors if act_model.kept(policy, t, c) == "host")
  moved = 2 * total
  seconds = moved / (gpu.host_gbps * 1e9 * LINK_EFFICIENCY["host"])
  return [Collective("host offload (D2H + H2D)", moved, 1, "host", seconds, max(0.0, seconds - layer_compute),
                     f"{', '.join(sorted(offloaded))}; overlapped with compute")]


# --- output -----------------------------------------------------------------------------------------


def table_lines(p: Prediction) -> list[str]:
  """`temoe plan`'s step-time table."""
  step = p.step_seconds
  lines = [f"  step time on {p.gpu.name} ({p.calibration.describe()}):"]
  width = 44
  for s in p.stages:
    lines.append(f"    {'compute: ' + s.name:<{width}} {s.seconds * 1e3:10.1f} ms  {s.note}")
  for x in p.collectives:
    lines.append(f"    {x.name + ' [' + x.link + ', ' + str(x.ranks) + ' ranks]':<{width}} {x.seconds * 1e3:10.1f} ms  "
                 f"exposed {x.exposed * 1e3:.1f} ms; {x.bytes / 2**30:.2f} GiB; {x.note}")
  if p.bubble:
    lines.append(f"    {'pipeline bubble':<{width}} {p.bubble * 1e3:10.1f} ms")
  lines.append(f"    {'step':<{width}} {step * 1e3:10.1f} ms  {p.tokens_per_s:,.0f} tokens/s/GPU, "
               f"{p.tflops:,.0f} TFLOP/s/GPU (MaxText's count), MFU {p.mfu:.1%} of {p.peak_tflops:,.0f}")
  exchange = exchange_exposed(p)
  if any(x.name.startswith("expert all-to-all") for x in p.collectives):
    lines.append(f"    {'exposed expert exchange':<{width}} {exchange * 1e3:10.1f} ms  {exchange / step:.1%} of the step "
                 "(with its share of the shared NIC's wait)")
  lines += [f"    note: {n}" for n in p.notes[1:]]
  if any("assumed hidden" in x.note for x in p.collectives):
    lines.append(f"    note: {OVERLAP_ASSUMED}")
  return lines


# --- fitting: the constants no micro-benchmark measures, from one profiled step -------------------------


def fit_profile(data: dict, gpu: hardware.GPU, job: Job, profile: dict, step_s: float, sources: list[str],
                rows: list[str], core_only: bool = False) -> dict:
  """The `fitted` entries one profiled training step (temoe profile's ms per category, `profile`) of `job`
  gives, its categories scaled to the unprofiled step time `step_s` of the same config (the profiler and
  its CUDA-graphs-off run add time): the in-step dense GEMM efficiency (the `dense` category), the attention
  core rate of the config's kernel (`attention` less the projections), the elementwise efficiency (`other`,
  `idle` and `router`) and the optimizer's (`optimizer`). `core_only`: the attention core rate alone, with
  the dense efficiency already in `data`. Each entry names its sources and the benchmark rows it fits."""
  fitted = dict(data.get("fitted", {}))
  trial = {**fitted}
  for key in ("dense_efficiency", "elementwise_efficiency", "optimizer_efficiency"):
    trial.setdefault(key, {"value": 1.0})
  calib = cal.Calibration(gpu, gpu, {**data, "fitted": trial}, "(fitting)")
  w = work(job, calib)
  scale = step_s / (profile["step_ms"] / 1e3)
  ms = {k: v / 1e3 * scale for k, v in profile["ms_per_step"].items()}
  bf16 = float(data["dense_gemm_tflops"]["bf16"]["value"]) * 1e12
  raw = float(data["dense_gemm_tflops"][w.dtype]["value"]) * 1e12
  entry = {"fitted_from": sources, "rows": rows}
  if not core_only:
    dense = (w.dense_flops / raw + w.bf16_flops / bf16) / ms["dense"]
    fitted["dense_efficiency"] = {"value": dense, **entry, "what": "in-step dense GEMM time / FLOPs at the dense rates"}
  dense = fitted["dense_efficiency"]["value"]
  core_s = ms["attention"] - w.proj_flops / (raw * dense)
  kernel = str(job.config.attention)
  measured_core = data.get("attention_core_tflops", {}).get(kernel)
  residual = 0.0  # attention time a measured core rate leaves unexplained: MLA's norms, rope, reshapes
  if measured_core:
    residual = max(0.0, core_s - w.core_flops / (float(measured_core["value"]) * 1e12))
  elif core_s <= 0:
    raise cal.CalibrationError("the profile's attention time is below its projections' at the dense rate")
  else:
    cores = dict(fitted.get("attention_core_tflops", {}))
    cores[kernel] = {"value": w.core_flops / core_s / 1e12, **entry,
                     "what": f"{kernel} core FLOPs (recompute included) / (attention time - projections)"}
    fitted["attention_core_tflops"] = cores
  if core_only:
    return fitted
  bw = float(data["elementwise_tbps"]["value"]) * 1e12
  target = ms["other"] + ms.get("idle", 0.0) + ms.get("router", 0.0) + residual
  fitted["elementwise_efficiency"] = {
      "value": w.elementwise_bytes / bw / target, **entry,
      "what": "counted elementwise bytes at the measured bandwidth / (other + idle + router"
              + (" + attention not explained by the measured core" if measured_core else "") + " time)"}
  opt_bw = float(data.get("optimizer_tbps", data["elementwise_tbps"])["value"]) * 1e12
  fitted["optimizer_efficiency"] = {"value": w.optimizer_bytes / opt_bw / ms["optimizer"], **entry,
                                    "what": "optimizer bytes at the measured rate / optimizer time"}
  return fitted


# --- from a plan ------------------------------------------------------------------------------------


def job_of(config, ici, dcn, slices: int, backend: str, quantization: str, estimate) -> Job:
  """The step model's view of a `temoe plan` plan: the config, its mesh split, and from the HBM estimate
  the trainable parameters and optimizer state one device holds."""
  parts = {p.name: p.bytes for p in estimate.resident}
  weight_bytes = 2 if str(config.weight_dtype) == "bfloat16" else 4
  return Job(config, tuple(ici), tuple(dcn), max(int(slices), 1), backend, quantization or "",
             parts.get("gradients", 0.0) / weight_bytes, parts.get("optimizer state", 0.0))


def xla_flags_for(gpu: hardware.GPU, environ: dict[str, str]) -> tuple[str, dict[str, str]]:
  """The XLA_FLAGS a job on `gpu` runs with (temoe's env profile, a flag set in `environ` winning) and their
  values by name."""
  from temoe.deploy import env  # pylint: disable=import-outside-toplevel

  flags = env.environment(env.arch_of(gpu.compute_capability), environ).get("XLA_FLAGS", "")
  return flags, env.parse_xla_flags(flags)


def layout_hazards(job: Job, gpu: hardware.GPU, xla_flags: str) -> list:
  """Known scale hazards of this layout's expert parallelism (temoe.deploy.hazards)."""
  from temoe.deploy import hazards  # pylint: disable=import-outside-toplevel

  ranks, inside = group_links(job, ("expert",), gpu)
  return hazards.for_layout(ranks, inside, xla_flags) if moe_layers(job.config) else []


def plan_lines(job: Job, gpu_name: str, environ: dict[str, str]) -> list[str]:
  """What `temoe plan` prints after the memory table: the step-time table and the layout's hazards."""
  calib = cal.calibration_for(gpu_name)
  raw, flags = xla_flags_for(calib.gpu, environ)
  lines = table_lines(predict(job, calib, flags))
  for h in layout_hazards(job, calib.gpu, raw):
    lines.append(f"  {'hazard' if h.blocking else 'warning'}: {h.what}. Avoid: {h.fix} ({h.source})")
  return lines
