"""The record each process of a jax.distributed job sends its peers about its preflight
(`temoe.run.distributed.encode` / `decode`); the exchange itself: tests/e2e/test_preflight_agreement.py."""

from __future__ import annotations

import pytest

from temoe.run import distributed


@pytest.mark.parametrize("kind", distributed.KINDS)
def test_a_record_round_trips_its_kind_and_line(kind):
  line = "run directory /data/runs/é is in use by another temoe train (pid 12 on node-3)"
  record = distributed.encode(kind, line)
  assert record.shape == (distributed.LINE_BYTES + 1,) and distributed.decode(record) == (kind, line)


def test_a_line_too_long_is_cut_whole_characters_and_marked():
  kind, line = distributed.decode(distributed.encode(distributed.FAILED, "é" * distributed.LINE_BYTES))
  assert kind == distributed.FAILED and line.endswith("...") and set(line[:-3]) == {"é"}
  assert len(line.encode("utf-8")) <= distributed.LINE_BYTES

