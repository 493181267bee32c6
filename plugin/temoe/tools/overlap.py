"""What a compiled HLO module allows to overlap: the data dependences between its collectives and its
GEMMs, read from the module's text (`jax.jit(f).lower(...).compile().as_text()`).

Two questions, one per kind of evidence:
  `dependent(module, a, b)`  is there a path of operands from an instruction matching `a` to one matching
                             `b` (either way round)? None means XLA's scheduler is free to run them at once
                             (the structure; any backend, CPU included).
  `between(module, start, done, op)`  in a scheduled module (GPU: async collectives as start / done pairs),
                             the instructions matching `op` that the schedule puts between a collective's
                             start and its done: the overlap the compiled program actually has.
Instructions are matched by a predicate on `Instruction`; GEMMs are recognised inside fusions and calls
(`gemm`): an instruction is a GEMM when it or a computation it calls holds a dot or a cuBLAS custom call.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$", "gemm")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  operands: tuple[str, ...]
  calls: tuple[str, ...]
  op_name: str
  text: str


@dataclasses.dataclass
class Module:
  """Computations (name -> instructions, in the module's order: the schedule where it is scheduled)."""

  computations: dict[str, list[Instruction]]
  entry: str

  def computation_of(self, predicate: Callable[[Instruction], bool]) -> list[str]:
    return [c for c, ins in self.computations.items() if any(predicate(i) for i in ins)]


def parse(text: str) -> Module:
  """The module's computations and instructions (operands, called computations, op_name metadata)."""
  computations, entry, current = {}, "", None
  for line in text.splitlines():
    head = _COMPUTATION.match(line)
    if head and "=" not in line.split("{")[0].split("(")[0]:
      current = head.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, opcode, rest = m.groups()
    args = rest.split(")", 1)[0]
    calls = tuple(c.strip().lstrip("%") for group in _CALLS.findall(rest) for c in group.split(",") if c.strip())
    op_name = _OP_NAME.search(rest)
    computations[current].append(Instruction(name, opcode, tuple(_OPERAND.findall(args)), calls,
                                             op_name.group(1) if op_name else "", line.strip()))
  return Module(computations, entry)


def _holds_gemm(module: Module, computation: str, seen: set) -> bool:
  if computation in seen or computation not in module.computations:
    return False
  seen.add(computation)
  return any(gemm(module, i, seen) for i in module.computations[computation])


def gemm(module: Module, instruction: Instruction, seen: set | None = None) -> bool:
  """Whether `instruction` is a GEMM: a dot, a GEMM custom call, or a fusion / call holding one."""
  if instruction.opcode in ("dot", "ragged-dot"):
    return True
  if instruction.opcode == "custom-call" and any(t in instruction.text for t in _GEMM_TARGETS):
    return True
  seen = set() if seen is None else seen
  return any(_holds_gemm(module, c, seen) for c in instruction.calls)


def reachable(instructions: list[Instruction], sources: set[str]) -> set[str]:
  """Names of the instructions whose operands lead back to any of `sources` (one computation)."""
  users: dict[str, list[str]] = {}
  for i in instructions:
    for o in i.operands:
      users.setdefault(o, []).append(i.name)
  out, todo = set(), list(sources)
  while todo:
    for u in users.get(todo.pop(), ()):
      if u not in out:
        out.add(u)
        todo.append(u)
  return out


def dependent(module: Module, a: Callable[[Instruction], bool], b: Callable[[Instruction], bool],
              computation: str | None = None) -> list[tuple[str, str]]:
  """(from, to) pairs of an `a` and a `b` instruction of `computation` (default: the entry) where one's
  result feeds the other through operands; [] when they are data independent."""
  instructions = module.computations[computation or module.entry]
  first = [i.name for i in instructions if a(i)]
  second = [i.name for i in instructions if b(i)]
  pairs = []
  for x, ys in ((first, set(second)), (second, set(first))):
    for name in x:
      pairs += [(name, y) for y in sorted(reachable(instructions, {name}) & ys)]
  return pairs


def between(module: Module, start: Callable[[Instruction], bool], op: Callable[[Instruction], bool],
            computation: str | None = None) -> dict[str, list[str]]:
  """For each async start matching `start` in a scheduled `computation`, the `op` instructions the schedule
  places after it and before its done (the done is the instruction whose operand is the start)."""
  instructions = module.computations[computation or module.entry]
  out = {}
  for k, s in enumerate(instructions):
    if not start(s):
      continue
    done = next((j for j in range(k + 1, len(instructions)) if s.name in instructions[j].operands
                 and instructions[j].opcode.endswith("-done")), None)
    if done is None:
      continue
    out[s.name] = [i.name for i in instructions[k + 1:done] if op(i)]
  return out
