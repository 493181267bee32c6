"""temoe's image, built and run for real: the Dockerfile, unchanged, on a stand-in of the NGC JAX MaxText base
(tests/image/standin/), then `temoe doctor --image`, `temoe plan` and a few CPU training steps in the container
(through launch/docker-run.sh, no network), and one SIGTERM: the container saves its step and exits 75.

The engine: `docker` where a Docker engine answers (DOCKER_HOST included), else podman's Docker API (a
`podman system service` this test starts and stops); with neither the file is skipped in one line. Nothing is
installed unless CI=true or TEMOE_IMAGE_INSTALL=1 (then tests/image/engine.sh installs podman from Debian's
packages; root). The stand-in is tagged by a hash of its inputs and built once per machine; temoe's own layers
come from the engine's cache when their inputs did not change.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import runs
import standin
from conftest import ROOT

IMAGE = os.environ.get("TEMOE_TEST_IMAGE", "temoe:image-test")
ENGINE_SH = pathlib.Path(__file__).resolve().parent / "engine.sh"
SMOKE = "/opt/temoe/configs/deepseek3-smoke.yml"
CPU = ("-e", "JAX_PLATFORMS=cpu", "-e", "PYTHONUNBUFFERED=1")
STEP = re.compile(r"completed step: (\d+),")


def _answers(environ: dict[str, str]) -> bool:
  if shutil.which("docker") is None:
    return False
  version = subprocess.run(["docker", "version"], env=environ, capture_output=True, timeout=60, check=False)
  return version.returncode == 0


def _start_podman(environ: dict[str, str], sock: pathlib.Path) -> subprocess.Popen:
  service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  for _ in range(60):
    if _answers(environ):
      return service
    if service.poll() is not None:
      break
    time.sleep(1)
  service.terminate()
  service.wait(30)
  pytest.fail(f"podman system service did not answer on {sock}")


@pytest.fixture(scope="session")
def engine():
  """The environment in which `docker` reaches an engine; skips where none answers."""
  environ = {**os.environ, "DOCKER_BUILDKIT": "0"}  # the classic build API: podman's, and Docker's without buildx
  if _answers(environ):
    yield environ
    return
  asked = os.environ.get("CI") == "true" or os.environ.get("TEMOE_IMAGE_INSTALL") == "1"
  if shutil.which("podman") is None and asked:
    subprocess.run(["bash", str(ENGINE_SH), "install"], check=True, timeout=1200)
  missing = [tool for tool in ("docker", "podman") if shutil.which(tool) is None]
  if missing:
    why = "no Docker CLI" if "docker" in missing else "docker does not answer and podman is not installed"
    pytest.skip(f"image test skipped: no container engine ({why}; CI=true or TEMOE_IMAGE_INSTALL=1 installs podman "
                "from Debian's packages)")
  with tempfile.TemporaryDirectory(prefix="temoe-podman-") as tmp:
    sock = pathlib.Path(tmp) / "podman.sock"
    environ["DOCKER_HOST"] = f"unix://{sock}"
    service = _start_podman(environ, sock)
    try:
      yield environ
    finally:
      service.terminate()
      service.wait(60)


def docker(engine: dict, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
  return subprocess.run(["docker", *args], env=engine, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def image(engine) -> str:
  """temoe's image built with `make image` on the stand-in base; returns its tag."""
  try:
    base = standin.ensure(log=print, environ=engine)
  except standin.StandinError as exc:
    pytest.fail(str(exc))
  build = subprocess.run(["make", "--no-print-directory", "image", f"BASE_IMAGE={base}", f"IMAGE={IMAGE}"], cwd=ROOT,
                         env=engine, capture_output=True, text=True, timeout=3600, check=False)
  out = build.stdout + build.stderr
  # The build's own `temoe doctor --image` fails the build on a problem (it says "stack: fits" when its layer is
  # built, nothing when the layer comes from the cache); the doctor test runs it again in the image.
  assert build.returncode == 0, f"make image BASE_IMAGE={base} failed:\n{out[-8000:]}"
  return IMAGE


LIMITS = {"nofile": "Max open files", "nproc": "Max processes", "memlock": "Max locked memory"}


@pytest.fixture(scope="session")
def default_limits(image, engine) -> list[str]:
  """`--ulimit` options holding the limits the engine gives a container by default, for docker-run.sh to pass after
  its own: its memlock=-1 (pinned host buffers on a GPU host) is more than a runtime without CAP_SYS_RESOURCE
  can set (this CI's podman: "error setting rlimit type 8: operation not permitted"), and podman, once any
  --ulimit is given, asks for 1048576 open files and processes, more than such a host allows."""
  run = docker(engine, "run", "--rm", "--network", "none", "--entrypoint", "cat", image, "/proc/self/limits")
  assert run.returncode == 0, run.stderr
  rows = {line[:26].strip(): line[26:].split() for line in run.stdout.splitlines()}
  value = lambda v: "-1" if v == "unlimited" else v  # noqa: E731
  return [w for name, row in LIMITS.items()
          for w in ("--ulimit", f"{name}={value(rows[row][0])}:{value(rows[row][1])}")]


def test_doctor_in_the_image_finds_the_stack_temoe_is_tested_against(image, engine):
  run = docker(engine, "run", "--rm", "--network", "none", *CPU, image, "doctor", "--image")
  assert run.returncode == 0, run.stdout + run.stderr[-4000:]
  lines = dict(line.split(None, 1) for line in run.stdout.splitlines() if line.startswith("  "))
  assert lines["Python"].startswith("3.12.")
  assert lines["MaxText"].startswith("0.2.5, ") and lines["MaxText"].endswith("(wheel), base.yml as released")
  assert lines["TE"].startswith("2.20.2, defines the ")
  assert "temoe doctor --image:" not in run.stdout and run.stdout.rstrip().endswith("stack: fits")


def test_plan_in_the_image_prices_the_step_with_the_packaged_calibration(image, engine):
  run = docker(engine, "run", "--rm", "--network", "none", *CPU, image, "plan", SMOKE, "--gpu", "h200", "hardware=gpu")
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  assert "step time on h200 (h200: temoe/tools/calibrations/h200.json (measured))" in run.stdout, run.stdout[-4000:]


def test_docker_run_sh_starts_a_container_exiting_75_again_and_leaves_none_behind(image, engine, default_limits,
                                                                                 tmp_path):
  """The engine's own `docker run --rm` may not give the container's exit code (podman 4.3's Docker API, Debian 12's,
  answers 0 whatever it was); docker-run.sh reads it from the engine, so a requeue exit 75 is started again and
  reported, and the containers it started are removed."""
  plain = docker(engine, "run", "--rm", "--network", "none", image, "sh", "-c", "exit 75", timeout=300)
  print(f"image test: `docker run --rm` here exits {plain.returncode} for a container that exits 75")
  name = f"temoe-image-test-{os.getpid()}-requeue"
  run = subprocess.run(["bash", str(ROOT / "launch/docker-run.sh"), "--name", name, "--network", "none",
                        *default_limits, image, "sh", "-c", "echo started; exit 75"],
                       env={**engine, "TEMOE_GPUS": "none", "TEMOE_MAX_RESTARTS": "1"}, capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
  assert run.returncode == 75, run.stdout + run.stderr
  assert run.stdout.split() == ["started", "started"] and run.stderr.count("starting the container again") == 1, run
  left = docker(engine, "ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}}", timeout=120)
  assert left.returncode == 0 and name not in left.stdout.split(), left.stdout


EVENT_WAIT_S = 120
"""How long container_exit looks for the `die` event: a loaded machine's podman listed it a while after the
client had returned (once: none yet right after a run that trained and exited)."""


def container_exit(engine: dict, name: str, since: int) -> int | None:
  """The exit code of container `name` as the engine's `die` event gives it (None: no such event)."""
  deadline = time.monotonic() + EVENT_WAIT_S
  while True:
    events = docker(engine, "events", "--since", str(since), "--until", str(int(time.time()) + 1), "--filter",
                    f"container={name}", "--format", "{{.Action}} {{.Status}} {{.Actor.Attributes.exitCode}}",
                    timeout=120)  # podman's Docker API answers nothing to --filter event=die: the events are picked here
    codes = [line.split()[-1] for line in events.stdout.splitlines() if "die" in line.split()[:2]]
    if codes or time.monotonic() > deadline:
      return int(codes[-1]) if codes else None
    time.sleep(1)


@pytest.fixture(scope="session")
def container_cache(tmp_path_factory) -> pathlib.Path:
  """The containers' JAX compilation cache (mounted at /jax-cache, MaxText's jax_cache_dir there): the first
  container to train compiles the smoke model, the second loads it. The containers' own: the host's programs
  stay out, so the image compiles what it trains at least once."""
  return tmp_path_factory.mktemp("container-jax-cache")


FAR = 100000
"""The SIGTERM run's steps: far beyond what runs before the signal."""
CONTAINER_CACHE = ("jax_cache_dir=/jax-cache", f"learning_rate_schedule_steps={FAR}")
"""Both container runs: one learning-rate schedule, so one program whatever their steps (up to FAR: more would add
a zero-rate tail, another program)."""


@contextlib.contextmanager
def train_in_container(engine: dict, image: str, limits: list[str], cache: pathlib.Path, out: pathlib.Path,
                       *overrides: str):
  """`launch/docker-run.sh` training the smoke model on CPU with no network, its runs in `out`, its output in
  out/log, the compilation cache `cache`; yields (the process, a function returning the container's exit code);
  the container is removed on the way out whatever happened."""
  name = f"temoe-image-test-{os.getpid()}-{out.name}"
  since = int(time.time()) - 1
  proc = _start(engine, image, [*limits, "-v", f"{cache}:/jax-cache"], out, name, *CONTAINER_CACHE, *overrides)
  try:
    yield proc, lambda: container_exit(engine, name, since)
  finally:
    if proc.poll() is None:
      proc.kill()
    docker(engine, "rm", "-f", name, timeout=120)


def _start(engine: dict, image: str, limits: list[str], out: pathlib.Path, name: str, *overrides: str
           ) -> subprocess.Popen:
  out.mkdir(parents=True, exist_ok=True)
  log = open(out / "log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
  cmd = ["bash", str(ROOT / "launch/docker-run.sh"), "--name", name, "--network", "none", *limits, *CPU,
         "-v", f"{out}:/runs", image,
         "train", SMOKE, "base_output_directory=/runs", "run_name=run", "metrics_file=/runs/metrics.jsonl",
         "enable_tensorboard=false", *overrides]
  return subprocess.Popen(cmd, env={**engine, "TEMOE_GPUS": "none", "TEMOE_MAX_RESTARTS": "1"}, stdout=log,
                          stderr=subprocess.STDOUT, cwd=ROOT)


def test_the_smoke_model_trains_in_the_container(image, engine, default_limits, container_cache, tmp_path):
  with train_in_container(engine, image, default_limits, container_cache, tmp_path, "steps=4") as (proc, container_code):
    code = proc.wait(1800)
    inside = container_code()
  log = (tmp_path / "log").read_text(encoding="utf-8", errors="replace")
  assert inside == 0, f"the container exited {inside}\n{log[-6000:]}"
  assert code == 0, log[-6000:]
  assert "te_moe_block=true -> temoe MoE block" in log, log[-6000:]
  losses = runs.losses(tmp_path / "metrics.jsonl")
  assert sorted(losses) == [0, 1, 2, 3], losses
  assert all(math.isfinite(loss) for loss in losses.values()), losses


def test_sigterm_to_the_container_saves_the_step_and_exits_75(image, engine, default_limits, container_cache, tmp_path):
  """docker-run.sh passes the SIGTERM on to the container: temoe finishes its step, checkpoints it, exits 75, and
  docker-run.sh, stopped, does not start it again. steps is far beyond what runs before the signal."""
  with train_in_container(engine, image, default_limits, container_cache, tmp_path, f"steps={FAR}",
                          "enable_checkpointing=true", f"checkpoint_period={FAR}", "async_checkpointing=false"
                          ) as (proc, container_code):
    deadline, stepped = time.monotonic() + 1800, False
    while not stepped and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.5)  # the run cannot finish meanwhile: the signal may come late, never too late
      stepped = len(STEP.findall((tmp_path / "log").read_text(encoding="utf-8", errors="replace"))) >= 2
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(900)
    inside = container_code()
  log = (tmp_path / "log").read_text(encoding="utf-8", errors="replace")
  assert stepped, f"no second step before the run ended (exit {code}):\n{log[-6000:]}"
  temoe_lines = runs.temoe_lines(log)
  assert inside == 75, f"the container exited {inside}\n{log[-6000:]}"
  assert code == 75, f"docker-run.sh exited {code}\n{log[-6000:]}"
  stop = re.search(rf"training stopped after step (\d+) of {FAR}: SIGTERM \(preemption or a stop request\); "
                   r"checkpoint step (\d+) saved\. Exit 75 \(requeue\)", temoe_lines[-1] if temoe_lines else "")
  assert stop and stop.group(1) == stop.group(2), log[-6000:]
  assert runs.finalized_steps(tmp_path / "run" / "checkpoints")[-1] == int(stop.group(1))
  assert "starting the container again" not in log and log.count("temoe entrypoint:") == 1
