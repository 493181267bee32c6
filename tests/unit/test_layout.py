"""The package layout is the architecture: who may import what, checked on the sources."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from conftest import HANG_S, ROOT

PACKAGE = ROOT / "plugin" / "temoe"


def modules() -> dict[str, pathlib.Path]:
  return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}


def imports(path: pathlib.Path) -> set[str]:
  """Every module `path` imports, at any depth (function-local imports included)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      found.add(node.module)
      found.update(f"{node.module}.{a.name}" for a in node.names)
  return found


def importers(prefix: str) -> set[str]:
  return {m for m, p in modules().items() if any(i == prefix or i.startswith(prefix + ".") for i in imports(p))}


def test_only_temoe_maxtext_imports_maxtext():
  outside = {m for m in importers("maxtext") if not m.startswith("temoe.maxtext")}
  assert not outside, f"modules importing MaxText outside temoe.maxtext: {sorted(outside)}"


def test_moe_core_knows_no_maxtext_and_only_its_te_kernel_imports_te():
  core = {m for m in modules() if m.startswith("temoe.moe")}
  assert not core & importers("temoe.maxtext"), "the MoE core imports temoe.maxtext"
  assert core & importers("transformer_engine") <= {"temoe.moe.experts.te"}


def test_no_module_shadows_the_standard_library():
  shadowing = {m for m in modules() if m.rsplit(".", 1)[-1] in sys.stdlib_module_names}
  assert not shadowing, f"temoe modules named like standard-library modules: {sorted(shadowing)}"


def test_no_private_jax_imports():
  private = {m for m in importers("jax._src")}
  assert not private, f"modules importing jax._src: {sorted(private)}"


BLOCK_JAX = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("jax", "jaxlib", "maxtext", "transformer_engine", "flax"):
      raise ImportError(f"{name} imported by a module that must run without it")
sys.meta_path.insert(0, Block())
import importlib
for name in sys.argv[1:]:
  importlib.import_module(name)
print("ok")
"""


@pytest.mark.parametrize("package", ["temoe.deploy", "temoe.recipes", "temoe.hardware", "temoe.cli"])
def test_deploy_side_imports_without_jax(package):
  names = sorted(m for m in modules() if m == package or m.startswith(package + "."))
  names = [n.removesuffix(".__init__") for n in names if not n.endswith("__main__")]
  proc = subprocess.run([sys.executable, "-c", BLOCK_JAX, *names], capture_output=True, text=True, timeout=HANG_S)
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
