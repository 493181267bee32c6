"""What a compiled step's schedule does with each collective, read from XLA's optimized HLO text (a scheduled
module: each computation lists its instructions in the order they run).

A collective is synchronous (one op, or an async pair XLA marked `is_sync`) or asynchronous: a start and a done
with compute scheduled between them, which is what can hide it. For every async pair this lists the instructions
between start and done (a while / call / conditional between them brings its computations' instructions), and
with measured op times (ms per step by HLO instruction name, from a trace) how much compute time sits there:
the most of the collective that the schedule can hide. The step model prices a collective's exposed time as its
modelled time less that (temoe.tools.one_rank).
"""

from __future__ import annotations

import collections
import dataclasses
import re

COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
NOT_COMPUTE = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
                         "partition-id", "replica-id", "add-dependency", "async-start", "async-done", "async-update",
                         "copy-start", "copy-done", "send", "recv", "send-done", "recv-done"))
"""Opcodes that launch no kernel of their own (or are another transfer's start/done)."""
CONTAINERS = ("while", "call", "conditional")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(r"\b(?:calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_SYNC = re.compile(r'"is_sync"\s*:\s*true')


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  rest: str  # the text after the opcode's parenthesis: operands and attributes
  called: tuple[str, ...]  # computations it calls

  def collective(self, computations: dict) -> str | None:
    """The collective kind this instruction is or starts ('all-gather', ...), else None."""
    base = self.opcode.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
      return base
    if self.opcode in ("async-start", "async-done"):
      for name in self.called:
        for inner in computations.get(name, ()):
          if inner.opcode in COLLECTIVES:
            return inner.opcode
    return None


@dataclasses.dataclass
class Collective:
  kind: str  # all-gather, all-to-all, ...
  name: str  # the start's (or the sync op's) instruction name
  computation: str
  is_async: bool
  between: list[str]  # compute instructions scheduled between start and done (nested computations' included)
  done: str | None = None
  overlapped_ms: float | None = None  # measured time of `between` per step, with op times given


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str | None]:
  """({computation: its instructions in schedule order}, the entry computation's name)."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if current is not None and m:
      called = _CALLED.findall(line)
      branches = _BRANCHES.search(line)
      if branches:
        called += [b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip()]
      computations[current].append(Instruction(m.group(2), m.group(3), m.group(4), tuple(called)))
  return computations, entry


def _nested(inst: Instruction, computations: dict, seen: set) -> list[str]:
  """Compute instructions a container runs (its computations', recursively)."""
  out = []
  for name in inst.called:
    if name in seen:
      continue
    seen.add(name)
    for inner in computations.get(name, ()):
      if inner.opcode in CONTAINERS:
        out += _nested(inner, computations, seen)
      elif inner.opcode not in NOT_COMPUTE and not inner.collective(computations):
        out.append(inner.name)
  return out


def collectives(hlo_text: str, op_ms: dict[str, float] | None = None) -> list[Collective]:
  """Every collective of the module's non-fusion computations, in schedule order, with what sits between an
  async start and its done; `op_ms` (HLO instruction name -> measured ms per step) prices that compute."""
  computations, _ = parse(hlo_text)
  fused = {c for insts in computations.values() for i in insts if i.opcode == "fusion" for c in i.called}
  wrapped = {c for insts in computations.values() for i in insts if i.opcode == "async-start" for c in i.called}
  out = []
  for comp, insts in computations.items():
    if comp in fused or comp in wrapped:
      continue
    for k, inst in enumerate(insts):
      kind = inst.collective(computations)
      if not kind or inst.opcode.endswith("-done"):
        continue
      starts = inst.opcode.endswith("-start")
      if not starts:
        out.append(Collective(kind, inst.name, comp, False, [], None, None if op_ms is None else 0.0))
        continue
      token = re.compile(rf"%?\b{re.escape(inst.name)}\b")
      done, between = None, []
      for later in insts[k + 1:]:
        if later.opcode.endswith("-done") and token.search(later.rest):
          done = later.name
          break
        if later.opcode in CONTAINERS:
          between += _nested(later, computations, set())
        elif later.opcode not in NOT_COMPUTE and not later.collective(computations):
          between.append(later.name)
      is_async = not _SYNC.search(inst.rest)
      c = Collective(kind, inst.name, comp, is_async, between if is_async else [], done)
      if op_ms is not None:
        c.overlapped_ms = sum(op_ms.get(n, 0.0) for n in c.between)
      out.append(c)
  return out


def summary(found: list[Collective]) -> list[dict]:
  """One row per (kind, async): how many, how many have compute between start and done, and its measured ms
  per step (None without op times): bench/results/one_rank.json's `collectives`."""
  groups = collections.OrderedDict()
  for c in found:
    groups.setdefault((c.kind, c.is_async), []).append(c)
  rows = []
  for (kind, is_async), cs in groups.items():
    priced = [c.overlapped_ms for c in cs if c.overlapped_ms is not None]
    rows.append({"kind": kind, "async": is_async, "count": len(cs),
                 "with_compute_between": sum(1 for c in cs if c.between),
                 "ops_between": sum(len(c.between) for c in cs),
                 "overlapped_ms": sum(priced) if len(priced) == len(cs) else None})
  return rows
