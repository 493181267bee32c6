"""temoe.tools.flops: hand counts for the smoke and 671B shapes, MaxText's parameter tree, MaxText's figure."""

from __future__ import annotations

import types

import jax
import pytest

from conftest import maxtext_config
from temoe.tools import flops

DSV3 = ("model_name=deepseek3-671b", "override_model_config=true", "per_device_batch_size=1", "max_target_length=4096")


def test_smoke_hand_count():
  """configs/models/deepseek3-smoke.yml: emb 64, 4 heads, MLA ranks 32/16, head dims 16+8/16,
  1 dense layer (mlp 128) + 2 MoE layers (16 experts, top-4, 1 shared, expert mlp 32), vocab 256;
  batch 8 x 64 tokens."""
  mla = (64 * 32 + 32 * 4 * 24) + 64 * (16 + 8) + 16 * 4 * (16 + 16) + 4 * 16 * 64  # q_a+q_b, kv_a, kv_b, out
  moe = 64 * 16 + 3 * 64 * 32 + 4 * 3 * 64 * 32  # router, shared expert, top-4 routed experts
  active = 3 * mla + 3 * 64 * 128 + 2 * moe + 64 * 256  # + dense MLP, logits
  assert active == 142_848
  causal = 4 * (24 + 16) * (64 + 1)  # per token and layer: each query meets (i + 1) keys, T(T+1)/2
  n = flops.count(maxtext_config())
  assert n.tokens == 8 * 64 and n.active_matmul_params == active
  assert n.total == 8 * 64 * (6 * active + 3 * 3 * causal) == 486_752_256


def test_deepseek_v3_671b_hand_count():
  """MaxText's models/deepseek3-671b.yml (61 layers, 3 dense, 256 experts top-8), seq 4096."""
  mla = (7168 * 1536 + 1536 * 128 * 192) + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
  moe = 7168 * 256 + 3 * 7168 * 2048 + 8 * 3 * 7168 * 2048
  active = 61 * mla + 3 * 3 * 7168 * 18432 + 58 * moe + 7168 * 129280
  assert active == 36_624_596_992  # DeepSeek-V3's "37B activated" less the 0.9B embedding table
  n = flops.count(maxtext_config(*DSV3))
  assert n.active_matmul_params == active
  assert n.total == 4096 * (6 * active + 3 * 61 * 128 * 320 * 4097)  # 1025.87 TFLOP per device-step


@pytest.mark.parametrize(
    "overrides", [(), DSV3, (*DSV3, "mtp_num_layers=1")], ids=["smoke", "671b", "671b-mtp"]
)
def test_difference_from_maxtexts_figure_is_the_causal_diagonal_and_mtp(overrides):
  """Ours - MaxText's = (1) the diagonal MaxText's T^2/2 leaves out: 3 x heads x (qk + v dims) per
  token and attention layer; (2) per MTP module its 2*emb -> emb projection and its logits."""
  c = maxtext_config(*overrides)
  m, tokens = c.mtp_num_layers, c.per_device_batch_size * c.max_target_length
  diagonal = 3 * c.num_query_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
  mtp = 6 * (2 * c.emb_dim * c.emb_dim + c.emb_dim * c.vocab_size)
  predicted = tokens * (diagonal * (c.num_decoder_layers + m) + mtp * m)
  ours, theirs = flops.count(c).total, flops.maxtext_tflops(c) * 1e12
  assert ours - theirs == pytest.approx(predicted, rel=1e-6)
  assert predicted > 0 and (m == 0) == (abs(ours - theirs) / ours < 2e-3)


@pytest.mark.parametrize("overrides", [(), (*DSV3, "mtp_num_layers=1")], ids=["smoke", "671b-mtp"])
def test_active_parameters_equal_maxtexts_parameter_tree(overrides):
  """Every matmul kernel MaxText creates (shapes only, nothing allocated), routed experts scaled by
  top_k / num_experts, the embedding table left out (a gather), the shared head once more per MTP."""
  from maxtext.utils import maxtext_utils, model_creation_utils  # pylint: disable=import-outside-toplevel

  c = maxtext_config(*overrides)
  tree = maxtext_utils.get_abstract_param(model_creation_utils.from_config(c), c)["params"]
  active = 0.0
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if "scale" in keys or "token_embedder" in keys:
      continue
    routed = "MoeBlock_0" in keys and "gate" not in keys  # the routed experts' wi and wo
    active += leaf.size * (c.num_experts_per_tok / c.num_experts if routed else 1)
  active += c.emb_dim * c.vocab_size * c.mtp_num_layers
  assert flops.count(c).active_matmul_params == pytest.approx(active, rel=1e-12)


def test_peaks_and_the_flop_weighted_peak_of_a_mixed_step():
  assert flops.peak_for("NVIDIA H200") == ("H200", (989.4, 1978.9))
  assert flops.peak_for("NVIDIA GB200")[0] == "GB200" and flops.peak_for("NVIDIA B200")[0] == "B200"
  assert flops.peak_for("NVIDIA H100 PCIe") is None and flops.peak_for("cpu") is None
  peak = flops.PEAK_TFLOPS["H200"]
  assert flops.effective_peak(10.0, 0.0, peak) == pytest.approx(989.4)
  assert flops.effective_peak(10.0, 10.0, peak) == pytest.approx(1978.9)
  # half the FLOPs in FP8 at twice the rate: the ideal step takes 3/4 of the bf16-only time
  assert flops.effective_peak(10.0, 5.0, (1000.0, 2000.0)) == pytest.approx(1000.0 / 0.75)
  n = flops.count(maxtext_config(*DSV3))
  fp8 = types.SimpleNamespace(te_moe_block=True, te_gmm_quantization="te_fp8_current")
  bf16 = types.SimpleNamespace(te_moe_block=True, te_gmm_quantization="te_no_quant")
  assert flops.fp8_flops(fp8, n) == n.routed_experts and flops.fp8_flops(bf16, n) == 0.0
  dense = n.attention_proj + n.dense_mlp + n.shared_experts  # MaxText's TE FP8 for the dense layers
  both = types.SimpleNamespace(te_moe_block=True, te_gmm_quantization="te_no_quant", quantization="te_fp8_currentscaling")
  assert flops.fp8_flops(both, n) == dense > 0


def test_bad_config_files_are_one_line(tmp_path, capsys):
  bad = tmp_path / "bad.yml"
  bad.write_text("a: [1\n")
  assert flops.main([str(bad)]) == 2 and "is not valid YAML at line 2" in capsys.readouterr().err
  assert flops.main([str(tmp_path / "nothere.yml")]) == 2 and "does not exist" in capsys.readouterr().err
  assert flops.main([]) == 2 and "usage: python -m temoe.tools.flops" in capsys.readouterr().err
