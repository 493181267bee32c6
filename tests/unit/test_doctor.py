"""`temoe doctor`: on this CPU machine for real, and on stand-in GPU platforms for its GPU verdicts."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
from conftest import run_temoe
from temoe.deploy import doctor, env, stack
from temoe.hardware import Platform

H200 = Platform("gpu", "NVIDIA H200", (9, 0), "2.20.2", None, (13, 4, 0))
B200 = Platform("gpu", "NVIDIA B200", (10, 0), "2.20.2", None, (13, 3, 0))
NCCL = (2, 28, 3)


def test_doctor_on_this_cpu_machine_says_no_gpu_cleanly(capsys):
  """`temoe doctor`'s main in this process (JAX on CPU, the venv's real MaxText): the CLI runs the same."""
  code = doctor.main([])
  out, err = capsys.readouterr()
  assert code == 1, out + err
  assert "  GPU       no GPU (cpu devices)" in out
  assert "problem: no GPU: this process sees cpu devices only; run on a GPU host" in out
  assert "  MaxText   0.2.5, with every seam and touchpoint temoe uses" in out and "ready: no" in out
  assert "Traceback" not in err


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
  blockwise = ("te_gmm_quantization=te_fp8_blockwise: temoe's Mosaic GPU kernels use Hopper's wgmma (sm_90); "
               "te_fp8_blockwise runs on Hopper only.")
  assert report.warnings == ([blockwise] if arch == "blackwell" else [mxfp8])
  expected = {"hopper": "te_no_quant (mosaic), te_fp8_current (mosaic), te_fp8_blockwise (mosaic)",
              "blackwell": "te_no_quant (te), te_fp8_current (te), te_mxfp8 (te)"}
  assert lines["recipes"] == expected[arch]


def test_old_cublas_is_a_warning_naming_the_version_te_needs():
  old = Platform("gpu", "NVIDIA H100", (9, 0), "2.20.2", None, (13, 1, 0))
  report = doctor.diagnose(old, env.environment("hopper"), None, NCCL)
  # bf16 runs on temoe's sync-free kernels there; TE's own bf16 grouped GEMM would not
  assert report.problems == [] and dict(report.lines)["recipes"] == \
      "te_no_quant (mosaic), te_fp8_current (mosaic), te_fp8_blockwise (mosaic)"
  assert any("te_no_quant with te_moe_backend=te" in w and "cuBLAS >= 13.4" in w and "13.1.0" in w
             for w in report.warnings)


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
  from temoe import hardware  # pylint: disable=import-outside-toplevel
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(hardware, "detect", lambda: B200)
  for name, value in env.environment("blackwell").items():
    monkeypatch.setenv(name, value)
  assert doctor.main([]) == 0 and "ready: yes" in capsys.readouterr().out
  monkeypatch.setattr(seams, "MAXTEXT_VERSION", "9.9.9")
  assert doctor.main([]) == 1 and "problem: temoe hooks MaxText 9.9.9 internals" in capsys.readouterr().out


# `temoe doctor --image`: the build-time check of the stack, here on the CPU venv's real MaxText and on
# deliberately wrong stacks made of stub packages put first on PYTHONPATH.

TE_NAMES = {  # what MaxText 0.2.5 and temoe import from Transformer Engine (module -> names defined there)
    "transformer_engine.common.recipe": [],
    "transformer_engine.jax": [],
    "transformer_engine.jax.attention": ["ReorderStrategy", "SequenceDescriptor", "reorder_causal_load_balancing"],
    "transformer_engine.jax.cpp_extensions": [],
    "transformer_engine.jax.dense": ["grouped_dense"],
    "transformer_engine.jax.ep": ["ep_bootstrap"],
    "transformer_engine.jax.flax.transformer": ["DotProductAttention"],
    "transformer_engine.jax.moe": ["moe", "get_moe_recv_capacity_per_rank", "record_ep_bootstrap_signature_for_moe"],
    "transformer_engine.jax.quantize.quantizer": ["QuantizerFactory", "QuantizerSet", "ScalingMode", "noop_quantizer_set"],
    "transformer_engine.jax.sharding": ["MeshResource", "global_shard_guard"],
}
PACKAGES = {"transformer_engine", "transformer_engine.common", "transformer_engine.common.recipe", "transformer_engine.jax",
            "transformer_engine.jax.cpp_extensions", "transformer_engine.jax.flax", "transformer_engine.jax.quantize"}
TE_FIX = "--build-arg TE_VERSION=2.20.2 (installs TE 2.20.2, its JAX extension built against this JAX)."


def dist_info(root: pathlib.Path, name: str, version: str) -> None:
  info = root / f"{name}-{version}.dist-info"
  info.mkdir()
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


STUB_LOADER = """
import importlib.util, pathlib


def _get_shared_object_file(library):
  top = pathlib.Path(importlib.util.find_spec("transformer_engine").origin).parent.parent
  for where in (top, top / "transformer_engine", top / "transformer_engine" / "wheel_lib"):
    found = sorted(where.glob(f"transformer_engine_{library}*.so")) if where.is_dir() else []
    if found:
      return found[0]
  raise FileNotFoundError(f"Could not find shared object file for Transformer Engine {library} lib.")
"""
"""TE 2.20.2's loader as its docstring describes it (transformer_engine/common/__init__.py): the framework
extension is the one shared object named transformer_engine_<library>* in the top directory (an editable
build), the package (a source build) or transformer_engine/wheel_lib/ (PyPI), else FileNotFoundError."""

EXTENSION_AT = {"pypi": "transformer_engine/wheel_lib", "editable": ".", "source": "transformer_engine"}


def stub_te(root: pathlib.Path, version: str = "2.20.2", drop: str = "", parts: dict | None = None,
            jax_init: str = "", layout: str = "pypi") -> pathlib.Path:
  """A Transformer Engine made of stubs: every module and name of TE_NAMES except `drop`; the
  quantize names behind a `from .quantizer import *`, as TE writes it; TE's loader, and the JAX extension
  (an empty file) where `layout` puts it when transformer_engine_jax is among the parts."""
  for module in sorted(PACKAGES | set(TE_NAMES)):
    path = root.joinpath(*module.split("."))
    path = path / "__init__.py" if module in PACKAGES else path.with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [n for n in TE_NAMES.get(module, []) if f"{module}.{n}" != drop]
    path.write_text("".join(f"def {n}(*args, **kwargs):\n  pass\n" for n in names))
  (root / "transformer_engine/jax/quantize/__init__.py").write_text("from .quantizer import *  # noqa\n")
  (root / "transformer_engine/jax/__init__.py").write_text(jax_init)
  (root / "transformer_engine/common/__init__.py").write_text(STUB_LOADER)
  dist_info(root, "transformer_engine", version)
  for name, v in (parts or {"transformer_engine_jax": version, "transformer_engine_cu13": version}).items():
    dist_info(root, name, v)
    if name == "transformer_engine_jax":
      where = root / EXTENSION_AT[layout]
      where.mkdir(parents=True, exist_ok=True)
      (where / "transformer_engine_jax.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
  return root


def image_check(*args, pythonpath=None):
  run = run_temoe("doctor", "--image", *args, env={"PYTHONPATH": str(pythonpath)} if pythonpath else None, timeout=300)
  problems = [line for line in run.stdout.splitlines() if line.startswith("temoe doctor --image: ")]
  assert "Traceback" not in run.stdout + run.stderr, run.stderr[-3000:]
  return run, problems


def test_image_check_passes_on_this_cpu_venv():
  run, problems = image_check("--without-te")
  assert (run.returncode, problems) == (0, []), run.stdout
  assert "  MaxText      0.2.5, " in run.stdout and "(wheel), base.yml as released" in run.stdout
  assert "  seams        " in run.stdout and run.stdout.rstrip().endswith("stack: fits")
  assert "inherit MaxText's base.yml" in dict(l.split(None, 1) for l in run.stdout.splitlines() if l.startswith("  "))["configs"]


def test_a_base_yml_beside_temoes_configs_is_caught(tmp_path):
  maxtext_configs = SITE_MAXTEXT.parent / "configs"
  configs = tmp_path / "configs"
  (configs / "offload").mkdir(parents=True)
  (configs / "offload/preset.yml").write_text('base_config: "base.yml"\n')
  (configs / "run.yml").write_text('base_config: "offload/preset.yml"\n')
  result = stack.Result()
  stack.check_configs(result, configs, maxtext_configs)
  assert (result.problems, result.lines) == ([], [("configs", f"2 in {configs} inherit MaxText's base.yml")])
  (configs / "offload/base.yml").write_text("steps: 1\n")  # MaxText's loader looks beside the config first
  stack.check_configs(result, configs, maxtext_configs)
  assert result.problems == [f"{configs / 'offload/preset.yml'} inherits {configs / 'offload/base.yml'}, not MaxText's "
                             f"own {maxtext_configs / 'base.yml'}: a base.yml beside temoe's configs, or a "
                             "base_config path, shadows it."]


SITE_MAXTEXT = pathlib.Path(importlib.util.find_spec("maxtext").origin)


@pytest.mark.parametrize("stack_kind", ["maxtext-0.3.0", "maxtext-checkout"])
def test_a_wrong_stack_fails_the_check_with_one_line_and_the_build_arg(stack_kind, tmp_path):
  """The console script on a wrong MaxText (the TE verdicts, the base's TE main among them, are check_te's in
  test_te_checks: MaxText imports Transformer Engine only inside a function, so the seams' verdict does not depend
  on which TE is on the path)."""
  if stack_kind == "maxtext-0.3.0":  # what `pip install maxtext==0.2.5` over another version would leave, undone
    (tmp_path / "maxtext").mkdir()
    (tmp_path / "maxtext/__init__.py").write_text("")
    dist_info(tmp_path, "maxtext", "0.3.0")
    path = tmp_path
    want = "maxtext 0.3.0 is installed, temoe hooks MaxText 0.2.5: --build-arg MAXTEXT_VERSION=0.2.5."
  else:  # the base's editable MaxText main, first on the path, metadata reading 0.2.5
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'maxtext'\n")
    (tmp_path / "src/maxtext").mkdir(parents=True)
    (tmp_path / "src/maxtext/__init__.py").write_text("")
    path = tmp_path / "src"
    want = (f"`import maxtext` loads {tmp_path}/src/maxtext/__init__.py, a source checkout, not the maxtext 0.2.5 "
            f"wheel's {SITE_MAXTEXT}: --build-arg MAXTEXT_SRC={tmp_path} (the Dockerfile uninstalls and removes "
            "that checkout).")
  run, problems = image_check("--without-te", pythonpath=path)
  assert (run.returncode, problems) == (1, [f"temoe doctor --image: {want}"]), run.stdout
  assert run.stdout.rstrip().endswith("stack: does not fit, see above")


@pytest.fixture
def on_path(monkeypatch, tmp_path):
  """Puts a stub stack first on this process's path and its children's (the import check's)."""
  def put(root: pathlib.Path) -> pathlib.Path:
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    return root
  monkeypatch.delenv("CUDA_VERSION", raising=False)
  put.tmp = tmp_path
  return put


@pytest.mark.parametrize("kind, problem, line", [
    ("te-2.20.2", None, "2.20.2, defines the "),  # from PyPI: the extension in transformer_engine/wheel_lib/
    ("te-editable-build", None, "2.20.2, defines the "),
    ("te-source-build", None, "2.20.2, defines the "),
    ("base-te-newer", None, "2.21.0.dev0; temoe is tested against 2.20.2, defines the "),
    ("mixed-parts", ("Transformer Engine's parts disagree: transformer_engine 2.20.2, transformer_engine_jax "
                    f"2.20.0.dev0: {TE_FIX}"), None),
    ("cu12-core-on-cuda-13", ("transformer_engine_cu12 2.20.2 is installed but this image's CUDA is 13.4.0: "
                             "--build-arg TE_CUDA_MAJOR=13."), None),
    ("no-jax-extension", f"Transformer Engine 2.20.2 has no JAX extension (transformer_engine_jax): {TE_FIX}", None),
    ("extension-does-not-load", ("transformer_engine.jax does not import (ImportError: libcudnn.so.9: cannot open "
                                f"shared object file): {TE_FIX}"), None),
    ("no-driver-on-the-build-host", None, "2.20.2, defines the "),
    ("no-te", f"Transformer Engine is not installed: {TE_FIX}", None),
    # the base's TE main of August: MaxText 0.2.5's max_utils imports a name it lacks
    ("te-main", ("Transformer Engine 2.20.0.dev0 lacks what MaxText 0.2.5 and temoe import: "
                 f"transformer_engine.jax.moe.get_moe_recv_capacity_per_rank (MaxText utils/max_utils.py): {TE_FIX}"),
     None),
])
def test_te_checks(kind, problem, line, on_path, monkeypatch):
  tmp = on_path.tmp
  if kind == "base-te-newer":
    on_path(stub_te(tmp, version="2.21.0.dev0"))
  elif kind == "mixed-parts":
    on_path(stub_te(tmp, parts={"transformer_engine_jax": "2.20.0.dev0", "transformer_engine_cu13": "2.20.2"}))
  elif kind == "cu12-core-on-cuda-13":
    on_path(stub_te(tmp, parts={"transformer_engine_jax": "2.20.2", "transformer_engine_cu12": "2.20.2"}))
    monkeypatch.setenv("CUDA_VERSION", "13.4.0")
  elif kind == "no-jax-extension":
    on_path(stub_te(tmp, parts={"transformer_engine_cu13": "2.20.2"}))
  elif kind == "extension-does-not-load":
    on_path(stub_te(tmp, jax_init="raise ImportError('libcudnn.so.9: cannot open shared object file')\n"))
  elif kind == "no-driver-on-the-build-host":
    on_path(stub_te(tmp, jax_init="raise OSError('libcuda.so.1: cannot open shared object file')\n"))
  elif kind in ("te-editable-build", "te-source-build"):
    on_path(stub_te(tmp, layout=kind.split("-")[1]))
  elif kind == "te-main":
    on_path(stub_te(tmp, version="2.20.0.dev0", drop="transformer_engine.jax.moe.get_moe_recv_capacity_per_rank"))
  elif kind != "no-te":
    on_path(stub_te(tmp))
  result = stack.Result()
  stack.check_te(result, SITE_MAXTEXT.parent)
  assert result.problems == ([problem] if problem else [])
  if line:
    assert dict(result.lines)["TE"].startswith(line)
    assert ("loads only with the NVIDIA driver" in " ".join(result.notes)) == (kind == "no-driver-on-the-build-host")


def test_te_names_are_read_from_the_maxtext_and_temoe_sources():
  wanted = stack.te_imports(SITE_MAXTEXT.parent)
  assert wanted[("transformer_engine.jax.moe", "get_moe_recv_capacity_per_rank")] == ["utils/max_utils.py"]
  import temoe  # pylint: disable=import-outside-toplevel

  ours = stack.te_imports(pathlib.Path(temoe.__file__).parent)
  assert ("transformer_engine.jax.dense", "grouped_dense") in ours
  found = {(m, n) for m, n in {**wanted, **ours} if m != "transformer_engine_jax"}
  stubbed = {(m.removesuffix(".quantizer"), n) for m, names in TE_NAMES.items() for n in names}
  assert {k for k in found if k[1] is not None and k[1] not in ("moe", "recipe")} <= stubbed
