"""README.md's headline table is the one bench/headline.py renders from bench/results, so it cannot drift."""

import importlib.util
import json
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load():
  spec = importlib.util.spec_from_file_location("headline", ROOT / "bench" / "headline.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_readme_table_is_generated_from_results():
  headline = load()
  text = (ROOT / "README.md").read_text()
  assert headline.replaced(text) == text, "README.md's headline table differs: python bench/headline.py --write"
  assert text.count(headline.BEGIN) == 1 and text.count(headline.END) == 1


def test_table_follows_the_json(tmp_path, monkeypatch):
  """A changed result changes the table: the numbers are read, not written in."""
  headline = load()
  for name in (headline.LAYER, headline.PROXY, headline.UNROLLED, headline.PLAN):
    shutil.copy(headline.RESULTS / name, tmp_path / name)
  monkeypatch.setattr(headline, "RESULTS", tmp_path)
  before = headline.table()
  proxy = json.loads((tmp_path / headline.PROXY).read_text())
  proxy["marginal_moe_layer"]["ratio"] = 2.5
  (tmp_path / headline.PROXY).write_text(json.dumps(proxy))
  after = headline.table()
  assert before != after and "**2.50x**" in after and "now 2.50x (met)" in after


def test_every_linked_result_exists():
  headline = load()
  for name in (headline.LAYER, headline.PROXY, headline.UNROLLED, headline.PLAN):
    assert (headline.RESULTS / name).is_file(), name


def test_missing_markers_are_refused():
  with pytest.raises(ValueError, match="headline markers"):
    load().replaced("# a README without the table\n")


def test_readme_links_resolve():
  """Every relative link in README.md names a file in the repo (the docs build checks docs/, not the README)."""
  import re

  text = (ROOT / "README.md").read_text()
  targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t}
  missing = sorted(t for t in targets if t and not (ROOT / t).exists())
  assert not missing, missing
  assert any(t.startswith("docs/") for t in targets)
