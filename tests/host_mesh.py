"""What the shard_map tests on host devices share: a test file runs itself as a script on N host devices
(XLA's device count is fixed when JAX starts, so not in pytest's process) and prints one report line; the
test reads it back. Beside it, the block's loss and gradients under a context, and relative errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA:CPU's LLVM at -O0: the same HLO passes and the same numbers (the mesh tests' errors unchanged to the last
bit), compiled in 60% of the CPU time; at these shapes compiling is most of a test."""


def run_script(path: str, tag: str, devices: int, *args: str, cwd: str | None = None) -> dict | list:
  """`python path *args` on `devices` host devices; the JSON after `tag ` on its stdout."""
  from conftest import HANG_S, xla_flags  # pylint: disable=import-outside-toplevel  (host_mesh is imported by scripts too)

  env = {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, path, *args], capture_output=True, text=True, env=env, cwd=cwd,
                        timeout=HANG_S)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(tag + " ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[0][len(tag) + 1:])


def report(tag: str, result) -> None:
  """The one line run_script reads."""
  print(f"{tag} " + json.dumps(result), flush=True)


def rel(a, b) -> float:
  """||a - b|| / ||b|| in float64."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def block_runner(ids, x, w, wi, wo, cot):
  """run(ctx) -> (out, grads of x, w, wi, wo, stats) of temoe's block under ctx, for the loss sum(out * cot)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from temoe.moe import block  # pylint: disable=import-outside-toplevel

  def run(ctx):
    def loss(x, w, wi, wo):
      out, stats = block.apply(ctx, x, ids, w, wi, wo)
      return jnp.sum(out * cot), (out, stats)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True), compiler_options=FAST_COMPILE)
    (_, (out, stats)), grads = grad(x, w, wi, wo)
    return out, grads, stats

  return run


def versus(got, reference, row_per_pair) -> dict:
  """A mesh run (out, grads, stats) against the one-device block and the row-per-pair exchange on that mesh."""
  (out, grads, stats), (ref_out, ref_grads, _), (p_out, p_grads, p_stats) = got, reference, row_per_pair
  return {
      "vs_one_device": [rel(out, ref_out)] + [rel(a, b) for a, b in zip(grads, ref_grads)],
      "vs_row_per_pair": [rel(out, p_out)] + [rel(a, b) for a, b in zip(grads, p_grads)],
      "received": [int(stats["received"]), int(p_stats["received"])],
      "overflow": bool(stats["overflow"]),
  }


def check_versus(reports: list[dict], tol: float) -> None:
  """Each mesh within tol of both references, with the same rows received as row-per-pair and no overflow."""
  for r in reports:
    assert max(r["vs_one_device"]) < tol and max(r["vs_row_per_pair"]) < tol, r
    assert r["received"][0] == r["received"][1] and not r["overflow"], r
