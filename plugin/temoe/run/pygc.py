"""The Python garbage collector's settings in temoe's processes.

Importing MaxText and tracing its train step make millions of small container objects that live for the whole
run. With CPython's default thresholds (700, 10, 10) the collector walks the survivors again at every 700
allocations: in a smoke training run whose program was already compiled (`temoe train`, XLA's cache warm) it took
1.4 CPU-s of the imports (1,483 young collections) and 1.3-1.6 CPU-s of the 13 after them. With a young threshold
of 50,000 and the imported modules frozen out of the collector's view: 0.5 and 0.1-0.2 CPU-s. Garbage with
cycles is still collected, later and in larger batches; nothing else changes.
"""

from __future__ import annotations

import gc

THRESHOLDS = (50_000, 10, 10)
"""Young, middle and old generation thresholds (CPython's defaults: 700, 10, 10)."""


def configure() -> None:
  """Sets THRESHOLDS: first thing in a process, so the imports that follow are collected less often."""
  gc.set_threshold(*THRESHOLDS)


def freeze_imports() -> None:
  """Moves every object alive now (the imported modules, their classes and functions: they live as long as the
  process) out of the collector's generations, so no later collection walks them again (nor, in a process forked
  after this, writes to their pages)."""
  gc.collect()
  gc.freeze()
