"""`temoe plan`'s step model against every step time it can be checked on, written to
bench/results/step_model_check.json ({"rows": [...], "excluded": [...]}; a test regenerates and compares it).

one_gpu rows: every proxy path of bench/results/proxy_1gpu*.json (bench/proxy_1gpu.py's flags, planned
here on an H200 stand-in), the MoE-layer classes of moe_layer.json each predicted from the other class of
its expert shape, and the stages of the profiled step no profile constant prices. A row is `fitted` when a
calibration constant its prediction uses was fitted to that row's config (the constant's `rows`), so it
is not a check of that constant. published rows: DeepSeek-V3 671B runs as their publishers describe them
(GPUs, layout, recipe), expressed as MaxText settings on the shipped 671B presets, against the published
TFLOP/s/GPU (and tokens/s/GPU where given). target rows: temoe's best layout (`temoe plan --sweep` of the preset at
the publisher's global batch, in microbatches of 1, 2 or 4 sequences, on the same GPUs) against the same model's
prediction for the publisher's own layout, and issue 53's targets on 1,024 H100. one_rank rows: the predicted compute of each run of
bench/results/one_rank.json (one rank of the job at its real shapes, network mocked) against the measured one.
Nothing here is tuned per row.

    python bench/step_model_check.py [--out bench/results/step_model_check.json] [--only one_gpu|one_rank|published|target]
        [--write-docs]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

PROXY_FILES = ("proxy_1gpu.json", "proxy_1gpu.scan1.json", "proxy_1gpu.scan0.json", "proxy_1gpu.save_moe.json",
               "proxy_1gpu.paths.json", "proxy_1gpu.variants.json", "proxy_1gpu.recipes.json",
               "proxy_1gpu.run2-allpaths.json")
EXCLUDED = {
    ("proxy_1gpu.run2-allpaths.json", "temoe_fp8"): (
        "ran temoe's block as it was on 2026-11-29 (FP8 expert GEMMs on TE's synchronising grouped GEMM, autoselected "
        "attention, remat full); the code and the path's flags have changed since, so no config of today reproduces it"),
}
"""Measured rows not predicted, with why (the stock MaxText paths of that file run MaxText's own MoE and
the same flags as then, so they are kept)."""

SEEDS = "/work/shared/NOTES.md and seeds (NVIDIA's JAX/TE MoE article)"
BRIDGE = "github.com/NVIDIA-NeMo/Megatron-Bridge docs/performance-summary{,-archive}.md"
NO_PIPELINED_BIAS = ["override_model_config=true", "routed_bias=false"]
"""MaxText's pipeline carries no routing-bias variable through its stages (temoe refuses routed_bias=true under a
pipeline, MaxText's own MoE fails alike), so the pipelined rows plan DeepSeek-V3 without its 256-float expert bias
per layer (the published runs keep theirs; its compute and memory are nil at this scale)."""
GB300_PP2 = [*NO_PIPELINED_BIAS, "dcn_pipeline_parallelism=2", "ici_expert_parallelism=4", "dcn_expert_parallelism=8", "dcn_fsdp_parallelism=1",
             "dcn_data_parallelism=4", "per_device_batch_size=16", "pipeline_parallel_layers=56",
             "num_layers_per_pipeline_stage=4", "quantization=te_mxfp8"]
"""Megatron's TP1 PP2 VP8 EP32 on 256 GPUs in MaxText: 2 stages of 28 pipelined layers in 7 repeats (the
nearest to VP 8 that divides them), EP 32 inside a rack, the rest data parallel; GBS 4096."""
GB200_PP4 = [*NO_PIPELINED_BIAS, "dcn_pipeline_parallelism=4", "ici_expert_parallelism=4", "dcn_expert_parallelism=16", "dcn_fsdp_parallelism=1",
             "per_device_batch_size=16", "num_pipeline_microbatches=64", "pipeline_parallel_layers=56",
             "num_layers_per_pipeline_stage=2", "quantization=te_mxfp8"]
"""Megatron's TP1 PP4 VP4 EP64 MBS 1 on 256 GPUs in MaxText: 4 stages of 14 pipelined layers in 7 repeats,
EP 64 in one rack, 64 microbatches of one sequence per pipeline replica; GBS 4096."""
MB = "github.com/NVIDIA-NeMo/Megatron-Bridge"
MB_2602 = {"overlap_grad_reduce": True, "overlap_param_gather": True, "overlap_p2p": True,
           "overlap_expert_exchange": False}
"""Megatron-Bridge 26.02's DeepSeek-V3 GB300/GB200 MXFP8 V2 recipes (tag v0.3.0): distributed optimizer with
overlap_grad_reduce and overlap_param_gather (src/megatron/bridge/recipes/deepseek/deepseek_v3.py; comm_overlap.
overlap_grad_reduce=True in scripts/performance/configs/deepseek/deepseek_llm_pretrain.py), overlap_p2p_comm with
VP > 1 (src/megatron/bridge/training/comm_overlap.py), moe_a2a_overlap=False (scripts/performance/configs/
deepseek/deepseek_workload_base_configs.py)."""
MB_2608 = {**MB_2602, "overlap_expert_exchange": True}
"""Megatron-Bridge 26.08's GB300/GB200 MXFP8 recipes (tag v0.6.0, src/megatron/bridge/perf_recipes/deepseek/
{gb300,gb200}/deepseek_v3.py): as 26.02, and _enable_deepseek_full_iteration_mxfp8 (perf_recipes/deepseek/
common.py) sets comm_overlap.overlap_moe_expert_parallel_comm and delay_wgrad_compute."""
MB_2509_H100 = {"overlap_grad_reduce": False, "overlap_param_gather": True, "overlap_p2p": True,
                "overlap_expert_exchange": True}
"""Megatron-Bridge 25.09's H100 DeepSeek-V3 run (commit fa0315ae2, the 25.09 performance summary's):
scripts/performance/run_script.py sets overlap_moe_expert_parallel_comm and delay_wgrad_compute (A2A_1F1B on
h100), DeepEP, and comm_overlap.overlap_grad_reduce=False on h100; the recipe's distributed optimizer with
overlap_param_gather (src/megatron/bridge/recipes/deepseek/deepseek_v3.py), overlap_p2p_comm with VP 4."""
PUBLISHED = [
    # name, GPU, config, devices, slices, MaxText settings, reference, unit, source, how Megatron runs it
    ("NVIDIA JAX + TE, 128 GB200, MXFP8 (FSDP 16 x EP 8, batch 6)", "gb200", "deepseek3-671b-gb200x256.yml", 128, 32,
     ["ici_expert_parallelism=4", "dcn_expert_parallelism=2", "dcn_fsdp_parallelism=16", "per_device_batch_size=6"],
     1068.0, "TFLOP/s/GPU",
     f"{SEEDS}: 1,068 TFLOP/s/GPU optimised on GB200; layout, batch and recipe from NVIDIA's DeepSeek-V3 recipe "
     "(JAX-Toolbox docs/frameworks/maxtext/deepseek-v3-moe: 128 GPUs, FSDP 16 x EP 8, per_device_batch_size 6, "
     "te_mxfp8, te_fp8_currentscaling dense, cudnn_flash_te, moe_mlpwi offload); the article's GPU count not stated",
     None),
    ("Megatron-Core paper, 256 GB300, MXFP8 (TP1 PP2 VP8 EP32, MBS 2)", "gb300", "deepseek3-671b-gb200x256.yml", 256, 64,
     [*GB300_PP2, "num_pipeline_microbatches=16"],
     1233.0, "TFLOP/s/GPU",
     "arXiv 2603.07685 (Megatron-Core MoE report): 1,233 TFLOP/s/GPU, 256 GB300; its layout assumed to be Megatron-"
     f"Bridge 26.02.01's DeepSeek-V3 GB300 row (1,219 TFLOP/s: GBS 4096, MBS 2, TP1 PP2 VP8 EP32, MXFP8; {BRIDGE}) "
     f"and its 26.02 recipe ({MB} v0.3.0)", MB_2602),
    ("Megatron-Core paper, 256 GB200, MXFP8 (TP1 PP4 VP4 EP64, MBS 1)", "gb200", "deepseek3-671b-gb200x256.yml", 256, 64,
     GB200_PP4,
     1048.0, "TFLOP/s/GPU",
     "arXiv 2603.07685: 1,048 TFLOP/s/GPU, 256 GB200; layout assumed to be Megatron-Bridge 26.02.01's GB200 row "
     f"(1,046 TFLOP/s: GBS 4096, MBS 1, TP1 PP4 VP4 EP64, MXFP8; {BRIDGE}) and its 26.02 recipe ({MB} v0.3.0)",
     MB_2602),
    ("Megatron-Bridge 26.08, 256 GB300, MXFP8 (TP1 PP2 VP8 EP32, MBS 1)", "gb300", "deepseek3-671b-gb200x256.yml", 256, 64,
     [*GB300_PP2, "num_pipeline_microbatches=32"],
     1635.0, "TFLOP/s/GPU", f"{BRIDGE}, 26.08: GB300, 256 GPUs, MXFP8, GBS 4096, MBS 1, seq 4096, TP1 PP2 CP1 VP8 EP32: "
     "6,288 tokens/s/GPU, 1,635 TFLOP/s/GPU; recipe: perf_recipes/deepseek/gb300/deepseek_v3.py "
     f"fp8mx ({MB} v0.6.0)", MB_2608),
    ("Megatron-Bridge 26.08, 256 GB200, MXFP8 (TP1 PP4 VP4 EP64, MBS 1)", "gb200", "deepseek3-671b-gb200x256.yml", 256, 64,
     GB200_PP4,
     1276.0, "TFLOP/s/GPU", f"{BRIDGE}, 26.08: GB200, 256 GPUs, MXFP8, GBS 4096, MBS 1, seq 4096, TP1 PP4 CP1 VP4 EP64: "
     "4,912 tokens/s/GPU, 1,276 TFLOP/s/GPU; recipe: perf_recipes/deepseek/gb200/deepseek_v3.py "
     f"fp8mx ({MB} v0.6.0)", MB_2608),
    ("Megatron-Bridge 25.09, 1,024 H100, FP8 (TP2 PP8 VP4 EP64, MBS 1)", "h100", "deepseek3-671b-h100x1024.yml", 1024, 128,
     [*NO_PIPELINED_BIAS, "ici_tensor_parallelism=2", "ici_expert_parallelism=4", "dcn_expert_parallelism=16",
      "dcn_fsdp_parallelism=1", "dcn_data_parallelism=1", "dcn_pipeline_parallelism=8", "per_device_batch_size=8",
      "num_pipeline_microbatches=128", "pipeline_parallel_layers=56", "num_layers_per_pipeline_stage=1"],
     338.0, "TFLOP/s/GPU", f"{BRIDGE} (archive), 25.09: H100, 1,024 GPUs, dropless, GBS 8192, MBS 1, seq 4096, TP2 PP8 "
     "CP1 VP4 EP64 GA128: 1,297 tokens/s/GPU, 338 TFLOP/s/GPU (330 with 128x128/1x128 blockwise FP8); recipe: "
     f"scripts/performance/run_script.py ({MB} fa0315ae2)", MB_2509_H100),
]
PUBLISHED_EXCHANGE = ["te_moe_exchange=auto", "te_moe_chunks=1", "te_moe_ep_node_size=8"]
"""The expert exchange every published row is planned with (the presets' own, hier and chunks, are temoe's choices,
not the publishers'): one row a token and destination rank, unchunked, as the rows have been priced since they were
added."""
OTHER_LAYER = {"NVIDIA JAX + TE, 128 GB200": "its MoE layer is Transformer Engine's fused block (MaxText's te_moe_block "
                                             "with TE's transformer_engine.jax.moe.moe), not temoe's: no overlap inside "
                                             "the layer is priced"}
"""Published rows whose MoE layer is not temoe's (prefix of the row name -> why), priced without the overlap temoe's
layer allows (step_model.Job.layer_overlap)."""
PER_DEVICE_BATCH = {"NVIDIA JAX + TE, 128 GB200": 6, "Megatron-Core paper, 256 GB300": 16,
                    "Megatron-Core paper, 256 GB200": 16, "Megatron-Bridge 26.08, 256 GB300": 16,
                    "Megatron-Bridge 26.08, 256 GB200": 16, "Megatron-Bridge 25.09, 1,024 H100": 8}
"""Sequences per GPU and step of each published run (its global batch over its GPUs): temoe's best layout is swept at
the same global batch."""
H100_TARGET = (372.0, 0.10)
"""Issue 53's targets on 1,024 H100: temoe's best layout at >= 372 TFLOP/s/GPU predicted (1.1x Megatron-Bridge's
published 338), with the exposed expert exchange <= 10% of the step."""
TOKENS = {"Megatron-Bridge 26.08, 256 GB300": 6288.0, "Megatron-Bridge 26.08, 256 GB200": 4912.0,
          "Megatron-Bridge 25.09, 1,024 H100": 1297.0}
"""Published tokens/s/GPU of the rows that give one (prefix of the row name -> value)."""


def read(name: str) -> dict:
  return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def fitted_rows(data: dict, kernel: str) -> set[str]:
  """Configs (proxy paths) a prediction's fitted constants were fitted to."""
  f = data["fitted"]
  used = [f["dense_efficiency"], f["elementwise_efficiency"], f["optimizer_efficiency"]]
  used.append(f.get("attention_core_tflops", {}).get(kernel, {}))
  return {r for entry in used for r in entry.get("rows", [])}


def same_input_as_fitted(path: str, fitted: set[str], paths: dict) -> bool:
  """`path` has the config, overrides and depth of a path in `fitted`: on one GPU the step model reads
  neither the container profile nor the command-buffer list, so such a row (`*_env`, `*_graphs`) gets the
  fitted row's own prediction and is no check of it."""
  def key(p: str):
    name, _, depth = p.partition("@")
    return (paths[name][0], tuple(paths[name][1]), depth) if name in paths else None
  return key(path) is not None and any(key(path) == key(f) for f in fitted)


def proxy_job(path: str, measured_in: str, jobs: dict):
  """calibrate.proxy_job, planned once per distinct MaxText argument list (`jobs`: arguments -> job): the
  result files' runs of one path often had the same config, and the job is all the plan gives the model."""
  import calibrate  # pylint: disable=import-outside-toplevel
  import proxy_1gpu  # pylint: disable=import-outside-toplevel

  key = tuple(proxy_1gpu.args_of(path, measured_in=measured_in))
  if key not in jobs:
    jobs[key] = calibrate.proxy_job(path, measured_in)
  return jobs[key]


def one_gpu_rows() -> tuple[list[dict], list[dict]]:
  import proxy_1gpu  # pylint: disable=import-outside-toplevel

  from temoe.tools import calibration, step_model  # pylint: disable=import-outside-toplevel

  calib = calibration.calibration_for("h200")
  rows, excluded, jobs = [], [], {}
  for file in PROXY_FILES:
    for path, measured in read(file)["paths"].items():
      if (file, path) in EXCLUDED:
        excluded.append({"name": f"{file}:{path}", "why": EXCLUDED[(file, path)]})
        continue
      if "step_time_s" not in measured:
        excluded.append({"name": f"{file}:{path}", "why": f"no step time ({measured.get('error', 'not run')[:200]})"})
        continue
      job = proxy_job(path, file, jobs)
      extra = proxy_1gpu.PATHS[path.split("@")[0]][2]  # True: the container profile, what xla_flags_for adds anyway
      _, flags = step_model.xla_flags_for(calib.gpu, dict(extra) if isinstance(extra, dict) else {})
      p = step_model.predict(job, calib, flags)
      fitted = fitted_rows(calib.data, str(job.config.attention))
      fitted = path in fitted or same_input_as_fitted(path, fitted, proxy_1gpu.PATHS)
      rows.append({"name": f"{file}:{path}", "kind": "one_gpu", "fitted": fitted,
                   "predicted": p.step_seconds, "reference": measured["step_time_s"], "unit": "s/step",
                   "source": f"bench/results/{file} paths.{path}.step_time_s (H200); flags: bench/proxy_1gpu.py PATHS[{path!r}]"})
  rows += layer_rows(calib)
  rows += profile_rows(calib, jobs)
  excluded.append({"name": "moe_layer.json:qwen3_30b_a3b", "why": "the only class of its expert shape (2048x768): no "
                   "other class to predict it from"})
  return rows, excluded


def layer_rows(calib) -> list[dict]:
  """Each DeepSeek-V3-shaped MoE layer class predicted from the other one (32 experts top-8 vs 8 top-2)."""
  from temoe.tools import calibration, step_model  # pylint: disable=import-outside-toplevel

  rows = []
  for path, classes in calib.data["grouped_mlp"].items():
    for name, entry in classes.items():
      others = {n: c for n, c in classes.items() if n != name and (c["hidden"], c["expert_ffn"]) == (entry["hidden"], entry["expert_ffn"])}
      if not others:
        continue
      data = copy.deepcopy(calib.data)
      data["grouped_mlp"][path] = others
      without = calibration.Calibration(calib.gpu, calib.source, data, calib.path)
      predicted = step_model.layer_seconds(without, path, entry["hidden"], entry["expert_ffn"], entry["experts"],
                                           entry["tokens"], entry["top_k"])
      rows.append({"name": f"moe_layer.json:{name}:{path}", "kind": "one_gpu", "fitted": False, "predicted": predicted,
                   "reference": entry["layer_ms"] / 1e3, "unit": "s/layer (fwd+bwd)",
                   "source": f"bench/results/moe_layer.json shapes.{name}.{path}_fwdbwd_ms, predicted from class "
                             f"{', '.join(others)}"})
  return rows


def profile_rows(calib, jobs: dict) -> list[dict]:
  """The profiled step's stages that no profile-fitted constant prices: experts, dispatch + combine."""
  from temoe.tools import step_model  # pylint: disable=import-outside-toplevel

  profile = read("profile/temoe_fp8.json")
  step = read("proxy_1gpu.variants.json")["paths"]["temoe_fp8"]["step_time_s"]
  scale = step / (profile["step_ms"] / 1e3)
  _, flags = step_model.xla_flags_for(calib.gpu, {})
  job = proxy_job("temoe_fp8", "proxy_1gpu.variants.json", jobs)  # the profile's run: that file's config
  stages = {s.name: s.seconds for s in step_model.predict(job, calib, flags).stages}
  ms = profile["ms_per_step"]
  out = []
  for stage, categories in (("experts", ("experts",)), ("dispatch/combine", ("dispatch", "combine"))):
    out.append({"name": f"profile/temoe_fp8.json:{stage}", "kind": "one_gpu", "fitted": False, "predicted": stages[stage],
                "reference": sum(ms[c] for c in categories) / 1e3 * scale, "unit": "s/step (stage)",
                "source": f"bench/results/profile/temoe_fp8.json ms_per_step {'+'.join(categories)}, scaled to the "
                          "unprofiled step (proxy_1gpu.variants.json temoe_fp8)"})
  return out


def published_rows() -> list[dict]:
  from temoe.tools import calibration, plan, step_model  # pylint: disable=import-outside-toplevel

  rows, plans = [], {}
  for name, gpu, config, devices, slices, settings, reference, unit, source, megatron in PUBLISHED:
    settings = [*PUBLISHED_EXCHANGE, *settings]
    key = (gpu, config, devices, slices, tuple(settings))  # two rows of one run (a paper and its recipe) plan once
    if key not in plans:
      plans[key] = plan.make_plan(str(ROOT / "configs" / config), [f"num_slices={slices}", *settings], devices, gpu)
    p = plans[key]
    ici, dcn = plan.mesh_split(p.config, devices)
    other = next((why for k, why in OTHER_LAYER.items() if name.startswith(k)), "")
    job = dataclasses.replace(step_model.job_of(p.config, ici, dcn, slices, p.backend, p.quantization, p.estimate),
                              megatron=step_model.Megatron(**megatron) if megatron else None, layer_overlap=not other)
    calib = calibration.calibration_for(gpu)
    _, flags = step_model.xla_flags_for(calib.gpu, {})
    pred = step_model.predict(job, calib, flags)
    what = f"temoe plan configs/{config} --devices {devices} --slices {slices} --gpu {gpu} {' '.join(settings)}"
    rows.append({"name": name, "kind": "published", "fitted": False, "predicted": pred.tflops, "reference": reference,
                 "unit": unit, "source": f"{source}; predicted: {what}" + (f"; {other}" if other else "")})
    tokens = next((v for k, v in TOKENS.items() if name.startswith(k)), None)
    if tokens:
      rows.append({"name": f"{name}, tokens/s", "kind": "published", "fitted": False, "predicted": pred.tokens_per_s,
                   "reference": tokens, "unit": "tokens/s/GPU", "source": f"{source}; predicted: {what}"})
  return rows


MICROBATCHES = (1, 2, 4)
"""Sequences per GPU in one microbatch that the target rows sweep, as the 671B presets were derived (configs/)."""


def batch_choices(per_device: int) -> list[list[str]]:
  """A published run's batch (`per_device` sequences a GPU and step) in temoe's layouts: microbatches of 1, 2 or 4
  sequences that divide it, in gradient-accumulation steps (MaxText's per_device_batch_size is one microbatch's)."""
  return [[f"per_device_batch_size={micro}", f"gradient_accumulation_steps={per_device // micro}"]
          for micro in MICROBATCHES if per_device % micro == 0]


def target_rows(published: list[dict]) -> list[dict]:
  """temoe's best layout (`temoe plan --sweep` of the preset at the publisher's global batch in microbatches of 1, 2 or
  4 sequences, on the same GPUs) against the model's prediction for the publisher's own layout, per published run;
  and issue 53's H100 targets."""
  from temoe.tools import step_model, sweep  # pylint: disable=import-outside-toplevel

  predicted = {r["name"]: r["predicted"] for r in published if r["unit"] == "TFLOP/s/GPU"}
  swept, rows = {}, []
  for name, gpu, config, devices, slices, *_ in PUBLISHED:
    per_device = next(v for k, v in PER_DEVICE_BATCH.items() if name.startswith(k))
    choices = batch_choices(per_device)
    for settings in choices:
      key = (gpu, config, devices, slices, tuple(settings))
      if key not in swept:
        planned = sweep.run(str(ROOT / "configs" / config), [f"num_slices={slices}", *settings], devices, slices, gpu,
                            None, {}, progress=open(os.devnull, "w", encoding="utf-8"))
        swept[key] = sweep.ranked(planned)
    # the fastest of each batch's best layouts, by the sweep's own ranking (tokens/s/GPU: the global batch is the same)
    keys = [(gpu, config, devices, slices, tuple(settings)) for settings in choices]
    firsts = [swept[k][0] for k in keys if swept[k]]
    fastest = sweep.ranked(firsts)[0] if firsts else None
    key = next((k for k in keys if swept[k] and swept[k][0] is fastest), keys[0])
    settings = list(key[-1])
    what = (f"temoe plan configs/{config} --devices {devices} --slices {slices} --gpu {gpu} --sweep "
            f"{' '.join(settings)}")
    if len(choices) > 1:
      micro = ", ".join(c[0].split("=")[1] for c in choices)
      what += f" (the fastest of {len(choices)} sweeps: microbatches of {micro} sequences)"
    if not swept[key]:
      rows.append({"name": f"temoe's best layout vs the publisher's: {name}", "kind": "target", "fitted": False,
                   "predicted": 0.0, "reference": predicted[name], "unit": "TFLOP/s/GPU (both predicted)",
                   "source": f"{what}: no layout fits in the memory plan; reference: this file's published row",
                   "layout": None, "settings": settings})
      continue
    best = swept[key][0]
    p = best.prediction
    exposed = step_model.exchange_exposed(p) / p.step_seconds
    rows.append({"name": f"temoe's best layout vs the publisher's: {name}", "kind": "target", "fitted": False,
                 "predicted": p.tflops, "reference": predicted[name], "unit": "TFLOP/s/GPU (both predicted)",
                 "source": f"{what}: best {best.layout.describe()}; reference: this file's published row, the "
                           "publisher's own layout priced by the same model",
                 "layout": best.layout.describe(), "settings": [*settings, *best.layout.overrides()],
                 "step_s": p.step_seconds, "peak_gib": best.peak_gib, "exposed_exchange_share": exposed})
    if gpu == "h100" and devices == 1024:
      tflops, share = H100_TARGET
      within = next((r for r in swept[key] if step_model.exchange_exposed(r.prediction) / r.prediction.step_seconds
                     <= share), None)
      rows.append({"name": f"temoe's best layout on 1,024 H100 (target {tflops:g} TFLOP/s/GPU, exposed exchange <= "
                           f"{share:.0%})", "kind": "target", "fitted": False, "predicted": p.tflops,
                   "reference": tflops, "unit": "TFLOP/s/GPU (predicted vs target)",
                   "source": f"{what}: best {best.layout.describe()}, exposed exchange {exposed:.1%} of the step",
                   "layout": best.layout.describe(), "exposed_exchange_share": exposed,
                   "exposed_exchange_target": share,
                   "best_within_exchange_target": None if within is None else {
                       "layout": within.layout.describe(), "tflops_per_gpu": within.prediction.tflops,
                       "exposed_exchange_share": step_model.exchange_exposed(within.prediction)
                       / within.prediction.step_seconds, "peak_gib": within.peak_gib}})
  return rows


def one_rank_rows() -> list[dict]:
  """The step model's compute against each one-rank run (bench/one_rank.py: one rank of the job on the GPU it ran
  on, network mocked, full depth extrapolated): no constant is fitted to these runs, so each row is a check."""
  from temoe.tools import calibration, one_rank, planner, step_model  # pylint: disable=import-outside-toplevel

  if not one_rank.RESULTS.is_file():
    return []
  runs = {(r["config"], r["devices"], r["layout"]): r for r in read("one_rank.json")["runs"]}
  rows = []
  for m in one_rank.load():
    run = runs[(m.config, m.devices, m.layout)]
    settings = [f"num_slices={run['slices']}", *run["overrides"]]
    p = planner.make_plan(str(ROOT / m.config), settings, m.devices, m.gpu)
    ici, dcn = planner.mesh_split(p.config, m.devices)
    job = step_model.job_of(p.config, ici, dcn, run["slices"], p.backend, p.quantization, p.estimate)
    calib = calibration.calibration_for(m.gpu)
    pred = step_model.predict(job, calib, step_model.xla_flags_for(calib.gpu, {})[1])
    priced = one_rank.apply(pred, m)
    published = [(row[0], row[6]) for row in PUBLISHED if row[2] == pathlib.Path(m.config).name and row[3] == m.devices]
    rows.append({"name": f"one_rank.json:{m.config} {m.devices} GPUs {m.layout}: compute", "kind": "one_rank",
                 "fitted": False, "predicted": pred.compute, "reference": m.compute_ms() / 1e3,
                 "unit": "s/step (compute)", "source": f"bench/results/one_rank.json ({m.gpu}; {m.depth_note}): "
                 f"{m.command}; stages {', '.join(one_rank.COMPUTE_STAGES)}",
                 "with_measurement": {"gpu": m.gpu, "measured_compute_s": m.compute_ms() / 1e3,
                                      "network_exposed_s": sum(c.exposed for c in priced.collectives),
                                      "step_s": priced.step_seconds, "tflops_per_gpu": priced.tflops,
                                      "published": [{"name": n, "tflops_per_gpu": r} for n, r in published]}})
  return rows


def render_one_rank_table(result: dict) -> str:
  """The planning guide's table of the one-rank runs: measured per-rank compute, modelled network (the exposed time
  with the compiled schedule's overlap), the predicted step, and the published points of the same GPU count."""
  lines = ["| run | GPU measured | measured compute ms | modelled compute ms | network exposed ms | predicted step ms | "
           "TFLOP/s/GPU | published (TFLOP/s/GPU) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    if r["kind"] != "one_rank":
      continue
    w = r["with_measurement"]
    pub = "; ".join(f"{p['name']}: {p['tflops_per_gpu']:,.0f}" for p in w["published"]) or "none"
    lines.append(f"| {r['name'].removeprefix('one_rank.json:').removesuffix(': compute')} | {w['gpu']} | "
                 f"{w['measured_compute_s'] * 1e3:,.1f} | {r['predicted'] * 1e3:,.1f} | {w['network_exposed_s'] * 1e3:,.1f} | "
                 f"{w['step_s'] * 1e3:,.1f} | {w['tflops_per_gpu']:,.0f} | {pub} |")
  return "\n".join(lines)


def build(only: str | None = None, targets: bool = True) -> dict:
  rows, excluded = one_gpu_rows() if only in (None, "one_gpu") else ([], [])
  if only in (None, "one_rank"):
    rows += one_rank_rows()
  if only in (None, "published", "target"):
    published = published_rows()
    rows += published if only != "target" else []
    if only == "target" or (only is None and targets):
      rows += target_rows(published)
  for r in rows:
    r["ratio"] = r["predicted"] / r["reference"]
  return {"command": " ".join(["python", "bench/step_model_check.py", *sys.argv[1:]]), "calibration":
          "bench/results/calibration/h200.json (others scaled from it)", "rows": rows, "excluded": excluded}


def render_table(result: dict) -> str:
  """The planning guide's table of every checked point (tests/unit/test_step_model.py keeps the page equal to it)."""
  lines = ["| point | kind | fitted | predicted | reference | unit | predicted / reference |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    digits = 4 if r["reference"] < 10 else 0
    lines.append(f"| {r['name'].replace('|', '/')} | {r['kind']} | {'yes' if r['fitted'] else 'no'} | "
                 f"{r['predicted']:,.{digits}f} | {r['reference']:,.{digits}f} | {r['unit']} | {r['ratio']:.3f} |")
  return "\n".join(lines)


PAGE = ROOT / "docs" / "guides" / "planning.md"
"""The page that shows the table (docs/guides/planning.md, "How far off it was")."""
TABLE_BEGIN = "<!-- step_model_check.json: generated by `python bench/step_model_check.py --write-docs` -->"
TABLE_END = "<!-- end of step_model_check.json -->"


ONE_RANK_BEGIN = "<!-- one_rank rows of step_model_check.json: generated by `python bench/step_model_check.py --write-docs` -->"
ONE_RANK_END = "<!-- end of the one_rank rows -->"


def write_page(result: dict, page: pathlib.Path = PAGE) -> None:
  """Replaces the page's tables between their markers with `render_table(result)` and `render_one_rank_table`."""
  text = page.read_text(encoding="utf-8")
  for begin, end_marker, table in ((TABLE_BEGIN, TABLE_END, render_table(result)),
                                   (ONE_RANK_BEGIN, ONE_RANK_END, render_one_rank_table(result))):
    start, end = text.find(begin), text.find(end_marker)
    if start < 0 or end < start:
      raise SystemExit(f"{page} has no table between {begin!r} and {end_marker!r}")
    text = text[:start + len(begin)] + "\n" + table + "\n" + text[end:]
  page.write_text(text, encoding="utf-8")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(RESULTS / "step_model_check.json"))
  parser.add_argument("--only", choices=("one_gpu", "one_rank", "published", "target"))
  parser.add_argument("--write-docs", "--write-readme", dest="write_docs", action="store_true",
                      help="and rewrite the table of docs/guides/planning.md from the result")
  args = parser.parse_args()
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  result = build(args.only)
  for r in result["rows"]:
    print(f"{r['kind']:<9} {'fitted' if r['fitted'] else 'check ':<6} {r['ratio']:6.3f}  {r['predicted']:10.4g} vs "
          f"{r['reference']:10.4g} {r['unit']:<18} {r['name']}")
  pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
  if args.write_docs:
    write_page(result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
