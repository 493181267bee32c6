"""temoe: Transformer Engine MoE for stock MaxText.

`register()` plugs temoe's MoE block into MaxText's routed-MoE layer. Nothing runs at import.
"""

__version__ = "0.1.0"


def register() -> None:
  """Hooks temoe into the installed MaxText (idempotent); see `temoe.maxtext_seam`."""
  from temoe import maxtext_seam  # pylint: disable=import-outside-toplevel

  maxtext_seam.install()


__all__ = ["register", "__version__"]
