"""MaxText's assets (tokenizers) as its pip wheel ships them. Run when `temoe.maxtext` is first
imported, so whichever temoe path reaches MaxText first, MaxText reads the right root."""

from __future__ import annotations

import importlib.util
import os
import sys


def use_packaged_assets() -> None:
  """Points MaxText at the assets its pip wheel ships (tokenizers), not at a source checkout's path.

  MaxText 0.2.5 derives MAXTEXT_ASSETS_ROOT from a repo layout a pip install lacks; its
  environment variable of that name is the documented override, read once at import.
  """
  if "MAXTEXT_ASSETS_ROOT" in os.environ or "maxtext.utils.globals" in sys.modules:
    return
  spec = importlib.util.find_spec("maxtext")
  for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
    if os.path.isdir(os.path.join(root, "assets", "tokenizers")):
      os.environ["MAXTEXT_ASSETS_ROOT"] = os.path.join(root, "assets")
      return
