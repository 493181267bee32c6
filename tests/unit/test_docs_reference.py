"""The docs' reference pages (CLI, flags, recipe registry) are the ones bench/docs_reference.py generates from
the code: a changed command, flag or recipe that is not regenerated fails here."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from conftest import HANG_S

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load():
  spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "bench" / "docs_reference.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("page", ["cli.md", "flags.md", "recipes.md"])
def test_reference_page_is_generated(page):
  reference = load()
  path = reference.REFERENCE / page
  assert path.read_text() == reference.PAGES[page](), f"{path} is stale: python bench/docs_reference.py --write"


def test_pages_name_every_command_flag_and_recipe():
  """The generators read the registries: each entry appears on its page (the pages are checked against the
  generators above, so the committed pages are read here)."""
  reference = load()
  from temoe import cli, recipes

  cli_page, recipes_page = ((reference.REFERENCE / name).read_text() for name in ("cli.md", "recipes.md"))
  assert all(f"## temoe {name}" in cli_page for name in cli.SUBCOMMANDS)
  assert all(f"| `{name}` |" in recipes_page for name in recipes.REGISTRY)


def test_docs_plots_are_drawn_from_the_canonical_results(tmp_path):
  """docs/assets' plots are what bench/plots.py --docs draws from bench/results now (matplotlib pinned, Agg)."""
  spec = importlib.util.spec_from_file_location("plots", ROOT / "bench" / "plots.py")
  plots = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(plots)
  written = plots.docs_plots(str(ROOT / "bench" / "results"), str(tmp_path))
  assert len(written) == 4
  for path in map(pathlib.Path, written):
    committed = ROOT / "docs" / "assets" / path.name
    assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: python bench/plots.py --docs"


def test_quiet_strict_docs_build_fails_on_a_broken_link(tmp_path):
  """`make docs` builds with --strict --quiet; MkDocs' --quiet alone would drop the warnings strict mode counts
  (docs/strict_warnings.py keeps them), so a broken link must still fail the build."""
  shutil.copytree(ROOT / "docs", tmp_path / "docs")
  shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
  with open(tmp_path / "docs" / "design.md", "a") as f:
    f.write("\n[a page that does not exist](no-such-page.md)\n")
  done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                         str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
                        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
  assert done.returncode != 0 and "no-such-page.md" in done.stderr, done.stderr[-2000:]
