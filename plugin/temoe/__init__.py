"""temoe: Transformer Engine MoE for stock MaxText.

`register()` plugs temoe's MoE block into MaxText's routed-MoE layer. Nothing runs at import.
"""

__version__ = "0.1.0"


def register() -> None:
  """Hooks temoe into the installed MaxText (idempotent); see `temoe.maxtext.seams`."""
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel

  seams.install()


__all__ = ["register", "__version__"]
