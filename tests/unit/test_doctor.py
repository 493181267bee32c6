"""`temoe doctor`: on this CPU machine for real, and on stand-in GPU platforms for its GPU verdicts."""

from __future__ import annotations

import pytest

from conftest import run_temoe
from temoe.deploy import doctor
from temoe.deploy import env
from temoe.hardware import Platform

H200 = Platform("gpu", "NVIDIA H200", (9, 0), "2.20.2", None, (13, 4, 0))
B200 = Platform("gpu", "NVIDIA B200", (10, 0), "2.20.2", None, (13, 3, 0))
NCCL = (2, 28, 3)


def test_doctor_on_this_cpu_machine_says_no_gpu_cleanly():
  run = run_temoe("doctor", env={"JAX_PLATFORMS": "cpu"}, timeout=300)
  assert run.returncode == 1, run.stdout + run.stderr
  assert "  GPU       no GPU (cpu devices)" in run.stdout
  assert "problem: no GPU: this process sees cpu devices only; run on a GPU host" in run.stdout
  assert "  MaxText   0.2.5, with the seams temoe hooks" in run.stdout and "ready: no" in run.stdout
  assert "Traceback" not in run.stderr


@pytest.mark.parametrize("plat, arch", [(H200, "hopper"), (B200, "blackwell")])
def test_a_ready_gpu_with_the_profile_in_force_has_no_problem(plat, arch):
  report = doctor.diagnose(plat, env.environment(arch), None, NCCL)
  lines = dict(report.lines)
  assert report.problems == []
  assert (lines["arch"], lines["NCCL"]) == (arch, "2.28.3")
  assert lines["TE"] == "Transformer Engine 2.20.2, JAX extension loads"
  n = len(env.settings(arch))
  assert lines["profile"] == f"{arch}: {n} of {n} in force, 0 yours, 0 missing"
  mxfp8 = "te_gmm_quantization=te_mxfp8: te_mxfp8 needs Blackwell (sm_100+)."
  assert report.warnings == ([] if arch == "blackwell" else [mxfp8])


def test_old_cublas_is_a_warning_naming_the_version_te_needs():
  old = Platform("gpu", "NVIDIA H100", (9, 0), "2.20.2", None, (13, 1, 0))
  report = doctor.diagnose(old, env.environment("hopper"), None, NCCL)
  assert report.problems == [] and dict(report.lines)["recipes"] == "te_fp8_current"
  assert any("te_no_quant" in w and "cuBLAS >= 13.4" in w and "13.1.0" in w for w in report.warnings)


def test_broken_te_or_maxtext_seam_is_a_problem_that_says_what_to_do():
  broken = Platform("gpu", "NVIDIA H100", (9, 0), None, "ImportError: libcudnn.so.9: cannot open", (13, 4, 0))
  report = doctor.diagnose(broken, env.environment("hopper"), "MaxText 0.3.0 lacks the seams temoe hooks: X.", None)
  assert any("libcudnn.so.9" in p and "ghcr.io/nvidia/jax:maxtext" in p for p in report.problems)
  assert "MaxText 0.3.0 lacks the seams temoe hooks: X." in report.problems
  assert any(w.startswith("NCCL not found") for w in report.warnings)


def test_profile_drift_names_the_setting_and_the_fix():
  environ = env.environment("blackwell", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
  del environ["NVTE_FUSED_ATTN"]
  report = doctor.diagnose(B200, environ, None, NCCL)
  assert dict(report.lines)["profile"] == f"blackwell: {len(env.settings('blackwell')) - 2} of " \
                                          f"{len(env.settings('blackwell'))} in force, 1 yours, 1 missing"
  assert any(w.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 is yours; the profile's 16") for w in report.warnings)
  assert any("not set: NVTE_FUSED_ATTN" in w and "temoe env --arch blackwell" in w for w in report.warnings)


def test_main_exit_code_follows_the_problems(monkeypatch, capsys):
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel
  from temoe import hardware  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(hardware, "detect", lambda: B200)
  for name, value in env.environment("blackwell").items():
    monkeypatch.setenv(name, value)
  assert doctor.main([]) == 0 and "ready: yes" in capsys.readouterr().out
  monkeypatch.setattr(seams, "MAXTEXT_VERSION", "9.9.9")
  assert doctor.main([]) == 1 and "problem: temoe hooks MaxText 9.9.9 internals" in capsys.readouterr().out
