"""The block-scaled kernels' fresh accumulators issued with PTX scale-d = 0 (TileConfig.fresh,
temoe.moe.experts.wgmma_fresh), checked on the CPU by lowering for sm_90 without running: in the
lowered Mosaic GPU module, the first wgmma instruction of each k-block gets the accumulate predicate 0
and an undefined accumulator, every other one (the k-block's later instructions, unmarked kernels in
the same process) keeps the constant 1 and its chain. The kernels' math in GPU interpret mode is
tests/unit/test_fp8_block.py's (there a fresh accumulator is zero, the same result); the speed is
bench/mosaic_gemm.py --variants on a GPU. And the option is refused, in one line, where it cannot run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core

from temoe.moe.experts import mosaic_gemm as mz
from temoe.moe.experts import wgmma_fresh

S = jax.ShapeDtypeStruct
BASE = mz.TileConfig(block_m=128, block_n=128, stages=3, compute_wgs=2, grid_block_n=2)


def wgmma_instructions(module) -> list[tuple[int, str]]:
  """(accumulate predicate, op defining the first accumulator input) of every wgmma instruction."""
  out = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if o.operation.name == "llvm.inline_asm" and "wgmma.mma_async" in str(o.operation.attributes["asm_string"]):
            cons = str(o.operation.attributes["constraints"]).strip('"').split(",")
            ins = cons[sum(c.startswith("=") for c in cons):]
            pred = o.operation.operands[ins.index("n")].owner
            value = int(str(pred.operation.attributes["value"]).split(":")[0])
            acc = o.operation.operands[0].owner
            out.append((value, acc.operation.name if hasattr(acc, "operation") else "block argument"))
          walk(o.operation)

  walk(module.operation)
  return out


def lowered(fn, *args, monkeypatch) -> list[tuple[int, str]]:
  """fn lowered for sm_90 on the CPU; its Mosaic GPU kernel's wgmma instructions."""
  seen = []
  original = mgpu_core.lower_mgpu_module

  def capture(module, *a, **k):
    result = original(module, *a, **k)
    seen.append(wgmma_instructions(module))
    return result

  monkeypatch.setattr(mgpu_core, "lower_mgpu_module", capture)
  jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  assert len(seen) == 1, len(seen)
  return seen[0]


ROWS_ARGS = (S((512, 384), mz.E4M3), S((2, 320, 384), mz.E4M3), S((3, 512), jnp.float32), S((2, 3, 3), jnp.float32))
CONTRACT_ARGS = (S((256, 512), mz.E4M3), S((320, 512), mz.E4M3), S((4, 256), jnp.float32), S((4, 320), jnp.float32))
FRESH, KEEP = (0, "llvm.mlir.undef"), (1, "llvm.extractvalue")
CHAIN = [FRESH, KEEP, KEEP, KEEP]  # a 128-deep FP8 k-block: four k32 instructions, the first overwrites


@pytest.mark.parametrize("form, changes, chains", [
    ("rows", dict(fresh=True), 1),  # one wgmma op in the k-block loop
    ("rows", dict(fresh=True, overlap=True), 3),  # the pair loop's two and the odd k-block's
    ("rows", dict(fresh=True, col_scales=True, block_n=160, epi_n=32), 1),  # variant (b)
    ("contract", dict(fresh=True, col_scales=True, block_n=160, epi_n=32), 1),
    ("rows", dict(fresh=True, gmem_scales=True), 1),  # scales by plain loads from global memory
    ("contract", dict(fresh=True, gmem_scales=True, col_scales=True, block_n=160, epi_n=32), 1),
])
def test_fresh_k_blocks_lower_with_scale_d_zero(form, changes, chains, monkeypatch):
  cfg = dataclasses.replace(BASE, **changes)
  gs = S((2 if form == "rows" else 4,), jnp.int32)
  if form == "rows":
    fn = lambda a, b, sa, sb, g: mz.ragged_rows_matmul(a, b, g, config=cfg, sms=132, block_scales=(sa, sb))
    args = (*ROWS_ARGS, gs)
  else:
    fn = lambda a, b, sa, sb, g: mz.ragged_contract_matmul(a, b, g, config=cfg, sms=132, block_scales=(sa, sb))
    args = (*CONTRACT_ARGS, gs)
  assert lowered(fn, *args, monkeypatch=monkeypatch) == CHAIN * chains


def test_unmarked_wgmmas_lower_as_before(monkeypatch):
  """Today's block-scaled kernel, and current scaling's, with the rule installed: every predicate 1, the
  first instruction's accumulator the zeroed scope's registers."""
  with wgmma_fresh.installed():
    rows = lowered(lambda a, b, sa, sb, g: mz.ragged_rows_matmul(a, b, g, config=BASE, sms=132, block_scales=(sa, sb)),
                   *ROWS_ARGS, S((2,), jnp.int32), monkeypatch=monkeypatch)
    monkeypatch.undo()
    cur = lowered(lambda a, b, s, g: mz.ragged_rows_matmul(a, b, g, s, config=mz.TileConfig(block_n=128), sms=132),
                  S((512, 384), mz.E4M3), S((2, 320, 384), mz.E4M3), S((2,), jnp.float32), S((2,), jnp.int32),
                  monkeypatch=monkeypatch)
  for got in (rows, cur):
    assert [p for p, _ in got] == [1] * len(got) and len(got) % 4 == 0
    assert got[0][1] != "llvm.mlir.undef" and all(src == "llvm.extractvalue" for _, src in got[1:4])


def test_options_are_refused_in_one_line_where_they_cannot_run(monkeypatch):
  a, b = S((512, 256), mz.E4M3), S((2, 256, 256), mz.E4M3)
  sa, sb, gs = S((2, 512), jnp.float32), S((2, 2, 2), jnp.float32), S((2,), jnp.int32)

  def refused(cfg, match, block_scaled=True):
    with pytest.raises(ValueError, match=match) as e:
      if block_scaled:
        jax.eval_shape(lambda a, b, g, sa, sb: mz.ragged_rows_matmul(a, b, g, config=cfg, sms=2, block_scales=(sa, sb)),
                       a, b, gs, sa, sb)
      else:
        jax.eval_shape(lambda a, b, g: mz.ragged_rows_matmul(a, b, g, config=cfg, sms=2), a, b, gs)
    assert "\n" not in str(e.value)

  refused(dataclasses.replace(BASE, fresh=True), "options of the block-scaled kernels", block_scaled=False)
  refused(dataclasses.replace(BASE, col_scales=True, overlap=True), "overlap must be off")
  refused(dataclasses.replace(BASE, gmem_scales=True, overlap=True), "overlap must be off")
  refused(dataclasses.replace(BASE, block_n=160, epi_n=32), "col_scales=True takes any")
  monkeypatch.setattr(jax, "__version__", "0.12.1")
  assert "needs jax 0.11.2" in wgmma_fresh.unavailable()
  refused(dataclasses.replace(BASE, fresh=True), "fresh needs jax 0.11.2")
  with pytest.raises(RuntimeError, match="needs jax 0.11.2"):
    wgmma_fresh.install()
