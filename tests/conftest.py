"""Shared helpers: MaxText configs built through MaxText's own pyconfig, with temoe registered."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest
import resource

from temoe.run import pygc

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "deepseek3-smoke.yml")


_OUTPUT = tempfile.mkdtemp(prefix="temoe-tests-")  # this process's own: concurrent runs never share it
atexit.register(shutil.rmtree, _OUTPUT, ignore_errors=True)


def _session_jax_cache() -> str:
  """The session's JAX persistent compilation cache: MaxText's jax_cache_dir (M_JAX_CACHE_DIR, which every
  MaxText run of the session reads, in this process and in the training processes it starts) points at one
  directory per session, made by the first process (pytest-xdist's controller; its workers inherit the
  variable) and removed when it exits; TEMOE_TEST_JAX_CACHE names a directory to keep instead. A run whose
  program another run of the session compiled loads it (same HLO, options and jaxlib: the same executable;
  the losses come out bit for bit the same) instead of compiling it again. MaxText's default, ~/jax_cache,
  would carry programs over from whatever ran on the machine before, so a suite's time would depend on it."""
  path = os.environ.get("TEMOE_TEST_JAX_CACHE")
  if not path:
    path = tempfile.mkdtemp(prefix="temoe-jax-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["TEMOE_TEST_JAX_CACHE"] = path
  os.makedirs(path, exist_ok=True)
  os.environ["M_JAX_CACHE_DIR"] = path
  return path


JAX_CACHE = _session_jax_cache()


FAST_XLA_CPU = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_multi_thread_eigen=false")
"""XLA:CPU's LLVM at -O0 without its expensive passes, for every JAX process of the session (this one, its
workers, the training runs they start): the same HLO passes, so the same buffers and memory analysis, and a
smoke run's cold compile+run in 32 CPU-s instead of 54 (its losses equal to printed precision). Eigen's ops on one
thread: the suite runs more JAX processes than CI has cores, and their intra-op pools only contend (three 24-step
smoke runs side by side on 2 cores: 54.9 -> 51.2 user CPU-s each, 89 -> 84 s; losses equal to printed precision).
Runs of the session compare with runs of the same session only, all compiled alike; `make train` keeps XLA's
default."""


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test's JAX process: FAST_XLA_CPU, and `devices` host devices if given."""
  count = f"--xla_force_host_platform_device_count={devices} " if devices else ""
  return count + FAST_XLA_CPU


if FAST_XLA_CPU not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA_CPU}".strip()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
"""numpy's BLAS on one thread in every process of the session (the workers start after this line): the suite keeps
more processes busy than CI has cores, and OpenBLAS's idle threads spin before they sleep (~1% of the suite's CPU
in blas_thread_server, sampled over a whole run)."""

pygc.configure()  # as `temoe train` and the fork server do (temoe/run/pygc.py); the imports frozen after collection


def maxtext_config(*overrides: str, config: str = SMOKE, tmp: str = _OUTPUT):
  """A MaxText HyperParameters for `config` plus `key=value` overrides, through temoe's schema."""
  import temoe  # pylint: disable=import-outside-toplevel
  import temoe.maxtext  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import  (MaxText's asset root, first)
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from temoe.maxtext import introspect  # pylint: disable=import-outside-toplevel

  temoe.register()
  with introspect.yaml_read_once():  # a process's builds of one YAML chain read it once (the same config key for key)
    return pyconfig.initialize(["test", config, f"base_output_directory={tmp}", "run_name=test", *overrides])


HANG_S = 1800
"""How long a test waits on a subprocess (a training run, a CLI call) before calling it hung. Only a guard
against a hang, never a judgement of speed: a run under load (the suite's 3 workers on 2 cores, other
jobs beside) took 5 minutes to reach its compile line, past the 300 s such guards used to allow."""


def run_temoe(*args: str, cwd: str | os.PathLike = ROOT, env: dict | None = None, timeout: int = HANG_S):
  """Runs the `temoe` CLI of this venv in a fresh process; returns the CompletedProcess."""
  full_env = {**os.environ, **(env or {})}
  return subprocess.run(
      [sys.executable, "-m", "temoe.cli", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
  )


@pytest.fixture(scope="session")
def smoke_data(tmp_path_factory) -> str:
  """The learnable token stream the smoke config trains on, written once per session."""
  from temoe.run import data  # pylint: disable=import-outside-toplevel

  return data.write_parquet(str(tmp_path_factory.mktemp("data") / "smoke-train.parquet"))


def once_per_session(tmp_path_factory, name: str, produce):
  """`produce(directory)`'s JSON-able result, computed once per test session: with pytest-xdist each worker
  holds its own session fixtures, so the first worker to ask computes it (in the workers' shared temp
  directory, under a lock the others wait on) and the others read what it wrote."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # pytest-N, above each worker's popen-gwK
  done = root / f"{name}.json"
  with open(root / f"{name}.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      result = produce(pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root)))
      done.write_text(json.dumps(result), encoding="utf-8")
  return json.loads(done.read_text(encoding="utf-8"))


SCHEDULE_STEPS = 32
"""The learning-rate schedule every smoke run of the session follows (tests/runs.py's SCHEDULE), whatever its steps."""

REFERENCE_STEPS, REFERENCE_PERIOD = 16, 5
REFERENCE_FLAGS = (f"steps={REFERENCE_STEPS}", "enable_checkpointing=true", f"checkpoint_period={REFERENCE_PERIOD}",
                   "save_checkpoint_on_completion=false")
"""The session's uninterrupted smoke runs: the first 16 steps of the 32-step schedule (a step costs ~0.4 CPU-s at
-O0 here; over these 16 the loss falls 6.05 -> 3.23, first three against last three), checkpoints at steps 0, 5,
10 and 15: the interchange test resumes a copy cut back to step 10 with the other block, the reliability tests
damage copies cut back to step 5 (runs.copy_run) instead of training a run of their own (saving does not change a
loss)."""


def reference_run(tmp_path_factory, smoke_data, te_moe_block: str) -> dict:
  """One uninterrupted smoke run with te_moe_block=`te_moe_block`, once per session: {"base": its
  base_output_directory (run "ref" in it; copy it before resuming: runs.copy_run), "rows": its metrics rows,
  "log": its log}."""
  import runs  # pylint: disable=import-outside-toplevel

  def train(base):
    runs.train(base, smoke_data, "ref", "ref.jsonl", f"te_moe_block={te_moe_block}", *REFERENCE_FLAGS)
    rows = [json.loads(line) for line in (base / "ref.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"base": str(base), "rows": rows, "log": (base / "ref.jsonl.log").read_text(encoding="utf-8")}

  return once_per_session(tmp_path_factory, f"uninterrupted-{te_moe_block}", train)


@pytest.fixture(scope="session")
def temoe_reference(tmp_path_factory, smoke_data) -> dict:
  """`reference_run` of temoe's block (the smoke config's own setting)."""
  return reference_run(tmp_path_factory, smoke_data, "true")


@pytest.fixture(scope="session")
def native_reference(tmp_path_factory, smoke_data) -> dict:
  """`reference_run` of MaxText's native MoE block (te_moe_block=false)."""
  return reference_run(tmp_path_factory, smoke_data, "false")


@pytest.fixture(scope="session")
def smoke_reference(temoe_reference) -> dict[int, float]:
  """{step: loss} of the uninterrupted 16-step run of temoe's block: the trajectory a stopped and resumed run
  must continue exactly (tests/e2e/test_resume.py, test_preemption.py). JSON keeps the floats exactly (repr
  round-trips)."""
  return {int(row["step"]): row["learning/loss"] for row in temoe_reference["rows"]}


@pytest.fixture(scope="session")
def profiled_smoke(tmp_path_factory, smoke_data):
  """One `temoe profile` CPU run of the smoke config with MoE metrics on (5 steps, the last 2 traced),
  shared by the profile and report tests (each reads it; the report writes only its report/ folder):
  (run dir, CompletedProcess). Forked like the session's training runs (tests/runs.py's launch), its stdout and
  stderr apart."""
  import runs  # pylint: disable=import-outside-toplevel

  def profile(base):
    run = base / "run"
    argv = [sys.executable, "-m", "temoe.cli", "profile", SMOKE, f"grain_train_files={smoke_data}",
            "record_internal_nn_metrics=true", "--out", str(run), "--skip", "3", "--steps", "2"]
    code = runs.launch(argv, base / "stdout.log", err=base / "stderr.log").wait(HANG_S)
    stdout, stderr = ((base / f"{name}.log").read_text(encoding="utf-8") for name in ("stdout", "stderr"))
    assert code == 0, stderr[-4000:]
    return {"run": str(run), "args": argv, "stdout": stdout, "stderr": stderr}

  done = once_per_session(tmp_path_factory, "profiled", profile)
  return pathlib.Path(done["run"]), subprocess.CompletedProcess(done["args"], 0, done["stdout"], done["stderr"])


MARKERS = {"image": "builds the image on a stand-in base and trains in the container (needs a container engine)",
           "unit": "fast CPU tests", "e2e": "training runs in subprocesses (slow)", "slurm": "a real Slurm cluster",
           "gpu": "needs a GPU (bench/run_gpu.sh runs them)"}


def pytest_configure(config):
  for name, doc in MARKERS.items():
    config.addinivalue_line("markers", f"{name}: {doc}")


LONGEST_FIRST = ("image/test_image.py", "e2e/test_reliability.py", "e2e/test_bench_smoke.py", "e2e/test_preemption.py",
                 "unit/test_plan.py", "slurm/test_slurm.py", "e2e/test_train_e2e.py", "e2e/test_exchange_pipeline.py",
                 "unit/test_parity_matrix.py", "unit/test_mosaic_tokens.py", "unit/test_profile.py",
                 "unit/test_bench_mosaic_gemm.py", "unit/test_fp8_block.py", "unit/test_dedup_exchange.py",
                 "unit/test_step_model.py", "e2e/test_resume.py", "e2e/test_failures.py", "unit/test_hier_exchange.py",
                 "unit/test_bench_logic.py", "unit/test_parity.py", "unit/test_mosaic_schedule.py",
                 "e2e/test_interchange.py", "e2e/test_overflow.py")
"""The files that take longest (a CI-like run's JUnit times per file), longest first: the training runs, the
plan's compiles, the parity matrix and its 4-device runs, the interpret-mode kernels and sweeps. `make test`
runs files whole on each worker (--dist
loadfile) in collection order (--no-loadscope-reorder): these go out first, then the other training runs (e2e),
then the short unit files, so the last files to start are short and the workers finish together. The
session's shared runs (temoe_reference, native_reference, profiled_smoke) are asked for first by
test_reliability or test_preemption (whichever comes first trains temoe_reference; the other waits on its lock
instead of compiling the same program beside it), test_train_e2e and test_profile, so they are usually done when
test_interchange, test_resume, test_report and test_metrics ask for them."""
FOLDER_ORDER = ("image", "slurm", "e2e", "unit", "gpu")


_CPU_AT_SETUP = pytest.StashKey[float]()


def _cpu_s() -> float:
  """User+system CPU seconds of this process, of the children it has waited for, and of the runs the fork server
  forked for it that have ended (tests/runs.py's forked_cpu_s: the server's children, not this process's)."""
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  forked = sys.modules["runs"].forked_cpu_s() if "runs" in sys.modules else 0.0
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  item.stash[_CPU_AT_SETUP] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """Each test's CPU seconds (its setup, call and teardown: this worker, the processes it waited for and the runs
  forked for it that ended meanwhile; a container's or a Slurm job's processes are not its children) as the
  `cpu_s` property of its JUnit record: on CI's 2 cores the suite's time is its CPU time, and this says where it
  goes."""
  if call.when == "teardown" and _CPU_AT_SETUP in item.stash:
    item.user_properties.append(("cpu_s", round(_cpu_s() - item.stash[_CPU_AT_SETUP], 1)))
  yield


def pytest_collection_finish(session):  # pylint: disable=unused-argument
  """Every test module is imported (and with them JAX and MaxText, where they import them): out of the collector's
  view from here on, as temoe/run/pygc.py says why."""
  pygc.freeze_imports()


def pytest_collection_modifyitems(items):
  """Each test is marked by its folder (tests/unit, e2e, slurm, gpu): `pytest -m unit` runs the fast ones.
  Files are ordered LONGEST_FIRST, then by FOLDER_ORDER; a file's tests keep their order."""
  def rank(item) -> tuple[int, int]:
    path = pathlib.Path(str(item.fspath))
    name = f"{path.parent.name}/{path.name}"
    first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    folder = FOLDER_ORDER.index(path.parent.name) if path.parent.name in FOLDER_ORDER else len(FOLDER_ORDER)
    return first, folder

  items.sort(key=rank)  # stable: collection order within a rank
  for item in items:
    folder = pathlib.Path(str(item.fspath)).parent.name
    if folder in MARKERS:
      item.add_marker(folder)
