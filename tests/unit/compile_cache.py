"""JAX's persistent compilation cache for the interpret-mode kernel tests, every program cached however small.

In Pallas' GPU interpret mode each kernel call is traced again (a fresh closure, so jit's in-memory cache misses)
and runs its body primitive by primitive, each compiled on its own; most of these programs are the same HLO as one
compiled a moment before. The persistent cache is keyed by the HLO, the compile options and XLA_FLAGS, so such a
program is loaded (the same executable: the same numbers) instead of compiled: test_mosaic_tokens 130.5 -> 79.2
CPU-s from an empty cache in one process. The directory is the session's (conftest.JAX_CACHE, which MaxText's
runs share), so a test process also loads what another compiled."""

from __future__ import annotations

import contextlib

_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


@contextlib.contextmanager
def persistent_cache():
  """Within: every compile goes through the session's cache; after: this process's settings as they were."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel

  from conftest import JAX_CACHE  # pylint: disable=import-outside-toplevel

  before = {name: getattr(jax.config, name) for name in _SETTINGS}
  compilation_cache.reset_cache()  # JAX decides once per process whether a cache is used: decide again
  jax.config.update("jax_compilation_cache_dir", JAX_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  try:
    yield
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()
