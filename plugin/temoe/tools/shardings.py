"""Which leaves of a train state a layout cannot shard: JAX requires each sharded dimension of a jit's inputs and
outputs to split evenly over its mesh axes (`IndivisibleError`), and MaxText's train state is exactly that, so a
layout whose axes do not divide a parameter fails in MaxText's first compile (on a GPU, behind Transformer
Engine's context manager, as "generator didn't stop after throw()"). Read off MaxText's abstract state: nothing
is compiled or allocated."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Indivisible:
  path: str  # the leaf, as MaxText's state tree names it
  shape: tuple[int, ...]
  dim: int
  axes: tuple[str, ...]  # the mesh axes the dimension is sharded over
  ways: int  # their product

  def describe(self) -> str:
    return (f"{self.path} {list(self.shape)}: dimension {self.dim} ({self.shape[self.dim]}) does not split "
            f"{self.ways} ways over {' x '.join(self.axes)}")


def spec_axes(spec, i: int) -> tuple[str, ...]:
  """The mesh axes a PartitionSpec names for dimension `i` (none past its end)."""
  entry = spec[i] if i < len(spec) else None
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Dimension:
  path: str
  shape: tuple[int, ...]
  dim: int
  axes: tuple[str, ...]  # every mesh axis its spec names, whatever their sizes


def dimensions(state) -> list[Dimension]:
  """Every sharded dimension of `state` (ShapeDtypeStructs or arrays with NamedShardings), one per distinct
  (size, axes), in tree order: what any mesh of the same axis names must split evenly."""
  import jax  # pylint: disable=import-outside-toplevel

  out, seen = [], set()
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or not hasattr(sharding, "spec"):
      continue
    for i, size in enumerate(leaf.shape):
      axes = spec_axes(sharding.spec, i)
      if axes and (size, axes) not in seen:
        seen.add((size, axes))
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        out.append(Dimension(name.removesuffix("/value"), tuple(leaf.shape), i, axes))
  return out


def indivisible_on(dims: list[Dimension], sizes: dict[str, int]) -> list[Indivisible]:
  """The dimensions of `dims` that a mesh of axis `sizes` does not split evenly."""
  out = []
  for d in dims:
    axes = tuple(a for a in d.axes if sizes.get(a, 1) > 1)
    ways = 1
    for a in axes:
      ways *= sizes[a]
    if ways > 1 and d.shape[d.dim] % ways:
      out.append(Indivisible(d.path, d.shape, d.dim, axes, ways))
  return out


def indivisible(state) -> list[Indivisible]:
  """The dimensions of `state` that its own shardings' mesh does not split evenly."""
  import jax  # pylint: disable=import-outside-toplevel

  leaves = [x for x in jax.tree_util.tree_leaves(state) if hasattr(getattr(x, "sharding", None), "mesh")]
  return indivisible_on(dimensions(state), dict(leaves[0].sharding.mesh.shape)) if leaves else []


def refusal(found: list[Indivisible], limit: int = 2) -> str:
  """One line for a layout that cannot shard its state ('' when it can): the first leaves, and how many more."""
  if not found:
    return ""
  more = f" (and {len(found) - limit} more)" if len(found) > limit else ""
  return ("the train state does not shard evenly over this mesh (JAX's IndivisibleError at MaxText's first compile): "
          + "; ".join(f.describe() for f in found[:limit]) + more)


def sweep_refusal(found: list[Indivisible]) -> str:
  """refusal() without the ways, so that the sweep's layouts refused for one leaf's dimension group together."""
  if not found:
    return ""
  f = found[0]
  return (f"the train state does not shard evenly (JAX's IndivisibleError at MaxText's first compile): {f.path} "
          f"{list(f.shape)}, dimension {f.dim} ({f.shape[f.dim]}) over {' x '.join(f.axes)}")
