"""temoe's processes run with the collector settings of temoe/run/pygc.py: the `temoe` program sets them first
thing, `temoe train` freezes its imports before its checks; freeze_imports takes what is alive out of the
collector's view."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import SMOKE
from temoe.run import pygc

TRAIN = """
import gc, json, sys
from temoe import cli
from temoe.run import preflight
def check(*args, **kwargs):  # the first step after the imports: what the collector is set to there, then stop
  print(json.dumps([list(gc.get_threshold()), gc.get_freeze_count()]))
  sys.exit(0)
preflight.check = check
sys.argv = ["temoe", "train", sys.argv[1], "dataset_type=synthetic"]
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


def probe(code: str, *args: str):
  done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_temoe_train_collects_with_pygcs_thresholds_and_has_frozen_its_imports_before_its_checks():
  thresholds, frozen = probe(TRAIN, SMOKE)
  assert thresholds == list(pygc.THRESHOLDS) != [700, 10, 10]
  assert frozen > 100_000, frozen  # JAX's, MaxText's and temoe's modules: a fresh process's freeze count is 0


def test_freeze_imports_leaves_the_collector_nothing_of_the_imports_to_walk():
  tracked, frozen, left = probe(FREEZE)
  assert tracked > 1000 and frozen >= 0.9 * tracked and left < 100, (tracked, frozen, left)
