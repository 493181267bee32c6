"""temoe's GPU expert kernels (every kernel the recipe registry lists: `te`, `mosaic`) against the
xla reference (`xla.mlp`), on a GPU.

At the experts level: a DispatchPlan from random, skewed (two experts empty) and one-expert-takes-all
routing, the buffer filled by temoe's own dispatch, hidden 256, expert ffn 128, 8 experts, 1024 routed
rows. Forward output and gradients wrt the buffer, wi and wo are compared with a float32 reference on
the same bf16 values. Free device memory is filled with NaN before each run, so a row a kernel never
writes reads back as NaN: every row must be finite, padding rows and empty experts' weight gradients
exactly zero. Measured errors are printed (pytest -s) and recorded as junit properties.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.devices()[0].platform != "gpu":
  pytest.skip("the GPU expert kernels need a GPU", allow_module_level=True)

# pylint: disable=wrong-import-position
from temoe import hardware, recipes
from temoe.moe import block, dispatch
from temoe.moe.context import MoEContext
from temoe.moe.experts import xla


EXPERTS, EMB, FFN, TOKENS, TOP_K = 8, 256, 128, 512, 2  # 1024 routed rows
NO_BIAS = (None, None, None)
# (forward, gradients) bounds on the relative error against float32: the recipe registry's
# (temoe.recipes.REGISTRY[...].error_bound, where the measured values that set them are cited).


def context(recipe: str, kernel: str, dtype) -> MoEContext:
  return MoEContext(num_experts=EXPERTS, top_k=TOP_K, dtype=dtype, recipe=recipe, kernel=kernel,
                    align=recipes.row_alignment(recipe, kernel))


def why_skip(recipe: str, kernel: str) -> str | None:
  """None if `kernel` runs `recipe` in this process, else why not (the registry's check, as the block uses)."""
  return recipes.why_not(recipe, kernel, hardware.detect())


GPU_KERNELS = [(kernel, recipe) for recipe in recipes.RECIPES for kernel in recipes.REGISTRY[recipe].align
               if kernel != "xla"]
"""Every (GPU expert kernel, recipe) pair the registry lists."""


def routing(kind: str, key) -> jax.Array:
  """(TOKENS, TOP_K) expert ids: uniform, skewed with experts 1 and 5 empty, or all on expert 3."""
  if kind == "random":
    return jax.random.randint(key, (TOKENS, TOP_K), 0, EXPERTS, jnp.int32)
  if kind == "skewed":
    probs = jnp.array([0.45, 0.0, 0.25, 0.1, 0.1, 0.0, 0.05, 0.05])
    return jax.random.choice(key, EXPERTS, (TOKENS, TOP_K), p=probs).astype(jnp.int32)
  return jnp.full((TOKENS, TOP_K), 3, jnp.int32)


def relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def poison_free_memory(nbytes: int = 512 << 20) -> None:
  """Fills free device memory with NaN and frees it: the allocator hands those blocks to the next
  executable, so rows a kernel leaves unwritten read NaN instead of stale zeros (best effort)."""
  jnp.full((nbytes // 4,), jnp.nan, jnp.float32).block_until_ready()


def output_and_grads(mlp, x, wi, wo, p, cotangent):
  """y = mlp(x, wi, wo, p) and the gradients of <y[routed rows], cotangent> wrt x, wi, wo."""

  def objective(x, wi, wo):
    y = mlp(x, wi, wo, p)
    return jnp.sum(y[p.slots].astype(jnp.float32) * cotangent), y

  (_, y), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(x, wi, wo)
  return y, grads


def run_poisoned(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  poison_free_memory()
  return jax.block_until_ready(compiled(*args))


@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert"])
@pytest.mark.parametrize("kernel, recipe", GPU_KERNELS)
def test_gpu_kernels_match_xla(kernel, recipe, kind, record_property):
  reason = why_skip(recipe, kernel)
  if reason:
    pytest.skip(reason)
  ctx = context(recipe, kernel, jnp.bfloat16)
  align = ctx.align
  keys = jax.random.split(jax.random.key(0), 5)
  p = dispatch.plan(routing(kind, keys[0]), EXPERTS, align)
  tokens = jax.random.normal(keys[1], (TOKENS, EMB), jnp.float32).astype(jnp.bfloat16)
  x = dispatch.dispatch(tokens, p, TOP_K)
  wi = (jax.random.normal(keys[2], (EXPERTS, EMB, 2 * FFN)) * EMB**-0.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(keys[3], (EXPERTS, FFN, EMB)) * FFN**-0.5).astype(jnp.bfloat16)
  cotangent = jax.random.normal(keys[4], (p.routed_rows, EMB), jnp.float32)

  if kernel == "te":
    sizes = dispatch.covering_group_sizes(p.padded_group_sizes, p.buffer_rows)
    assert int(sizes.sum()) == p.buffer_rows and not np.any(np.asarray(sizes) % align)

  def gpu_mlp(x, wi, wo, p):
    return block.expert_kernel(kernel).mlp(ctx, x, p, wi, wo, NO_BIAS, None)

  def xla_mlp(x, wi, wo, p):
    return xla.mlp(context("te_no_quant", "xla", jnp.float32), x, p, wi, wo, NO_BIAS, None)

  y, (dx, dwi, dwo) = run_poisoned(lambda *a: output_and_grads(gpu_mlp, *a), x, wi, wo, p, cotangent)
  f32 = [a.astype(jnp.float32) for a in (x, wi, wo)]
  ref_y, (ref_dx, ref_dwi, ref_dwo) = jax.jit(lambda *a: output_and_grads(xla_mlp, *a))(*f32, p, cotangent)

  for name, a in {"y": y, "dx": dx, "dwi": dwi, "dwo": dwo}.items():
    assert np.isfinite(np.asarray(a, np.float32)).all(), f"{name} has non-finite values (unwritten rows?)"
  slots = np.asarray(p.slots)
  padding = np.setdiff1d(np.arange(p.buffer_rows), slots)
  assert not np.asarray(y, np.float32)[padding].any(), "padding rows of y are not zero"
  assert not np.asarray(dx, np.float32)[padding].any(), "padding rows of dx are not zero"
  empty = np.flatnonzero(np.asarray(p.group_sizes) == 0)
  assert not np.asarray(dwi, np.float32)[empty].any(), f"wi gradient of empty experts {empty} is not zero"
  assert not np.asarray(dwo, np.float32)[empty].any(), f"wo gradient of empty experts {empty} is not zero"

  errors = {
      "y": relative_error(y[slots], ref_y[slots]),
      "dx": relative_error(dx[slots], ref_dx[slots]),
      "dwi": relative_error(dwi, ref_dwi),
      "dwo": relative_error(dwo, ref_dwo),
  }
  print(f"{kernel} {recipe} {kind} relative errors vs float32: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
  for name, err in errors.items():
    record_property(f"rel_err_{name}", err)
  fwd_tol, grad_tol = recipes.REGISTRY[recipe].error_bound
  assert errors["y"] < fwd_tol, errors
  assert max(errors["dx"], errors["dwi"], errors["dwo"]) < grad_tol, errors
