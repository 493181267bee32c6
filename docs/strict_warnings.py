"""MkDocs hook: keep warnings countable under `mkdocs build --quiet`.

`--quiet` raises the mkdocs logger to ERROR, so warnings (a broken link, a page missing from the nav) are
dropped before strict mode counts them and a strict build passes anyway (MkDocs 1.6.1). `make docs` builds
with `--strict --quiet`; this puts the logger back at WARNING, so `--quiet` hides only the INFO lines.
"""

import logging


def on_config(config):
  logger = logging.getLogger("mkdocs")
  if logger.getEffectiveLevel() > logging.WARNING:
    logger.setLevel(logging.WARNING)
  return config
