"""Runs a repository script (a bench, a test helper) as `python SCRIPT ARGS` would, forked from the session's fork
server (tests/runs.py's launch: temoe and MaxText imported already, ~10 CPU-s a fresh interpreter pays again before
the script's first line); TEMOE_TEST_FORK=0 runs it in a process of its own instead. Either way it is a process of
its own: its pid, environment, JAX backend, exit code, stdout and stderr."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import runs
from conftest import HANG_S

AS_SCRIPT = r"""
import os, runpy, sys
sys.argv = sys.argv[1:]  # ["-c", SCRIPT, *ARGS] -> [SCRIPT, *ARGS]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # the script's folder first, as python puts it
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""`python -c AS_SCRIPT SCRIPT ARGS` runs SCRIPT as `python SCRIPT ARGS` does (its __name__, argv and path)."""


def run(script: str | os.PathLike, *args: str, env: dict | None = None, timeout: int = HANG_S,
        stdin: str | None = None) -> subprocess.CompletedProcess:
  """`python script args` forked: its exit code and output as subprocess.run(capture_output=True, text=True) gives
  them; `stdin`'s text is its standard input (through a file); raises subprocess.TimeoutExpired after `timeout` s."""
  with tempfile.TemporaryDirectory(prefix="temoe-script-") as folder:
    out, err = pathlib.Path(folder, "out"), pathlib.Path(folder, "err")
    code = AS_SCRIPT
    if stdin is not None:
      pathlib.Path(folder, "in").write_text(stdin, encoding="utf-8")
      code = f"import sys; sys.stdin = open({str(pathlib.Path(folder, 'in'))!r}, encoding='utf-8')\n" + code
    proc = runs.launch([sys.executable, "-c", code, str(script), *args], out, env, err=err)
    try:
      returncode = proc.wait(timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(60)
      raise
    return subprocess.CompletedProcess([str(script), *args], returncode, out.read_text(encoding="utf-8"),
                                       err.read_text(encoding="utf-8"))
