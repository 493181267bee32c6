"""temoe's processes run with the collector settings of temoe/run/pygc.py: the `temoe` program sets them first
thing; freeze_imports takes what is alive out of the collector's view."""

from __future__ import annotations

import json
import subprocess
import sys

from temoe.run import pygc

THRESHOLDS = """
import gc, sys
from temoe import cli
cli.train = lambda args: print(list(gc.get_threshold())) or 0
sys.argv = ["temoe", "train", "c.yml"]
sys.exit(cli.main())
"""

FREEZE = """
import gc, json
import temoe.cli
from temoe.run import pygc
tracked = len(gc.get_objects())
pygc.freeze_imports()
print(json.dumps([tracked, gc.get_freeze_count(), len(gc.get_objects())]))
"""


def probe(code: str):
  return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_the_temoe_program_collects_with_pygcs_thresholds():
  assert probe(THRESHOLDS) == list(pygc.THRESHOLDS) != [700, 10, 10]


def test_freeze_imports_leaves_the_collector_nothing_of_the_imports_to_walk():
  tracked, frozen, left = probe(FREEZE)
  assert tracked > 1000 and frozen >= 0.9 * tracked and left < 100, (tracked, frozen, left)
