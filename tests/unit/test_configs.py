"""Every config in configs/ passes MaxText's own validation on the cluster it is written for.

Each check runs tests/config_check.py in a fresh process (forked from one that imported MaxText, before any JAX
backend; that one forked from the session's fork server: tests/scripts.py) that simulates the cluster's device count, lets temoe's recipe checks see the target GPU, validates
through MaxText's pyconfig, and lays MaxText's mesh over the cluster's GPUs (one slice per node, as XLA reports
GPUs): the mesh must hold exactly the cluster's GPUs. The 671B presets must hold DeepSeek-V3's 671B parameters with
37B active per token, counted from their shapes by temoe.tools.model_size, which must itself agree with
the parameter tree MaxText builds.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import yaml

import scripts
from conftest import ROOT, SMOKE, maxtext_config
from temoe.tools import model_size

CONFIGS = ROOT / "configs"
sys.path.insert(0, str(ROOT / "bench"))
import proxy_1gpu  # noqa: E402  # pylint: disable=wrong-import-position

MAXTEXT_CONFIGS = pathlib.Path(__import__("maxtext").__file__).parent / "configs"


def argv(config, *overrides: str, nodes: int = 1, gpus_per_node: int = 1, gpu: str | None = None,
         slices: int | None = None) -> list[str]:
  """tests/config_check.py's arguments for one check."""
  return [str(config), "--nodes", str(nodes), "--gpus-per-node", str(gpus_per_node), *(["--gpu", gpu] if gpu else []),
          *(["--slices", str(slices)] if slices else []), *overrides]


def mesh_of(result: dict) -> dict:
  assert "error" not in result, result["error"]
  return {axis: size for axis, size in result["mesh"].items() if size > 1}


PRESETS = [  # config, nodes, GPUs per node, GPU, slices the runtime reports, hardware, mesh
    ("deepseek3-671b-gb200x256.yml", 64, 4, "gb200", 64, "gpu_multiprocess", {"fsdp": 4, "expert": 64}),
    ("deepseek3-671b-gb200x256.yml", 64, 4, "gb200", 4, "gpu", {"fsdp": 4, "expert": 64}),  # NVL72 racks
    ("deepseek3-671b-h100x1024.yml", 128, 8, "h100", 128, "gpu_multiprocess", {"data": 2, "fsdp": 8, "expert": 64}),
    ("deepseek3-671b-h100x1024.yml", 128, 8, "h100", 128, "gpu", {"data": 2, "fsdp": 8, "expert": 64}),
    ("deepseek3-671b-h200x128.yml", 16, 8, "h200", 16, "gpu_multiprocess", {"fsdp": 2, "expert": 64}),
    ("deepseek3-671b-h200x128.yml", 16, 8, "h200", 16, "gpu", {"fsdp": 2, "expert": 64}),
]


CHECKS = {
    **{f"{name} {hardware}": argv(CONFIGS / name, f"hardware={hardware}", nodes=nodes, gpus_per_node=gpus, gpu=gpu,
                                  slices=slices) for name, nodes, gpus, gpu, slices, hardware, _ in PRESETS},
    "gb200 preset on h100": argv(CONFIGS / "deepseek3-671b-gb200x256.yml", nodes=64, gpus_per_node=4, gpu="h100"),
    "h100 preset on 64 GPUs": argv(CONFIGS / "deepseek3-671b-h100x1024.yml", nodes=8, gpus_per_node=8, gpu="h100"),
    "8-GPU proxy": argv(CONFIGS / "deepseek3-proxy-8gpu.yml", nodes=1, gpus_per_node=8, gpu="h100"),
    "1-GPU proxy": argv(CONFIGS / "deepseek3-proxy-1gpu.yml", gpu="h100"),
    "benchmark's proxy flags": argv(MAXTEXT_CONFIGS / "base.yml", *proxy_1gpu.PROXY, gpu="h100"),
    "cpu smoke": argv(SMOKE),
}
"""Every check of this file: name -> tests/config_check.py's arguments."""


@pytest.fixture(scope="module")
def checked() -> dict[str, dict]:
  """Each check's result, each from its own process (forked, before any JAX backend, from one that imported
  MaxText once: config_check.py --batch, itself forked from the session's fork server)."""
  names = list(CHECKS)
  done = scripts.run(ROOT / "tests" / "config_check.py", "--batch", stdin=json.dumps([CHECKS[n] for n in names]))
  results = {}
  for line in done.stdout.splitlines():
    if line.startswith("CONFIG_CHECK "):
      index, result = line.split(" ", 2)[1:]
      results[names[int(index)]] = json.loads(result)
  assert done.returncode == 0 and len(results) == len(names), done.stderr[-3000:]
  crashed = {n: r["crash"] for n, r in results.items() if "crash" in r}
  assert not crashed, crashed
  return results


@pytest.mark.parametrize("name,nodes,gpus,gpu,slices,hardware,mesh", PRESETS)
def test_671b_preset_fills_its_cluster_and_is_deepseek_v3(checked, name, nodes, gpus, gpu, slices, hardware, mesh):
  result = checked[f"{name} {hardware}"]
  assert mesh_of(result) == mesh
  assert result["mesh_devices"] == result["distinct_devices"] == result["num_target_devices"] == nodes * gpus
  assert result["global_batch"] == nodes * gpus * result["keys"]["per_device_batch_size"]
  assert result["total_params"] == pytest.approx(671e9, rel=0.01)
  assert result["active_params"] == pytest.approx(37e9, rel=0.03)
  assert result["keys"]["te_moe_block"] and result["keys"]["remat_policy"] == "custom"
  assert {"moe_mlpwi_0", "moe_mlpwi_1"} <= set(result["offloaded"])  # host-offload remat of the experts
  assert result["keys"]["te_gmm_quantization"] == {"gb200": "te_mxfp8", "h100": "te_fp8_current", "h200": "te_fp8_current"}[gpu]


def test_a_preset_on_the_wrong_gpu_or_cluster_is_rejected(checked):
  wrong_gpu = checked["gb200 preset on h100"]
  assert "te_mxfp8 needs Blackwell" in wrong_gpu["error"]
  too_few = checked["h100 preset on 64 GPUs"]
  assert too_few["error"].startswith("mesh:")  # DCN FSDP 16 cannot fit 8 nodes


def test_one_node_proxy_fills_8_gpus(checked):
  result = checked["8-GPU proxy"]
  assert mesh_of(result) == {"expert": 8}
  assert result["mesh_devices"] == result["distinct_devices"] == result["num_target_devices"] == 8
  assert result["keys"]["num_experts"] // 8 == 256 // 64  # experts per GPU as in the 671B presets


def test_1gpu_proxy_is_the_benchmarks_proxy(checked):
  """The benchmark trains the shipped config itself; its stock paths (MaxText's 671B shapes cut down
  by flags) describe the same model."""
  assert proxy_1gpu.PATHS["temoe_fp8"] == (str(CONFIGS / "deepseek3-proxy-1gpu.yml"), [], False)
  assert proxy_1gpu.PATHS["stock_best"][0] == proxy_1gpu.PATHS["temoe_fp8"][0]
  ours = checked["1-GPU proxy"]
  assert ours["mesh_devices"] == ours["num_target_devices"] == 1
  flags = proxy_1gpu.PROXY
  bench = checked["benchmark's proxy flags"]
  shape = ["emb_dim", "num_query_heads", "mlp_dim", "moe_mlp_dim", "num_decoder_layers", "first_num_dense_layers",
           "num_experts", "num_experts_per_tok", "shared_experts", "q_lora_rank", "kv_lora_rank", "vocab_size"]
  keys = [f.split("=")[0] for f in flags if f.split("=")[0] not in ("model_name", "override_model_config",
                                                                     "base_num_decoder_layers", "remat_policy")]
  differ = {k: (ours["keys"].get(k), bench["keys"].get(k)) for k in shape + keys if ours["keys"].get(k) != bench["keys"].get(k)}
  assert not differ
  assert ours["total_params"] == bench["total_params"]


def test_cpu_smoke_config_validates_on_one_cpu_device(checked):
  result = checked["cpu smoke"]
  assert mesh_of(result) == {} and result["mesh_devices"] == result["num_target_devices"] == 1
  assert result["keys"]["te_moe_block"] and result["keys"]["hardware"] == "cpu"


def test_proxy_shape_is_maxtexts_deepseek_v3_but_depth_and_experts():
  ours = yaml.safe_load((CONFIGS / "models" / "deepseek3-proxy.yml").read_text())
  maxtext = yaml.safe_load((MAXTEXT_CONFIGS / "models" / "deepseek3-671b.yml").read_text())
  cut = {"base_num_decoder_layers", "first_num_dense_layers", "num_experts"}
  assert ours.keys() == maxtext.keys()
  assert {k: v for k, v in ours.items() if k not in cut} == {k: v for k, v in maxtext.items() if k not in cut}


@pytest.mark.parametrize("model", ["deepseek3-smoke", "deepseek3-671b", "deepseek3-proxy"])
def test_parameter_count_equals_maxtexts_parameter_tree(model):
  from maxtext.utils import max_utils, maxtext_utils, model_creation_utils  # pylint: disable=import-outside-toplevel

  overrides = [] if model == "deepseek3-smoke" else [f"model_name={model}", "override_model_config=true"]
  config = maxtext_config(*overrides)
  abstract = maxtext_utils.get_abstract_param(model_creation_utils.from_config(config), config)  # shapes only
  assert model_size.count(config).total == max_utils.calculate_num_params_from_pytree(abstract["params"])
