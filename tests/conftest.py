"""Shared helpers: MaxText configs built through MaxText's own pyconfig, with temoe registered."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "deepseek3-smoke.yml")


_OUTPUT = tempfile.mkdtemp(prefix="temoe-tests-")  # this process's own: concurrent runs never share it


def maxtext_config(*overrides: str, config: str = SMOKE, tmp: str = _OUTPUT):
  """A MaxText HyperParameters for `config` plus `key=value` overrides, through temoe's schema."""
  import temoe  # pylint: disable=import-outside-toplevel
  import temoe.maxtext  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import  (MaxText's asset root, first)
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  temoe.register()
  return pyconfig.initialize(["test", config, f"base_output_directory={tmp}", "run_name=test", *overrides])


def run_temoe(*args: str, cwd: str | os.PathLike = ROOT, env: dict | None = None, timeout: int = 900):
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


@pytest.fixture(scope="session")
def smoke_reference(tmp_path_factory, smoke_data) -> dict[int, float]:
  """{step: loss} of one uninterrupted 32-step smoke run (no checkpoints): the trajectory a stopped and
  resumed run must continue exactly (tests/e2e/test_resume.py, test_preemption.py)."""
  import runs  # pylint: disable=import-outside-toplevel

  base = tmp_path_factory.mktemp("uninterrupted")
  return runs.train(base, smoke_data, "ref", "ref.jsonl", "steps=32", "enable_checkpointing=false")[0]


@pytest.fixture(scope="session")
def profiled_smoke(tmp_path_factory, smoke_data):
  """One `temoe profile` CPU run of the smoke config with MoE metrics on (5 steps, the last 2 traced),
  shared by the profile and report tests (each reads it, none changes it): (run dir, CompletedProcess)."""
  run = tmp_path_factory.mktemp("profiled") / "run"
  result = run_temoe("profile", SMOKE, f"grain_train_files={smoke_data}", "record_internal_nn_metrics=true",
                     "--out", str(run), "--skip", "3", "--steps", "2")
  assert result.returncode == 0, result.stderr[-4000:]
  return run, result


MARKERS = {"unit": "fast CPU tests", "e2e": "training runs in subprocesses (slow)", "slurm": "a real Slurm cluster",
           "gpu": "needs a GPU (bench/run_gpu.sh runs them)"}


def pytest_configure(config):
  for name, doc in MARKERS.items():
    config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(items):
  """Each test is marked by its folder (tests/unit, e2e, slurm, gpu): `pytest -m unit` runs the fast ones."""
  for item in items:
    folder = pathlib.Path(str(item.fspath)).parent.name
    if folder in MARKERS:
      item.add_marker(folder)
