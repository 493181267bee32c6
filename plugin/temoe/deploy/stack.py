"""`temoe doctor --image`: is the installed stack the one temoe is tested against? No GPU needed.

Run by the Dockerfile right after it installs the stack, so a base image that does not fit fails the
build, not the first training run: MaxText 0.2.5 really installed (not an editable checkout that
shadows it or reads 0.2.5), its own base.yml the one temoe's configs inherit, the seams temoe hooks
and every MaxText module temoe calls (importing them imports the base's libraries MaxText needs), and
a Transformer Engine that defines every name MaxText
0.2.5 and temoe import from it (read from their sources, so the list cannot go stale). TE's modules
are read as source rather than imported: a build host has no NVIDIA driver. Each problem is one line
saying what is wrong and the `--build-arg` (or other change) that fixes it.
"""

from __future__ import annotations

import ast
import base64
import csv
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from importlib import metadata

TE_VERSION = "2.20.2"
"""The Transformer Engine temoe is tested against: the Dockerfile's TE_VERSION default."""

TE_PACKAGES = ("transformer_engine", "transformer_engine_jax")

TE_FIX = f"--build-arg TE_VERSION={TE_VERSION} (installs TE {TE_VERSION}, its JAX extension built against this JAX)"


@dataclasses.dataclass
class Result:
  """What the check found: one line per part of the stack, problems (each one line), notes."""

  lines: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)

  def text(self) -> str:
    out = [f"  {what:<12} {found}" for what, found in self.lines] + [f"note: {n}" for n in self.notes]
    out += [f"temoe doctor --image: {p}" for p in self.problems]
    out.append("stack: " + ("does not fit, see above" if self.problems else "fits"))
    return "\n".join(out)


def _maxtext_version() -> str:
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel

  return seams.MAXTEXT_VERSION


def _checkout_root(path: pathlib.Path) -> pathlib.Path:
  """The source checkout a module file lives in (the first parent with pyproject.toml or .git)."""
  for parent in path.parents:
    if (parent / "pyproject.toml").exists() or (parent / ".git").exists():
      return parent
  return path.parent.parent


def _recorded_hash_ok(dist: metadata.Distribution, relative: str) -> bool | None:
  """Whether `relative`'s content matches the hash in the distribution's RECORD (None: not recorded)."""
  for row in csv.reader((dist.read_text("RECORD") or "").splitlines()):
    if row and row[0] == relative and len(row) > 1 and row[1].startswith("sha256="):
      digest = hashlib.sha256(pathlib.Path(dist.locate_file(relative)).read_bytes()).digest()
      return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == row[1][len("sha256="):]
  return None


def check_maxtext(result: Result) -> pathlib.Path | None:
  """MaxText: version, where `import maxtext` goes, its base.yml; returns its package directory."""
  want = _maxtext_version()
  fix = f"--build-arg MAXTEXT_VERSION={want}"
  try:
    dist = metadata.distribution("maxtext")
  except metadata.PackageNotFoundError:
    result.problems.append(f"MaxText is not installed; temoe hooks MaxText {want}: {fix}.")
    return None
  if dist.version != want:
    result.problems.append(f"maxtext {dist.version} is installed, temoe hooks MaxText {want}: {fix}.")
    return None
  direct = json.loads(dist.read_text("direct_url.json") or "{}")
  spec = importlib.util.find_spec("maxtext")
  origin = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None
  wheel_init = pathlib.Path(dist.locate_file("maxtext/__init__.py")).resolve()
  if direct.get("dir_info", {}).get("editable") or origin != wheel_init:
    where = origin or direct.get("url", "?")
    root = _checkout_root(origin) if origin else pathlib.Path(direct.get("url", "?").removeprefix("file://"))
    result.problems.append(f"`import maxtext` loads {where}, a source checkout, not the maxtext {want} wheel's "
                           f"{wheel_init}: --build-arg MAXTEXT_SRC={root} (the Dockerfile uninstalls and "
                           "removes that checkout).")
    return None
  package = wheel_init.parent
  configs = os.environ.get("MAXTEXT_CONFIGS_DIR")
  if configs and pathlib.Path(configs).resolve() != package / "configs":
    result.problems.append(f"MAXTEXT_CONFIGS_DIR={configs} makes MaxText read another base.yml than MaxText "
                           f"{want}'s {package / 'configs'}: unset it (`ENV MAXTEXT_CONFIGS_DIR=` after FROM).")
    return package
  if not _recorded_hash_ok(dist, "maxtext/configs/base.yml"):
    result.problems.append(f"{package / 'configs' / 'base.yml'} is not the base.yml maxtext {want} installed "
                           f"(changed or missing): {fix} reinstalls it.")
    return package
  result.lines.append(("MaxText", f"{want}, {package} (wheel), base.yml as released"))
  check_configs(result, pathlib.Path("configs"), package / "configs")
  return package


def _base_chain_end(config: pathlib.Path, maxtext_configs: pathlib.Path) -> pathlib.Path:
  """Where `config`'s base_config chain ends, looked up the way MaxText's loader does: beside the
  config first, then in MaxText's configs directory."""
  import yaml  # pylint: disable=import-outside-toplevel

  seen = set()
  while config not in seen:
    seen.add(config)
    base = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("base_config")
    if not isinstance(base, str):
      return config
    nearby = config.parent / base
    config = pathlib.Path(base) if os.path.isabs(base) else nearby if nearby.is_file() else maxtext_configs / base
    config = config.resolve()
  return config


def check_configs(result: Result, configs: pathlib.Path, maxtext_configs: pathlib.Path) -> None:
  """temoe's configs (./configs: /opt/temoe/configs in the image) inherit MaxText's own base.yml."""
  if not configs.is_dir():
    return
  chains = {path: _base_chain_end(path.resolve(), maxtext_configs) for path in sorted(configs.rglob("*.yml"))
            if "base_config" in path.read_text(encoding="utf-8")}
  wrong = {path: end for path, end in chains.items() if end != (maxtext_configs / "base.yml").resolve()}
  if wrong:
    path, end = next(iter(wrong.items()))
    result.problems.append(f"{path} inherits {end}, not MaxText's own {maxtext_configs / 'base.yml'}: a base.yml "
                           "beside temoe's configs, or a base_config path, shadows it.")
    return
  result.lines.append(("configs", f"{len(chains)} in {configs.resolve()} inherit MaxText's base.yml"))


def check_seams(result: Result) -> None:
  """The seams temoe hooks and every MaxText module and name it calls (`seams.check_maxtext`)."""
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel

  fix = f"--build-arg MAXTEXT_VERSION={seams.MAXTEXT_VERSION}"
  try:
    seams.check_maxtext()
  except seams.TemoeSeamError as exc:
    result.problems.append(f"{exc} {fix}.")
    return
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    result.problems.append(f"MaxText {seams.MAXTEXT_VERSION} does not import here ({type(exc).__name__}: {exc}); "
                           "the base image lacks a library it needs: add it, or --build-arg BASE_IMAGE=<an NGC "
                           "JAX MaxText image>.")
    return
  result.lines.append(("seams", f"all there, and the {len(seams.TOUCHPOINTS)} MaxText modules temoe calls import "
                                "(the trainer among them)"))


@functools.cache
def te_imports(root: pathlib.Path) -> dict[tuple[str, str | None], list[str]]:
  """(module, name) -> files under `root` whose code imports it from Transformer Engine; name None
  for `import transformer_engine.x`."""
  found: dict[tuple[str, str | None], list[str]] = {}
  for path in sorted(root.rglob("*.py")):
    try:
      tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in TE_PACKAGES:
        keys = [(node.module, alias.name) for alias in node.names]
      elif isinstance(node, ast.Import):
        keys = [(alias.name, None) for alias in node.names if alias.name.split(".")[0] in TE_PACKAGES]
      else:
        continue
      for key in keys:
        found.setdefault(key, []).append(str(path.relative_to(root)))
  return found


def _module_file(roots: dict[str, pathlib.Path], module: str) -> pathlib.Path | None:
  top, *rest = module.split(".")
  if top not in roots:
    return None
  base = roots[top].joinpath(*rest)
  for candidate in (base / "__init__.py", base.with_suffix(".py")):
    if candidate.is_file():
      return candidate
  return None


def _statements(body):
  """Top-level statements, into if/try/with blocks (where modules define names conditionally)."""
  for node in body:
    yield node
    for field in ("body", "orelse", "finalbody"):
      if isinstance(node, (ast.If, ast.Try, ast.With)) and getattr(node, field, None):
        yield from _statements(getattr(node, field))
    for handler in getattr(node, "handlers", []):
      yield from _statements(handler.body)


def defines(roots: dict[str, pathlib.Path], module: str, name: str | None, seen: frozenset = frozenset()) -> bool:
  """Whether `module` (source under `roots`) defines `name`: a def, class, assignment, import or
  submodule, following `from x import *`. Read from source: nothing is imported."""
  path = _module_file(roots, module)
  if path is None or module in seen:
    return False
  if name is None:
    return True
  if path.name == "__init__.py" and _module_file(roots, f"{module}.{name}"):
    return True
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in _statements(ast.parse(path.read_text(encoding="utf-8")).body):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
      return True
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      return True
    if isinstance(node, ast.Import) and any((a.asname or a.name.split(".")[0]) == name for a in node.names):
      return True
    if isinstance(node, ast.ImportFrom):
      source = node.module or ""
      if node.level:
        source = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [source])])
      for alias in node.names:
        if (alias.asname or alias.name) == name:
          return True
        if alias.name == "*" and defines(roots, source, name, seen | {module}):
          return True
  return False


def _dist_version(*names: str) -> tuple[str, str] | None:
  for name in names:
    try:
      return name, metadata.version(name)
    except metadata.PackageNotFoundError:
      continue
  return None


TE_LOCATE = """
import importlib.util, pathlib
package = pathlib.Path(importlib.util.find_spec("transformer_engine").submodule_search_locations[0])
spec = importlib.util.spec_from_file_location("transformer_engine.common", package / "common" / "__init__.py")
loader = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loader)
print(loader._get_shared_object_file("jax"))
"""
"""How TE finds its JAX extension: `load_framework_extension("jax")` loads the file its
`_get_shared_object_file("jax")` returns (editable build: the top level; source build: the package; PyPI:
transformer_engine/wheel_lib/, which no import path finds). Only TE's loader module is run, not the package
(whose import loads the extension and JAX)."""


def te_jax_extension() -> tuple[pathlib.Path | None, str]:
  """The JAX extension TE's own loader would load, asked of TE in a fresh process with its build-time switch
  NVTE_PROJECT_BUILDING=1 (its loader module then loads no CUDA library: a build host has no driver);
  (None, why) where it finds none."""
  environ = {**os.environ, "NVTE_PROJECT_BUILDING": "1"}
  environ.pop("NVTE_RELEASE_BUILD", None)
  found = subprocess.run([sys.executable, "-c", TE_LOCATE], capture_output=True, text=True, timeout=300,
                         check=False, env=environ)
  lines = found.stdout.strip().splitlines()
  if found.returncode or not lines or not pathlib.Path(lines[-1]).is_file():
    last = (found.stderr.strip().splitlines() or ["?"])[-1]
    return None, "" if "Could not find shared object file" in last else f"; TE's loader: {last}"
  return pathlib.Path(lines[-1]), ""


def check_te(result: Result, maxtext_dir: pathlib.Path | None) -> None:
  """Transformer Engine: installed, one version across its parts, every name MaxText and temoe import."""
  te = _dist_version("transformer_engine", "transformer-engine")
  spec = importlib.util.find_spec("transformer_engine")
  if te is None or spec is None or not spec.submodule_search_locations:
    result.problems.append(f"Transformer Engine is not installed: {TE_FIX}.")
    return
  version = te[1]
  parts = {}
  for dist in ("transformer_engine_jax", "transformer_engine_cu12", "transformer_engine_cu13"):
    found = _dist_version(dist)
    if found:
      parts[dist] = found[1]
  mixed = {d: v for d, v in parts.items() if v != version}
  if mixed:
    result.problems.append(f"Transformer Engine's parts disagree: transformer_engine {version}, " +
                           ", ".join(f"{d} {v}" for d, v in mixed.items()) + f": {TE_FIX}.")
    return
  cuda = os.environ.get("CUDA_VERSION", "").split(".")[0]
  core = [d for d in parts if d.startswith("transformer_engine_cu")]
  if cuda and core and core[0] != f"transformer_engine_cu{cuda}":
    result.problems.append(f"{core[0]} {version} is installed but this image's CUDA is {os.environ['CUDA_VERSION']}: "
                           f"--build-arg TE_CUDA_MAJOR={cuda}.")
    return
  extension, why = te_jax_extension()
  if extension is None:
    result.problems.append(f"Transformer Engine {version} has no JAX extension (transformer_engine_jax{why}): {TE_FIX}.")
    return
  import temoe  # pylint: disable=import-outside-toplevel

  roots = {"transformer_engine": pathlib.Path(spec.submodule_search_locations[0])}
  wanted = {}
  for who, root in (("MaxText", maxtext_dir), ("temoe", pathlib.Path(temoe.__file__).parent)):
    for key, files in te_imports(root).items() if root else ():
      if key[0] != "transformer_engine_jax":  # the extension module: found above, compiled, no source
        wanted.setdefault(key, f"{who} {files[0]}")
  missing = [(m, n, who) for (m, n), who in sorted(wanted.items(), key=str) if not defines(roots, m, n)]
  if missing:
    names = "; ".join(f"{m}{'.' + n if n else ''} ({who})" for m, n, who in missing)
    result.problems.append(f"Transformer Engine {version} lacks what MaxText {_maxtext_version()} and temoe import: "
                           f"{names}: {TE_FIX}.")
    return
  loads = subprocess.run([sys.executable, "-c", "import transformer_engine.jax"], capture_output=True, text=True,
                         timeout=300, check=False)
  last = (loads.stderr.strip().splitlines() or ["?"])[-1]
  if loads.returncode and "libcuda.so" in loads.stderr:
    result.notes.append(f"transformer_engine.jax loads only with the NVIDIA driver ({last}); "
                        "`docker run --gpus all IMAGE doctor` checks it on a GPU host.")
  elif loads.returncode:
    result.problems.append(f"transformer_engine.jax does not import ({last}): {TE_FIX}.")
    return
  pinned = "" if version == TE_VERSION else f"; temoe is tested against {TE_VERSION}"
  result.lines.append(("TE", f"{version}{pinned}, defines the {len(wanted)} names MaxText and temoe import"))


def check(without_te: bool = False) -> Result:
  """Every check, in the order a fix is most likely to clear the ones after it."""
  result = Result()
  if sys.version_info[:2] != (3, 12):
    result.problems.append(f"Python {sys.version_info[0]}.{sys.version_info[1]}: MaxText {_maxtext_version()} "
                           "needs 3.12: --build-arg BASE_IMAGE=<an NGC JAX MaxText image on Python 3.12>.")
  result.lines.append(("Python", sys.version.split()[0]))
  for requirement in metadata.requires("temoe") or []:
    name = requirement.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
    if "extra ==" not in requirement and name != "maxtext" and _dist_version(name) is None:
      result.problems.append(f"temoe needs {requirement}, not installed: `pip install .` in /opt/temoe installs it.")
  maxtext_dir = check_maxtext(result)
  if not result.problems:
    check_seams(result)
  if without_te:
    result.lines.append(("TE", "not checked (--without-te: a CPU environment)"))
  else:
    check_te(result, maxtext_dir)
  return result


def main(without_te: bool = False) -> int:
  result = check(without_te)
  print(result.text())
  return 1 if result.problems else 0
