"""Builds the stand-in of the NGC JAX MaxText base (tests/image/standin/Dockerfile) through the Docker CLI,
once per set of inputs: its tag is a hash of everything that goes into it, so a second run finds it and
builds nothing.

Two steps, neither pulling an image from any registry:
  rootfs   Debian 12 made with `debootstrap` from the mirror this host's apt uses, plus this host's
           Python 3.12 copied to the same path (Debian has none), imported as an image (`docker import`);
  standin  tests/image/standin/Dockerfile on that rootfs, from a temporary build context holding the
           Dockerfile, requirements.lock and this host's CA bundle (made here, never committed).
debootstrap needs root; so does the rootfs's ownership.

    python tests/image/standin.py          # prints the stand-in's tag (builds what is missing)
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCKERFILE = HERE / "standin" / "Dockerfile"
LOCK = ROOT / "requirements.lock"

SUITE = "bookworm"
PYTHON_VERSION = "3.12"
RUNTIME_PACKAGES = ("ca-certificates", "libssl3", "libsqlite3-0", "libffi8", "libbz2-1.0", "liblzma5", "zlib1g",
                    "libreadline8", "libncursesw6", "libuuid1", "libexpat1", "libnsl2", "libtirpc3")
"""What the copied CPython's own extension modules link against (ldd of its lib-dynload), from Debian."""
PYTHON_SKIP = ("lib/python3.12/test", "lib/python3.12/site-packages")
"""Left out of the copy: CPython's own test suite (127 MB) and whatever this host installed into its
site-packages (pip is bootstrapped again with ensurepip, so the stand-in's site-packages start empty)."""
ROOTFS_RECIPE = 1
"""Bump when build_rootfs changes what it makes (the rootfs's tag hashes this, not the file)."""
CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


class StandinError(RuntimeError):
  """A step of the stand-in's build failed; the message names the step and the end of its output."""


def python_prefix() -> pathlib.Path:
  """This host's Python 3.12 installation: the one running this, else pyenv's newest 3.12."""
  if sys.version_info[:2] == (3, 12):
    return pathlib.Path(sys.base_prefix)
  pyenv = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv")) / "versions"
  found = sorted(pyenv.glob(f"{PYTHON_VERSION}.*"))
  if not found:
    raise StandinError(f"no Python {PYTHON_VERSION} on this host to copy into the stand-in")
  return found[-1]


def debian_mirror() -> str:
  """The Debian mirror apt uses here (deb822 sources, else sources.list), else Debian's own."""
  for path in (pathlib.Path("/etc/apt/sources.list.d/debian.sources"), pathlib.Path("/etc/apt/sources.list")):
    if path.is_file():
      for line in path.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if words[:1] == ["URIs:"] and len(words) > 1 and "security" not in words[1]:
          return words[1]
        if words[:1] == ["deb"] and len(words) > 2 and "security" not in words[-2]:
          return words[-3] if words[1].startswith("[") else words[1]
  return "http://deb.debian.org/debian"


def _digest(*parts: str | bytes) -> str:
  h = hashlib.sha256()
  for part in parts:
    h.update(part if isinstance(part, bytes) else part.encode())
    h.update(b"\0")
  return h.hexdigest()[:12]


def rootfs_tag(prefix: pathlib.Path) -> str:
  version = subprocess.run([str(prefix / "bin" / "python3"), "-c", "import sys; print(sys.version)"],
                           capture_output=True, text=True, check=True).stdout
  return "temoe-standin-rootfs:" + _digest(SUITE, debian_mirror(), ",".join(RUNTIME_PACKAGES), str(prefix), version,
                                           ",".join(PYTHON_SKIP), str(ROOTFS_RECIPE))


def standin_tag(rootfs: str) -> str:
  return "temoe-standin:" + _digest(rootfs, DOCKERFILE.read_bytes(), LOCK.read_bytes())


ENVIRON: dict[str, str] = dict(os.environ)
"""The environment the Docker CLI runs in (DOCKER_HOST: which engine); `ensure` sets it."""


def _run(step: str, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
  kwargs.setdefault("env", ENVIRON)
  done = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
  if done.returncode:
    raise StandinError(f"{step} failed ({' '.join(cmd[:3])} ... exit {done.returncode}):\n"
                       f"{(done.stdout + done.stderr)[-6000:]}")
  return done


def image_exists(tag: str) -> bool:
  inspect = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, check=False, env=ENVIRON)
  return inspect.returncode == 0


def build_rootfs(tag: str, prefix: pathlib.Path, log=print) -> None:
  """Debian 12 (debootstrap, minbase) with this host's Python at `prefix`, imported as `tag`."""
  if shutil.which("debootstrap") is None:
    raise StandinError("debootstrap is not installed (Debian: apt-get install debootstrap; "
                       "tests/image/engine.sh install does it)")
  with tempfile.TemporaryDirectory(prefix="temoe-rootfs-", dir=os.environ.get("TEMOE_IMAGE_TMP")) as tmp:
    root = pathlib.Path(tmp) / "rootfs"
    log(f"standin: debootstrap {SUITE} from {debian_mirror()} ...")
    _run("debootstrap", ["debootstrap", "--variant=minbase", f"--include={','.join(RUNTIME_PACKAGES)}", SUITE,
                         str(root), debian_mirror()])
    target = root / prefix.relative_to("/")
    skip = {prefix / p for p in PYTHON_SKIP}
    shutil.copytree(prefix, target, symlinks=True, ignore=lambda d, names: [n for n in names
                                                                             if pathlib.Path(d) / n in skip])
    (target / "lib" / "python3.12" / "site-packages").mkdir()
    _run("ensurepip", ["chroot", str(root), str(prefix / "bin" / "python3.12"), "-m", "ensurepip", "--default-pip"])
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
      for path in (root / cache).glob("*.deb" if "archives" in cache else "*_*"):
        path.unlink()
    log(f"standin: importing the rootfs as {tag} ...")
    tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    try:
      _run("docker import", ["docker", "import", "-", tag], stdin=tar.stdout)
    finally:
      tar.stdout.close()
      tar.wait()


def build_standin(tag: str, rootfs: str, prefix: pathlib.Path, log=print) -> None:
  bundle = next((p for p in CA_BUNDLES if os.path.isfile(p)), None)
  if bundle is None:
    raise StandinError(f"no CA bundle on this host ({', '.join(CA_BUNDLES)})")
  with tempfile.TemporaryDirectory(prefix="temoe-standin-ctx-") as ctx:
    shutil.copy(DOCKERFILE, ctx)
    shutil.copy(LOCK, ctx)
    shutil.copy(bundle, pathlib.Path(ctx) / "host-ca.crt")
    log(f"standin: building {tag} on {rootfs} ...")
    _run("stand-in build", ["docker", "build", "--build-arg", f"ROOTFS={rootfs}", "--build-arg",
                            f"PYTHON_PREFIX={prefix}", "-t", tag, ctx], env={**ENVIRON, "DOCKER_BUILDKIT": "0"})


def ensure(log=print, environ: dict[str, str] | None = None) -> str:
  """The stand-in's tag, built first if the engine (`environ`'s DOCKER_HOST, else the default) lacks it."""
  ENVIRON.clear()
  ENVIRON.update(environ or os.environ)
  prefix = python_prefix()
  rootfs = rootfs_tag(prefix)
  tag = standin_tag(rootfs)
  if image_exists(tag):
    return tag
  if not image_exists(rootfs):
    build_rootfs(rootfs, prefix, log)
  build_standin(tag, rootfs, prefix, log)
  return tag


if __name__ == "__main__":
  try:
    print(ensure(log=lambda line: print(line, file=sys.stderr)))
  except StandinError as exc:
    print(f"standin: {exc}", file=sys.stderr)
    sys.exit(1)
