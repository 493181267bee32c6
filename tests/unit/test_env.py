"""The environment profile (`temoe.deploy.env`, `temoe env`) and the host-offload presets under configs/offload/.

The XLA flags are checked against the installed jaxlib itself: a fresh process starts JAX with each
profile's whole XLA_FLAGS (plus a dump of its compile options) and every flag must come out of
jaxlib's parser with the profile's value. XLA flags are global, so the CPU jaxlib parses the GPU
ones too: a bogus GPU flag, or a GPU flag with a bogus value, aborts it (the negative controls).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import types

import pytest
import yaml
from conftest import HANG_S, ROOT, maxtext_config
from temoe.deploy import env

PRESETS = sorted((ROOT / "configs" / "offload").glob("*.yml"))


def start_jax(xla_flags: str, dump: pathlib.Path) -> subprocess.CompletedProcess:
  """A fresh CPU JAX process with XLA_FLAGS that compiles one function, dumping its compile options."""
  code = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"
  flags = f"{xla_flags} --xla_dump_to={dump}"
  return subprocess.run([sys.executable, "-c", code], env={"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PATH": ""},
                        capture_output=True, text=True, timeout=HANG_S, check=False)


def parsed_options(dump: pathlib.Path) -> dict[str, list[str]]:
  """DebugOptions field -> values, from the compile_options.textproto jaxlib dumped."""
  options: dict[str, list[str]] = {}
  for line in next(dump.glob("*/compile_options.textproto")).read_text().splitlines():
    key, sep, value = line.strip().partition(": ")
    if sep and key.startswith("xla_"):
      options.setdefault(key, []).append(value.strip('"'))
  return options


@pytest.mark.parametrize("arch", env.ARCHS)
def test_jaxlib_parses_every_profile_flag_into_its_value(arch, tmp_path):
  xla_flags = env.environment(arch)["XLA_FLAGS"]
  run = start_jax(xla_flags, tmp_path)
  assert run.returncode == 0, run.stderr[-2000:]
  options = parsed_options(tmp_path)
  for s in env.settings(arch):
    if s.is_xla_flag:  # enums print as e.g. COLLECTIVE_PIPELINING_MODE_ON, lists as one line per item
      got = options.get(s.name)
      want = s.value.upper().split(",")
      assert got and len(got) == len(want), f"--{s.name} did not reach DebugOptions: {got}"
      assert all(any(g.upper().endswith(w) for g in got) for w in want), f"--{s.name}={s.value} parsed as {got}"


@pytest.mark.parametrize("bad, says", [
    ("--xla_gpu_temoe_no_such_flag=true", "Unknown flag in XLA_FLAGS: --xla_gpu_temoe_no_such_flag"),
    ("--xla_gpu_enable_command_buffer=FUSION,BOGUS", "Illegal value for --xla_gpu_enable_command_buffer 'BOGUS'"),
])
def test_jaxlib_aborts_on_an_unknown_gpu_flag_or_value(bad, says, tmp_path):
  run = start_jax(f"{env.environment('hopper')['XLA_FLAGS']} {bad}", tmp_path)
  assert run.returncode != 0 and says in run.stderr


def test_profile_has_each_setting_once_per_arch_with_a_reason():
  for arch in env.ARCHS:
    names = [s.name for s in env.settings(arch)]
    assert len(names) == len(set(names)), names
  assert all(s.reason and set(s.archs) <= set(env.ARCHS) for s in env.PROFILE)
  by_arch = {arch: {s.name: s.value for s in env.settings(arch)} for arch in env.ARCHS}
  assert by_arch["hopper"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" != by_arch["blackwell"]["CUDA_DEVICE_MAX_CONNECTIONS"]
  assert "CUDA_DEVICE_MAX_CONNECTIONS" not in {s.name for s in env.settings(None)}


@pytest.fixture
def clean_env(monkeypatch):
  """No profile variable set by the caller's environment, no nvidia-smi: what a bare host has."""
  for s in env.PROFILE:
    monkeypatch.delenv(s.name, raising=False)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setenv("PATH", "/nonexistent")
  return monkeypatch


def temoe_env(capsys, *args: str) -> str:
  assert env.main(list(args)) == 0
  return capsys.readouterr().out


@pytest.mark.parametrize("explain", [False, True])
@pytest.mark.parametrize("arch", env.ARCHS)
def test_every_format_carries_the_same_environment(clean_env, capsys, arch, explain):
  del clean_env
  want = env.environment(arch)
  extra = ["--explain"] if explain else []
  shell = temoe_env(capsys, "--arch", arch, "--format", "shell", *extra)
  dump = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {list(want)!r}}}))"
  evaluated = subprocess.run(["bash", "-c", f'{shell}\n"{sys.executable}" -c "$0"', dump], env={},
                             capture_output=True, text=True, check=True).stdout
  assert json.loads(evaluated) == want
  lines = temoe_env(capsys, "--arch", arch, "--format", "docker-env", *extra).splitlines()
  assert dict(line.split("=", 1) for line in lines if not line.startswith("#")) == want  # docker --env-file syntax
  doc = json.loads(temoe_env(capsys, "--arch", arch, "--format", "json", *extra))
  assert (doc["arch"], doc["env"]) == (arch, want)
  if explain:
    assert all(s.reason in shell for s in env.settings(arch))
    assert {s["name"] for s in doc["settings"]} == {s.name for s in env.settings(arch)}


def test_what_the_user_set_wins(clean_env, capsys):
  clean_env.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  user_flags = "--xla_gpu_all_gather_combine_threshold_bytes=1 --xla_gpu_enable_pipelined_all_gather=false"
  clean_env.setenv("XLA_FLAGS", user_flags)
  got = json.loads(temoe_env(capsys, "--arch", "hopper", "--format", "json", "--explain"))
  assert got["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
  flags = got["env"]["XLA_FLAGS"]
  assert flags.startswith(user_flags + " ")
  assert "xla_gpu_pipeline_all_gather" not in flags  # the older spelling of the same option is the user's
  assert flags.count("combine_threshold_bytes") == 3 and "--xla_gpu_pipeline_reduce_scatter=on" in flags
  in_force = {s["name"]: s["in_force"] for s in got["settings"]}
  assert in_force["xla_gpu_pipeline_all_gather"] == "false" and in_force["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_auto_arch_reads_nvidia_smi(clean_env, capsys, tmp_path):
  assert env.main(["--format", "json"]) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)["env"] == env.environment(None)
  assert "no Hopper or Blackwell GPU found (no nvidia-smi on PATH)" in err
  (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 10.0\n")
  (tmp_path / "nvidia-smi").chmod(0o755)
  clean_env.setenv("PATH", str(tmp_path))
  assert json.loads(temoe_env(capsys, "--format", "json"))["env"] == env.environment("blackwell")


# Host offload: MaxText 0.2.5's remat_policy=custom, built by MaxText's own decoder code.


def offloaded_by(policy, names: list[str]) -> set[str]:
  """Names whose tagged values JAX moves to host memory under `policy` when differentiating."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.ad_checkpoint import checkpoint_name  # pylint: disable=import-outside-toplevel

  def f(x):
    return sum(jnp.sum(jnp.tanh(y) * y) for y in (checkpoint_name(jnp.sin(x + i), n) for i, n in enumerate(names)))

  jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy)))(jnp.ones(4)).jaxpr
  tagged = {eqn.outvars[0]: eqn.params["name"] for eqn in jaxpr.eqns if eqn.primitive.name == "name"}
  return {tagged[v] for eqn in jaxpr.eqns if eqn.primitive.name == "device_put" and "Host" in str(eqn.params["devices"])
          for v in eqn.invars if v in tagged}


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_offload_preset_resolves_to_a_pinned_host_policy(preset, tmp_path):
  from maxtext.layers import nnx_decoders  # pylint: disable=import-outside-toplevel

  keys = yaml.safe_load(preset.read_text())
  offload = {k for k, v in keys.items() if v == "offload"}
  user = tmp_path / "run.yml"  # a user's config inheriting the preset, as the preset's comment says
  user.write_text(f"base_config: {str(preset)!r}\nper_device_batch_size: 2\n")
  cfg = maxtext_config(config=str(user), tmp=str(tmp_path))
  assert (cfg.remat_policy, cfg.per_device_batch_size, set(cfg.tensors_to_offload)) == ("custom", 2, offload)
  policy = nnx_decoders.NNXDecoder.get_remat_policy(types.SimpleNamespace(config=cfg))
  assert (policy.offload_src, policy.offload_dst) == ("device", "pinned_host")
  assert {k for k, v in keys.items() if v == "device"} <= policy.names_which_can_be_saved
  remat = next(n for n in ("out_proj", "query_proj") if keys.get(n, "remat") == "remat")
  names = [*offload, remat, *cfg.tensors_on_device]
  assert offloaded_by(policy, names) == offload
