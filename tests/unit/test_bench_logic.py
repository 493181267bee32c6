"""The benchmarks' own logic, on CPU without training: the proxy's marginal MoE decoder layer and
its path names, its remat variants against MaxText's policies, the small model's ratios and profile
difference, and their refusals of bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import HANG_S, ROOT, maxtext_config

sys.path.insert(0, str(ROOT / "bench"))
import proxy_1gpu  # noqa: E402  # pylint: disable=wrong-import-position
import small_model  # noqa: E402  # pylint: disable=wrong-import-position


def row(step_s: float, peak: float = 50.0) -> dict:
  return {"step_time_s": step_s, "tokens_per_s": 4096 / step_s, "peak_hbm_gib": peak}


def test_marginal_layer_is_the_step_difference_per_added_moe_layer():
  paths = {"temoe_fp8": row(0.140), "stock_best": row(0.210), "temoe_fp8@5": row(0.220, 80.0),
           "stock_best@5": row(0.350), "temoe_bf16_moe": row(0.150)}
  per_layer = proxy_1gpu.marginal(paths)
  assert set(per_layer) == {"temoe_fp8", "stock_best"}  # one depth only: no marginal
  assert per_layer["temoe_fp8"]["ms"] == pytest.approx(40.0)
  assert per_layer["temoe_fp8"]["fixed_ms"] == pytest.approx(140.0 - 2 * 40.0)  # 3 layers: 1 dense + 2 MoE
  assert per_layer["temoe_fp8"]["peak_hbm_gib_deepest"] == 80.0
  head = proxy_1gpu.headline(per_layer)
  assert head["temoe_ms"] == pytest.approx(40.0) and head["stock_best_ms"] == pytest.approx(70.0)
  assert head["ratio"] == pytest.approx(70.0 / 40.0) and head["layers"] == [3, 5]
  ratios = proxy_1gpu.ratios(paths)
  assert ratios["temoe_fp8@5_over_stock_best_tokens"] == pytest.approx(0.350 / 0.220)  # same depth
  assert proxy_1gpu.headline({"temoe_fp8": per_layer["temoe_fp8"]}) is None


def test_runs_are_each_path_at_each_depth_and_depths_reach_maxtext():
  assert proxy_1gpu.runs_of("temoe_fp8,stock_best", "3,5") == ["temoe_fp8", "stock_best", "temoe_fp8@5", "stock_best@5"]
  assert proxy_1gpu.runs_of("temoe_fp8,stock_best@5", "3") == ["temoe_fp8", "stock_best@5"]
  args = proxy_1gpu.args_of("temoe_fp8@5")
  assert args[-2:] == ["override_model_config=true", "base_num_decoder_layers=5"]
  assert "base_num_decoder_layers=5" not in proxy_1gpu.args_of("temoe_fp8")
  config = maxtext_config(*proxy_1gpu.args_of("temoe_fp8@5", smoke=True)[1:], "log_config=false",
                          config=proxy_1gpu.SHIPPED)
  assert config.num_decoder_layers == 5 and config.first_num_dense_layers == 1 and config.hardware == "cpu"


@pytest.mark.parametrize("bad, message", [("temoe_fp9", "valid choices: temoe_fp8"), ("temoe_fp8@x", "whole number")])
def test_a_bad_proxy_path_is_refused_naming_the_choices(bad, message):
  with pytest.raises(SystemExit, match=message):
    proxy_1gpu.runs_of(bad, "3,5")


def policy_of(*overrides: str):
  from temoe.tools import hbm_activations  # pylint: disable=import-outside-toplevel

  config = maxtext_config(*overrides, "log_config=false")
  return config, hbm_activations.remat_policy(config)


def test_path_environments_add_to_flag_lists_and_own_temoes_switches(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_a=1")
  monkeypatch.setenv("TEMOE_TOKENS_MLP", "current")  # the calling shell's: no path inherits it
  unfused, shipped, graphs = (proxy_1gpu.environment(p) for p in ("temoe_fp8_unfused", "temoe_fp8", "temoe_fp8_graphs"))
  assert unfused["TEMOE_TOKENS_MLP"] == "none" and "TEMOE_TOKENS_MLP" not in shipped
  assert graphs["XLA_FLAGS"].startswith("--xla_a=1 --xla_gpu_enable_command_buffer=") and unfused["XLA_FLAGS"] == "--xla_a=1"


def test_save_moe_is_minimal_with_context_plus_the_moe_gemm_outputs():
  """One setting off: the variant keeps what the shipped policy keeps, and the three MoE names."""
  from temoe.tools.hbm_activations import placement  # pylint: disable=import-outside-toplevel

  shipped_config, shipped = policy_of("remat_policy=minimal_with_context")
  variant_config, variant = policy_of(*proxy_1gpu.SAVE_MOE)
  names = [*proxy_1gpu.MINIMAL_WITH_CONTEXT, *proxy_1gpu.MOE_OUTPUTS, *proxy_1gpu.OTHER_NAMES, "decoder_layer_input"]
  for name in names:
    expected = "device" if name in proxy_1gpu.MOE_OUTPUTS else placement(shipped, name, shipped_config)
    assert placement(variant, name, variant_config) == expected, name
  all_config, save_all = policy_of(*proxy_1gpu.SAVE_ALL)
  assert all(placement(save_all, n, all_config) == "device" for n in names)


def test_minimal_with_context_saves_the_gate_half_and_down_output_but_not_the_up_half():
  """What the memory plan assumes of MaxText's policy and of the names temoe's expert MLP gives."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from temoe.moe.experts import parts  # pylint: disable=import-outside-toplevel
  from temoe.tools import hbm_activations  # pylint: disable=import-outside-toplevel

  def mlp(x, wi, wo):
    ctx = type("Ctx", (), {"activation": staticmethod(lambda a, b: jax.nn.silu(a) * b)})
    return parts.gated_mlp(ctx, x, wi, wo, (None, None, None), None, lambda a, w: a @ w)

  jaxpr = jax.make_jaxpr(mlp)(jnp.ones((8, 4)), jnp.ones((4, 6)), jnp.ones((3, 4))).jaxpr
  named = {}  # output var -> names along its chain of checkpoint_name
  for eqn in jaxpr.eqns:
    if "name" in eqn.params and eqn.primitive.name == "name":
      named[eqn.outvars[0]] = (*named.pop(eqn.invars[0], ()), eqn.params["name"])
  config, policy = policy_of("remat_policy=minimal_with_context")
  planned = [t.names for t in hbm_activations.layer_tensors(config, hbm_activations.Shapes(8, 1, 8, 4, 1, 1, 4), True,
                                                             8, "xla")[-6:-3]]
  assert sorted(named.values()) == sorted(planned) == [("mlpwi_0", "moe_mlpwi_0"), ("mlpwo", "moe_mlpwo"),
                                                       ("moe_mlpwi_1",)]
  where = {names: hbm_activations.kept(policy, hbm_activations.Tensor(names, 1), config) for names in planned}
  assert where == {("mlpwi_0", "moe_mlpwi_0"): "device", ("moe_mlpwi_1",): "remat", ("mlpwo", "moe_mlpwo"): "device"}


def test_small_model_ratios_and_profile_difference():
  paths = {"temoe_fp8": {"tokens_per_s": 300.0, "loss_mean_last_50": 2.02},
           "temoe_bf16": {"tokens_per_s": 250.0, "loss_mean_last_50": 2.0},
           "tokamax": {"tokens_per_s": 200.0, "loss_mean_last_50": 2.01}}
  ratios = small_model.ratios(paths)
  assert ratios == {"temoe_fp8_over_tokamax_tokens": 1.5, "temoe_bf16_over_tokamax_tokens": 1.25}
  assert paths["temoe_fp8"]["loss_ratio_to_temoe_bf16"] == pytest.approx(1.01)
  profiles = {"temoe_fp8": {"step_ms": 30.0, "ms_per_step": {"experts": 10.0, "other": 5.0}},
              "tokamax": {"step_ms": 40.0, "ms_per_step": {"experts": 22.0, "other": 4.0}}}
  diff = small_model.profile_difference(profiles)
  assert diff == {"of": "temoe_fp8 - tokamax", "step_ms": -10.0, "ms_per_step": {"experts": -12.0, "other": 1.0}}
  assert small_model.profile_difference({"tokamax": profiles["tokamax"], "temoe_fp8": {"error": "x"}}) is None


def test_small_model_config_is_the_issues_shape():
  import numpy as np  # pylint: disable=import-outside-toplevel

  config = maxtext_config("log_config=false", "hardware=cpu", "attention=dot_product", "te_gmm_quantization=te_no_quant",
                          config=small_model.CONFIG)
  assert (config.emb_dim, config.moe_mlp_dim, config.num_experts, config.num_experts_per_tok) == (1024, 512, 32, 8)
  assert (config.num_decoder_layers, config.first_num_dense_layers, config.max_target_length) == (4, 1, 256)
  dtypes = (np.dtype(config.dtype).name, np.dtype(config.weight_dtype).name)
  assert (config.per_device_batch_size, *dtypes) == (32, "bfloat16", "float32")


@pytest.mark.parametrize("args, message", [
    (["--paths", "temoe_fp9"], "valid choices: temoe_fp8, temoe_bf16, temoe_fp8_blockwise, tokamax"),
    (["--steps", "3"], "more than 3 warm-up steps"),
    (["steps"], "pass MaxText settings as key=value"),
])
def test_small_model_bad_input_is_one_line_before_anything_runs(args, message):
  done = subprocess.run([sys.executable, str(ROOT / "bench" / "small_model.py"), *args], capture_output=True, text=True,
                        timeout=HANG_S)
  assert done.returncode == 2 and message in done.stderr.splitlines()[-1], done.stderr


def test_kernel_times_host_mode_reads_the_host_threads_of_a_trace(tmp_path):
  """bench/kernel_times.py --host: a host-side annotation that sleeps 20 ms a step shows with its
  time per step on its thread (what a host-bound step is checked with), in milliseconds. The trace's clock is
  not Python's (a loaded CI host read 28.707 ms a step in the trace against 28.572 by perf_counter around
  the steps), so the order is checked on the trace's own clock (the nested sleep's annotation within the step's)
  and the unit against perf_counter within a factor of 2 (a wrong unit is a factor of 1,000)."""
  import time  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import kernel_times  # pylint: disable=import-outside-toplevel

  f = jax.jit(lambda x: jnp.sin(x) @ x)
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    start = time.perf_counter()
    for _ in range(3):
      with jax.profiler.TraceAnnotation("host_step_of_the_test"):
        f(x).block_until_ready()
        with jax.profiler.TraceAnnotation("host_sleep_of_the_test"):
          time.sleep(0.02)
    wall_ms = (time.perf_counter() - start) * 1e3 / 3
  (trace,) = tmp_path.rglob("*.xplane.pb")
  host = kernel_times.kernel_ms(str(trace), 3, host=True)
  (step,) = [v for k, v in host.items() if k.endswith("| host_step_of_the_test")]
  (sleep,) = [v for k, v in host.items() if k.endswith("| host_sleep_of_the_test")]
  assert step["launches_per_iter"] == 1 and sleep["launches_per_iter"] == 1, (step, sleep)
  assert sleep["ms_per_iter"] < step["ms_per_iter"], (step, sleep)
  assert wall_ms / 2 <= step["ms_per_iter"] <= 2 * wall_ms and 20.0 / 2 <= sleep["ms_per_iter"], (step, sleep, wall_ms)
  assert not any("host_step_of_the_test" in k for k in kernel_times.kernel_ms(str(trace), 3))  # not a GPU kernel


def test_runs_are_planned_with_temoes_switches_as_they_ran():
  """A run measured while current scaling took the buffer is planned that way; a path's own switch wins;
  a file measured since keeps this process's switches; the switch is restored after."""
  from temoe.moe.experts import mosaic_tokens  # pylint: disable=import-outside-toplevel

  now = mosaic_tokens.SCALINGS
  with proxy_1gpu.switches_as_measured("temoe_fp8@5", "bench/results/proxy_1gpu.variants.json"):
    assert mosaic_tokens.SCALINGS == {"blockwise"}
  with proxy_1gpu.switches_as_measured("temoe_fp8_unfused", "bench/results/proxy_1gpu.variants.json"):
    assert mosaic_tokens.SCALINGS == set()
  with proxy_1gpu.switches_as_measured("temoe_fp8", "bench/results/proxy_1gpu.json"):
    assert mosaic_tokens.SCALINGS == now
  assert mosaic_tokens.SCALINGS == now


def test_weight_quant_bench_checks_every_form_against_the_shipped_one(tmp_path, monkeypatch):
  """bench/weight_quant.py on CPU at a tiny shape (the Triton kernel in Pallas' interpreter): every amax and
  backward-cast form is bit-equal to the shipped one over stacked layers with an inf expert and a zero one,
  and a form that differs is reported as such, not as equal."""
  import json  # pylint: disable=import-outside-toplevel

  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import weight_quant  # pylint: disable=import-outside-toplevel

  from temoe.moe.experts import fp8_quant  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(fp8_quant, "INTERPRET", True)
  monkeypatch.setattr(weight_quant, "BLOCKS", weight_quant.BLOCKS[:2])
  monkeypatch.setitem(weight_quant.RECAST, "off_by_one_scale",
                      lambda w, s: fp8_quant.cast_experts(w, s * 1.5, fp8_quant.E4M3, impl="xla"))
  monkeypatch.setitem(weight_quant.AMAX, "half", lambda w: jnp.max(jnp.abs(w), axis=(1, 2)).astype(jnp.float32) / 2)
  refreshed = weight_quant.refreshed_copies

  def wrong_on_triton(w, impl):  # the Triton refresh quantizes one expert's weights times 1.5 (other scales)
    return refreshed(w if impl == "xla" else w.at[0, 1].multiply(1.5), impl)

  monkeypatch.setattr(weight_quant, "refreshed_copies", wrong_on_triton)
  monkeypatch.setattr(sys, "argv", ["weight_quant.py", "--out", str(tmp_path), "--shape", "6,128,128", "--layers", "3",
                                    "--iters", "1"])
  weight_quant.main()
  result = json.loads((tmp_path / "weight_quant.json").read_text())
  wrong = {"half", "off_by_one_scale"}
  for section in ("amax", "recast"):
    for name, r in result[section].items():
      assert r["bitwise_equal_shipped"] == (name not in wrong), (section, name)
      assert r["ms_per_layer"] > 0
  assert {"triton_64x128w4", "words", "bits", "two_stage"} <= set(result["recast"]) | set(result["amax"])
  assert set(result["forward"]) >= set(weight_quant.AMAX)
  kept = result["persistent"]  # the kept copies' refresh: XLA's copies the step's, the wrong Triton ones not
  assert kept["refresh_xla"]["bitwise_equal_forward_and_backward"] is True
  assert kept["refresh_triton"]["bitwise_equal_forward_and_backward"] is False
  assert kept["refresh_xla"]["differing_elements"] == {"scales": 0, "w_q": 0, "w_q_t": 0}
  wrong = kept["refresh_triton"]["differing_elements"]  # one expert of layer 0: its scale and some of its K x N
  assert wrong["scales"] == 1 and 0 < wrong["w_q"] <= 128 * 128 and 0 < wrong["w_q_t"] <= 128 * 128, wrong
  assert kept["saving_xla_ms_per_layer"] == pytest.approx(
      kept["today_ms_per_layer"] - kept["refresh_xla"]["ms_per_layer"] - kept["slices_ms_per_layer"])
  assert (tmp_path / "weight_quant.png").exists()


def test_weight_quant_bench_shipped_only_times_the_shipped_forms_and_kept_copies(tmp_path, monkeypatch):
  """--shipped-only: of each pass the shipped form alone, and the kept copies' section against it."""
  import json  # pylint: disable=import-outside-toplevel

  import weight_quant  # pylint: disable=import-outside-toplevel

  from temoe.moe.experts import fp8_quant  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(fp8_quant, "INTERPRET", True)
  monkeypatch.setattr(sys, "argv", ["weight_quant.py", "--out", str(tmp_path), "--shape", "4,128,128", "--layers", "2",
                                    "--iters", "1", "--shipped-only"])
  weight_quant.main()
  result = json.loads((tmp_path / "weight_quant.json").read_text())
  assert [list(result[p]) for p in ("amax", "recast", "forward")] == [["shipped"]] * 3
  kept = result["persistent"]
  assert kept["today_ms_per_layer"] == pytest.approx(result["forward"]["shipped"]["ms_per_layer"]
                                                     + result["recast"]["shipped"]["ms_per_layer"])
  assert all(kept[f"refresh_{i}"]["bitwise_equal_forward_and_backward"] for i in ("xla", "triton"))


def test_repeated_runs_keep_each_runs_median_and_each_rounds_ratio():
  fast, slow = row(0.200), row(0.260)
  kept = proxy_1gpu.median_row([slow, row(0.210), fast])
  assert kept["step_time_s"] == 0.210 and kept["step_time_s_rounds"] == [0.260, 0.210, 0.200]
  even = proxy_1gpu.median_row([slow, {"error": "timed out after 100s"}, fast])  # a failed round is left out
  assert even["step_time_s"] == pytest.approx(0.230) and even["tokens_per_s"] == pytest.approx((4096 / 0.2 + 4096 / 0.26) / 2)
  assert proxy_1gpu.median_row([{"error": "a"}, {"error": "b"}]) == {"error": "b"}
  assert "step_time_s_rounds" not in proxy_1gpu.median_row([fast])  # one round: its row as measured
  one = {"temoe_fp8": row(0.140), "stock_best": row(0.210), "temoe_fp8@5": row(0.220), "stock_best@5": row(0.350)}
  two = {**one, "temoe_fp8@5": row(0.200)}
  broken = {**one, "stock_best@5": {"error": "x"}}
  first, second, third = proxy_1gpu.per_round_ratios([one, two, broken])
  assert first == pytest.approx(70 / 40) and second == pytest.approx(70 / 30) and third is None
