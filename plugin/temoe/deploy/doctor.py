"""`temoe doctor`: can this machine train with temoe's TE backend, and is the profile in force?

One line per check (GPU and architecture, Transformer Engine and its JAX extension, cuBLAS against
what TE's grouped GEMM needs, NCCL, MaxText and the seams temoe hooks, the environment profile),
then what to do about each problem. Exit 1 when a problem blocks a GPU run with the TE backend;
warnings (a recipe that cannot run, a profile setting that is missing or overridden) do not.
The checks reuse `temoe.hardware` and `temoe.maxtext.seams`; this module only reports.
`temoe doctor --image` checks the installed stack instead, without a GPU (`temoe.deploy.stack`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import importlib.util
import os
import sys

from temoe import __version__, oneline
from temoe.deploy import env

NO_GPU_FIX = ("run on a GPU host with the NVIDIA driver (`nvidia-smi` works), in the image with "
              "`docker run --gpus all`, and with JAX_PLATFORMS unset or including cuda")


@dataclasses.dataclass
class Report:
  """What `temoe doctor` prints: checks, problems (exit 1) and warnings."""

  lines: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)
  warnings: list[str] = dataclasses.field(default_factory=list)

  def text(self) -> str:
    out = [f"temoe doctor ({__version__})"] + [f"  {what:<9} {result}" for what, result in self.lines]
    out += [f"problem: {p}" for p in self.problems] + [f"warning: {w}" for w in self.warnings]
    out.append("ready: " + ("no, see the problems above" if self.problems else "yes"))
    return "\n".join(out)


def nccl_version() -> tuple[int, int, int] | None:
  """The NCCL this process would load (already mapped, pip's nvidia wheel, then the system's)."""
  paths = []
  try:
    with open("/proc/self/maps", encoding="utf-8") as maps:
      paths += sorted({line.split()[-1] for line in maps if "libnccl.so" in line})
  except OSError:
    pass
  spec = importlib.util.find_spec("nvidia")
  for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
    paths += sorted(glob.glob(os.path.join(root, "nccl", "lib", "libnccl.so*")))
  for path in paths + ["libnccl.so.2"]:
    try:
      code = ctypes.c_int()
      if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) == 0:
        c = code.value  # NCCL_VERSION_CODE: X*10000+Y*100+Z since 2.9, X*1000+Y*100+Z before
        return (c // 10000, c // 100 % 100, c % 100) if c >= 10000 else (c // 1000, c // 100 % 10, c % 100)
    except (OSError, AttributeError):
      continue
  return None


def _version(parts) -> str:
  return ".".join(map(str, parts))


def diagnose(plat, environ: dict[str, str], seam_error: str | None, nccl: tuple[int, int, int] | None) -> Report:
  """The report for a `temoe.hardware.Platform`, an environment, MaxText's seam check and NCCL."""
  from temoe import recipes  # pylint: disable=import-outside-toplevel
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel

  report = Report()
  report.lines.append(("GPU", plat.describe()))
  arch = env.arch_of(plat.compute_capability)
  gpu = plat.device_platform == "gpu"
  if not gpu:
    report.problems.append(f"no GPU: this process sees {plat.device_platform} devices only; {NO_GPU_FIX}.")
  else:
    report.lines.append(("arch", arch or f"sm_{_version(plat.compute_capability or ('?',))}: not Hopper/Blackwell"))
    if arch is None:
      report.warnings.append("the profile has per-architecture settings for Hopper and Blackwell only; "
                             "this GPU gets the shared ones.")
  if gpu and plat.te_usable:
    report.lines.append(("TE", f"Transformer Engine {plat.te_version}, JAX extension loads"))
  elif gpu:
    report.lines.append(("TE", f"not usable: {plat.te_error}"))
    report.problems.append(f"Transformer Engine's JAX extension does not load ({plat.te_error}); use an NGC JAX "
                           "MaxText image (ghcr.io/nvidia/jax:maxtext-*) or install transformer_engine[jax] "
                           "built for this CUDA; until then only te_no_quant runs (temoe's Hopper kernels or xla).")
  if gpu:
    need = _version(recipes.grouped_gemm_min_cublas(plat.compute_capability))
    have = _version(plat.cublas_version) if plat.cublas_version else "not found"
    report.lines.append(("cuBLAS", f"{have}; TE's bf16 grouped GEMM needs >= {need} on this GPU"))
  if gpu:
    picks = {}  # recipe -> the GPU kernel `te_moe_backend=auto` runs it on here
    for recipe in recipes.RECIPES:
      kernel = next((k for k in recipes.REGISTRY[recipe].align if k != "xla" and not recipes.why_not(recipe, k, plat)), None)
      if kernel:
        picks[recipe] = kernel
      else:
        first = next(k for k in recipes.REGISTRY[recipe].align if k != "xla")
        report.warnings.append(f"te_gmm_quantization={recipe}: {recipes.why_not(recipe, first, plat)}")
    report.lines.append(("recipes", ", ".join(f"{r} ({k})" for r, k in picks.items()) or "none on a GPU kernel"))
    te_bf16 = recipes.why_not("te_no_quant", "te", plat) if plat.te_usable else None
    if te_bf16 and picks.get("te_no_quant"):  # it runs on another kernel; te_moe_backend=te would not
      report.warnings.append(f"te_gmm_quantization=te_no_quant with te_moe_backend=te: {te_bf16}")
    if not picks:
      report.problems.append("no te_gmm_quantization recipe runs on a GPU kernel here (FP8 needs sm_89+, temoe's "
                             "kernels Hopper); use a Hopper or Blackwell GPU, or te_moe_backend=xla.")
  report.lines.append(("NCCL", _version(nccl) if nccl else "not found"))
  if gpu and nccl is None:
    report.warnings.append("NCCL not found: multi-GPU runs need it (the NGC JAX images ship it).")
  report.lines.append(("MaxText", seam_error or f"{seams.MAXTEXT_VERSION}, with every seam and touchpoint temoe "
                                                 "uses (temoe.maxtext.seams.check_maxtext)"))
  if seam_error:
    report.problems.append(seam_error)
  _profile(report, arch, environ)
  _hazards(report, plat, environ, nccl)
  _mocked_network(report, environ)
  return report


def mocked_processes(environ: dict[str, str]) -> int:
  """How many processes JAX's GPU client mocks (JAX_MOCK_GPU_TOPOLOGY "<slices>x<hosts>x<devices>" or
  MOCK_NUM_GPU_PROCESSES); 0 when the network is real. A malformed topology counts as mocked: JAX refuses it."""
  topology = environ.get("JAX_MOCK_GPU_TOPOLOGY", "").replace(" ", "")
  if topology:
    try:
      slices, hosts, _ = topology.split("x", 2)
      return int(slices) * int(hosts)
    except ValueError:
      return -1
  try:
    return int(environ.get("MOCK_NUM_GPU_PROCESSES", "0") or 0)
  except ValueError:
    return -1


def _mocked_network(report: Report, environ: dict[str, str]) -> None:
  """Under JAX's mock GPU topology the process is one rank of a job with mocked NCCL (what bench/one_rank.py
  measures), never a training run: say what that measurement can and cannot tell."""
  n = mocked_processes(environ)
  if not n:
    return
  what = environ.get("JAX_MOCK_GPU_TOPOLOGY") or f"MOCK_NUM_GPU_PROCESSES={environ.get('MOCK_NUM_GPU_PROCESSES')}"
  report.lines.append(("network", f"mocked NCCL ({what}{f', {n} processes' if n > 0 else ', malformed'}): "
                                  "one rank of the job runs here, collectives move no data"))
  report.problems.append(
      "JAX's mock GPU topology is set: this process is one rank of a mocked job, not a training run. A one-rank "
      "measurement (bench/one_rank.py) tells the rank's compute at the job's real shapes, the compiled step's peak "
      "HBM and which collectives the schedule runs async beside what compute; it cannot tell anything of the "
      "network (bandwidth, NCCL's algorithms, stragglers, contention) nor a real exchange's routing counts. "
      "Unset JAX_MOCK_GPU_TOPOLOGY and MOCK_NUM_GPU_PROCESSES to train.")


def _hazards(report: Report, plat, environ: dict[str, str], nccl) -> None:
  """Known scale hazards this machine's GPU, XLA_FLAGS and NCCL run into (temoe.deploy.hazards)."""
  from temoe import hardware  # pylint: disable=import-outside-toplevel
  from temoe.deploy import hazards  # pylint: disable=import-outside-toplevel

  gpu = hardware.gpu_of_kind(plat.device_kind) if plat.device_platform == "gpu" else None
  found = hazards.for_machine(gpu.nvlink_domain if gpu else None, gpu.gpus_per_node if gpu else None,
                              environ.get("XLA_FLAGS", ""), nccl)
  report.warnings += [f"{h.what}. Avoid: {h.fix} ({h.source})." for h in found]


def _profile(report: Report, arch: str | None, environ: dict[str, str]) -> None:
  found = env.in_force(arch, environ)
  missing = [s for s, value in found if value is None]
  yours = [(s, value) for s, value in found if value is not None and value != s.value]
  report.lines.append(("profile", (f"{arch or 'shared settings'}: {len(found) - len(missing) - len(yours)} of "
                                   f"{len(found)} in force, {len(yours)} yours, {len(missing)} missing")))
  for s, value in yours:
    report.warnings.append(f"{s.name}={value} is yours; the profile's {s.value} is for this: {s.reason}.")
  if missing:
    what = "none of temoe's profile is set" if len(missing) == len(found) else \
        f"not set: {', '.join(s.name for s in missing)}"
    report.warnings.append(f"{what}; run in temoe's image (its entrypoint sets it) or "
                           f"`eval \"$(temoe env --arch {arch or 'auto'})\"` before training.")


def main(argv: list[str] | None = None) -> int:
  """`temoe doctor`: checks this machine and environment for a temoe GPU run."""
  parser = oneline.ArgumentParser(prog="temoe doctor", description=main.__doc__)
  parser.add_argument("--image", action="store_true",
                      help="check the installed stack only, no GPU (the image build runs this): MaxText, its "
                           "base.yml and seams, Transformer Engine's names; one line per problem with the fix")
  parser.add_argument("--without-te", action="store_true", help="with --image: a CPU environment, no TE to check")
  args = parser.parse_args(argv)
  if args.without_te and not args.image:
    parser.error("--without-te goes with --image")
  if args.image:
    from temoe.deploy import stack  # pylint: disable=import-outside-toplevel

    return stack.main(args.without_te)
  from temoe import hardware  # pylint: disable=import-outside-toplevel
  from temoe.maxtext import seams  # pylint: disable=import-outside-toplevel

  try:
    plat = hardware.detect()
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    print(f"temoe doctor: JAX could not start its backend ({type(exc).__name__}: {exc}); {NO_GPU_FIX}.")
    return 1
  try:
    seams.check_maxtext()
    seam_error = None
  except seams.TemoeSeamError as exc:
    seam_error = str(exc)
  report = diagnose(plat, dict(os.environ), seam_error, nccl_version())
  print(report.text())
  return 1 if report.problems else 0


if __name__ == "__main__":
  sys.exit(main())
