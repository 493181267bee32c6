"""README states the exit-code contract and the faults table exactly as the code and the tests have them:
`temoe.exits.table()` and `faults.render_table()` (each fault's row is asserted by its e2e test)."""

from __future__ import annotations

import pathlib

import faults
from temoe import exits

README = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_readme_has_the_exit_code_contract():
  assert exits.table() in README, "README's exit-code table drifted from temoe.exits: paste exits.table()"
  assert sorted(exits.MEANINGS) == sorted({exits.DONE, exits.FAILED, exits.NEEDS_PERSON, exits.REQUEUE})


def test_readme_faults_table_is_the_tests_table():
  assert faults.render_table() in README, "README's faults table drifted from tests/faults.py: paste render_table()"


def test_every_fault_names_an_existing_test_that_checks_it():
  tests = pathlib.Path(__file__).resolve().parents[1]
  for name, (_, _, _, where) in faults.FAULTS.items():
    assert f'"{name}"' in (tests / where).read_text(encoding="utf-8"), f"{where} does not check the fault {name!r}"
