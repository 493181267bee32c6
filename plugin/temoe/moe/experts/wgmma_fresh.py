"""A wgmma into a fresh accumulator issued with PTX's scale-d = 0: the product overwrites the accumulator
registers, so they need no zeroing first.

Pallas Mosaic GPU has no switch for this: `plgpu.ACC` scopes start from zero (a register store before
the first wgmma), and Mosaic GPU emits every wgmma with its accumulate predicate (`setp.ne.b32 p,
use_out, 0`) fed a constant 1. The block-scaled kernels multiply every 128-deep k-block into a fresh
accumulator, so they zero 64 x block_n fp32 registers per k-block only for the first wgmma to add
them. A kernel marks such a wgmma by tracing it inside `fresh()` (a name scope, carried into the
Mosaic GPU op's location); `install()` wraps Mosaic GPU's lowering of the wgmma op so that, for a
marked op alone, the first instruction of each 64-row group gets use_out = 0 and an undefined
accumulator input, so the zeroing is left without a reader for ptxas to keep. Everything else lowers as
before, and the kernel's meaning does not change: a fresh accumulator is zero, and 0 + a @ b is
a @ b (GPU interpret mode, which never lowers, runs the marked kernel as it is).

This rewrites IR that JAX emits, so it is held to the JAX versions whose emission it was checked
against (`SUPPORTED_JAX`) and checks the shape of what it rewrites (the predicate operand in the asm
text, a constant 1 there, the accumulator chain); anything else raises at lowering, naming what it
found. tests/unit/test_mosaic_fresh.py lowers a marked kernel for sm_90 on the CPU and reads the
result.
"""

from __future__ import annotations

import contextlib
import re

import jax

SCOPE = "temoe_fresh_accumulator"
SUPPORTED_JAX = ("0.11.2",)
_OP = "mosaic_gpu.wgmma"
_MMA = "wgmma.mma_async"
_installed = {}


def unavailable() -> str | None:
  """Why the scale-d = 0 rewrite cannot be used here (None: it can)."""
  if jax.__version__ not in SUPPORTED_JAX:
    return f"needs jax {' or '.join(SUPPORTED_JAX)} (its Mosaic GPU wgmma emission was checked), have {jax.__version__}"
  try:
    from jax.experimental.mosaic.gpu import dialect_lowering  # pylint: disable=import-outside-toplevel
  except ImportError as exc:
    return f"Mosaic GPU's dialect lowering does not import: {exc}"
  if _OP not in getattr(dialect_lowering, "_lowerings", {}):
    return f"Mosaic GPU has no lowering rule for {_OP}"
  return None


def fresh():
  """Context in which a kernel traces the first wgmma into a fresh (zero) accumulator."""
  return jax.named_scope(SCOPE)


def install() -> None:
  """Wraps Mosaic GPU's wgmma lowering (once per process): marked ops get scale-d = 0 on their first
  instruction; unmarked ones lower exactly as before."""
  why = unavailable()
  if why:
    raise RuntimeError(f"temoe fresh-accumulator wgmma: {why}")
  from jax.experimental.mosaic.gpu import dialect_lowering  # pylint: disable=import-outside-toplevel

  rules = dialect_lowering._lowerings  # pylint: disable=protected-access
  if _installed.get("rule") is not None and rules[_OP] is _installed["rule"]:
    return
  original = rules[_OP]

  def rule(ctx, op):
    marked = SCOPE in str(op.operation.location)
    if marked:
      _check_fresh(op.operation.operands[0])
    results = original(ctx, op)
    if marked:
      for value in results:
        for asm in _first_instructions(value):
          _overwrite(asm)
    return results

  _installed["rule"] = rule
  rules[_OP] = rule


@contextlib.contextmanager
def installed():
  """install() for a block (tests), the previous rule restored after it."""
  from jax.experimental.mosaic.gpu import dialect_lowering  # pylint: disable=import-outside-toplevel

  before = dialect_lowering._lowerings[_OP]  # pylint: disable=protected-access
  saved = _installed.get("rule")
  install()
  try:
    yield
  finally:
    dialect_lowering._lowerings[_OP] = before  # pylint: disable=protected-access
    _installed["rule"] = saved


# ------------------------------------------------------------------------------------ IR surgery


def _name(op) -> str:
  return op.operation.name


def _attr(op, key: str) -> str:
  return str(op.operation.attributes[key]).strip('"')


def _is_mma(op) -> bool:
  return _name(op) == "llvm.inline_asm" and _MMA in _attr(op, "asm_string")


def _producer_asm(value):
  """The wgmma inline asm whose struct result `value` was extracted from, else None."""
  owner = value.owner
  if not hasattr(owner, "operation") or _name(owner) != "llvm.extractvalue":
    return None
  src = owner.operation.operands[0].owner
  return src if hasattr(src, "operation") and _is_mma(src) else None


def _fail(what: str):
  raise RuntimeError(f"temoe fresh-accumulator wgmma: {what}; Mosaic GPU's wgmma emission is not the one checked "
                     f"(jax {', '.join(SUPPORTED_JAX)}): use a TileConfig without fresh")


def _check_fresh(acc) -> None:
  """A marked wgmma's accumulator must not come from another wgmma (it starts a chain)."""
  owner = acc.owner
  regs = owner.operation.operands if hasattr(owner, "operation") and _name(owner) == "builtin.unrealized_conversion_cast" else []
  if any(_producer_asm(r) is not None for r in regs):
    _fail("a wgmma marked fresh reads an accumulator another wgmma wrote")


def _result_asms(value, out: list) -> None:
  """The wgmma instructions whose results make up the register `value` (through vector.shuffle, which
  packs two single-element registers into one): appended to out, each once."""
  owner = value.owner
  name = _name(owner) if hasattr(owner, "operation") else ""
  if name == "vector.shuffle":
    for v in owner.operation.operands:
      _result_asms(v, out)
    return
  asm = _producer_asm(value)
  if asm is None:
    _fail(f"an accumulator register of a marked wgmma comes from {name or owner}")
  if not any(asm.operation == a.operation for a in out):
    out.append(asm)


def _first_instructions(value) -> list:
  """The first wgmma instruction of each chain that ends in `value` (the lowered accumulator)."""
  lasts = []
  for reg in value.owner.operation.operands:
    _result_asms(reg, lasts)
  firsts = []
  for asm in lasts:
    steps = 0
    while (prev := _producer_asm(asm.operation.operands[0])) is not None:
      asm, steps = prev, steps + 1
      if steps > 64:
        _fail("an accumulator chain of more than 64 wgmma instructions")
    if not any(asm.operation == a.operation for a in firsts):
      firsts.append(asm)
  return firsts


def _overwrite(asm) -> None:
  """use_out = 0 and undefined accumulator inputs for this wgmma instruction."""
  from jaxlib.mlir import ir  # pylint: disable=import-outside-toplevel  # as Mosaic GPU imports it
  from jaxlib.mlir.dialects import llvm  # pylint: disable=import-outside-toplevel

  constraints = _attr(asm, "constraints").split(",")
  outputs = sum(c.startswith("=") for c in constraints)
  inputs = constraints[outputs:]
  if "n" not in inputs:
    _fail(f"no immediate operand in the constraints {','.join(constraints)}")
  use_out = inputs.index("n")  # the first immediate is the predicate's
  text = _attr(asm, "asm_string")
  if not re.search(rf"setp\.ne\.b32 p, \${outputs + use_out}, 0;", text):
    _fail(f"the predicate is not set from operand ${outputs + use_out} in {text.strip()!r}")
  ops = asm.operation.operands
  one = ops[use_out].owner
  if not (hasattr(one, "operation") and _name(one) == "llvm.mlir.constant" and "1 : i32" in str(one)):
    _fail(f"the accumulate predicate is {one}, not the constant 1")
  tied = [i for i, c in enumerate(inputs) if c.isdigit()]
  if tied != list(range(outputs)):
    _fail(f"the accumulator registers are not the first {outputs} inputs ({','.join(constraints)})")
  with ir.InsertionPoint(asm.operation):
    i32 = ir.IntegerType.get_signless(32)
    ops[use_out] = llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, 0)).result
    undef = {}
    for i in tied:
      t = ops[i].type
      key = str(t)
      if key not in undef:
        undef[key] = llvm.UndefOp(t).result
      ops[i] = undef[key]
