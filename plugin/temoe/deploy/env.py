"""temoe's environment profile: the one table of XLA flags and variables a Transformer Engine MoE run
on NVIDIA GPUs wants, per GPU architecture, each with its reason.

Everything else reads it: `temoe env` prints it, `--write-dockerfile` bakes its
architecture-independent part into the Dockerfile's marked ENV block, the image's entrypoint
(`temoe.deploy.entrypoint`) adds the rest for the GPU it finds, and `temoe doctor` compares it with the
environment. A variable the user set always wins; inside XLA_FLAGS, so does a flag the user set.
Only stdlib here: the entrypoint imports this before anything starts JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys

from temoe import oneline

ARCHS = ("hopper", "blackwell")
"""GPU architectures the profile knows: Hopper (sm_90), Blackwell (sm_100 and newer)."""


@dataclasses.dataclass(frozen=True)
class Setting:
  """One environment variable, or one XLA flag (name starts with `xla_`, carried in XLA_FLAGS)."""

  name: str
  value: str
  archs: tuple[str, ...]
  reason: str
  aliases: tuple[str, ...] = ()  # older XLA flag spellings of the same option: a user's one wins

  @property
  def is_xla_flag(self) -> bool:
    return self.name.startswith("xla_")


_PIPELINE = "pipelines {} out of the layer scan, so layer i+1's collective overlaps layer i's compute"
_LEGACY = "xla_gpu_enable_pipelined_{}"  # the boolean spelling, still parsed into the same option

PROFILE = (
    Setting("xla_gpu_enable_latency_hiding_scheduler", "true", ARCHS,
            "lets XLA move collectives to overlap compute; the only flag NVIDIA's JAX image bakes"),
    Setting("xla_gpu_experimental_enable_collective_multi_streaming", "true", ARCHS,
            "runs independent collectives on several CUDA streams (IB and NVLink at once), not one serial stream"),
    Setting("xla_gpu_experimental_parallel_collective_overlap_limit", "2", ARCHS,
            "lets the scheduler keep two collectives in flight, so multi-streaming has something to overlap"),
    Setting("xla_gpu_pipeline_all_gather", "on", ARCHS, _PIPELINE.format("FSDP weight all-gathers"),
            (_LEGACY.format("all_gather"),)),
    Setting("xla_gpu_pipeline_reduce_scatter", "on", ARCHS, _PIPELINE.format("gradient reduce-scatters"),
            (_LEGACY.format("reduce_scatter"),)),
    Setting("xla_gpu_pipeline_all_reduce", "on", ARCHS, _PIPELINE.format("all-reduces"),
            (_LEGACY.format("all_reduce"),)),
    Setting("xla_gpu_enable_while_loop_double_buffering", "true", ARCHS,
            "double-buffers the layer scan so pipelined collectives of consecutive layers do not serialize"),
    Setting("xla_gpu_all_gather_combine_threshold_bytes", "6442450944", ARCHS,
            "combines a layer's weight all-gathers into one large, link-saturating collective (NVIDIA DSv3 recipe)"),
    Setting("xla_gpu_reduce_scatter_combine_threshold_bytes", "201326592", ARCHS,
            "combines gradient reduce-scatters to 192 MiB: large transfers, still overlapped (NVIDIA DSv3 recipe)"),
    Setting("xla_gpu_all_reduce_combine_threshold_bytes", "33554432", ARCHS,
            "keeps all-reduces at 32 MiB so they overlap the backward pass (NVIDIA DSv3 recipe)"),
    Setting("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.88", ARCHS,
            "leaves 12% of HBM outside XLA's pool for cuBLAS/cuDNN/TE workspaces and NCCL buffers"),
    Setting("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "false", ARCHS,
            "the pinned host pool for offloaded activations grows on demand, not pinned whole at start-up"),
    Setting("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "180", ARCHS,
            "raises the pinned host pool cap (XLA's default 64) so remat 'offload' tensors fit; per process"),
    Setting("CUDA_DEVICE_MAX_CONNECTIONS", "1", ("hopper",),
            "one hardware queue keeps XLA's launch order, which Hopper needs for collective/compute overlap"),
    Setting("CUDA_DEVICE_MAX_CONNECTIONS", "16", ("blackwell",),
            "Blackwell's stream priorities overlap without it; 1 is slower there (16: NVIDIA DSv3 TE recipe)"),
    Setting("NCCL_NVLS_ENABLE", "0", ARCHS,
            "NVLink SHARP pins extra GPU memory per communicator, and multi-streaming makes more communicators"),
    Setting("NCCL_DEBUG", "WARN", ARCHS, "shows NCCL warnings (e.g. a fall-back to sockets) without INFO's flood"),
    Setting("NVTE_FUSED_ATTN", "1", ARCHS,
            "lets TE's attention (attention=cudnn_flash_te) use cuDNN fused attention; TE JAX defaults to off"),
)

LEFT_TO_XLA = {
    "xla_gpu_enable_command_buffer": (
        "XLA's default (JAX 0.11: FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL) already "
        "runs the step as CUDA graphs, custom calls included; on the 1-GPU proxy the profile with NVIDIA's narrower "
        "DSv3 list (FUSION,CUBLAS,CUDNN,DYNAMIC_SLICE_FUSION) measured 2.9% slower, an explicit list that only drops "
        "CONDITIONAL 2.8% (bench/results/proxy_1gpu.paths.json: temoe_fp8_env, temoe_fp8_graphs)"),
}
"""Flags recipes set that the profile deliberately leaves at XLA's default, with the measured reason."""

DOCKERFILE_BEGIN = "# BEGIN temoe env profile: generated by `python -m temoe.deploy.env --write-dockerfile Dockerfile`"
DOCKERFILE_END = "# END temoe env profile"


def arch_of(compute_capability: tuple[int, int] | None) -> str | None:
  """The profile's architecture for a compute capability; None for older GPUs or none."""
  major = compute_capability[0] if compute_capability else 0
  return "blackwell" if major >= 10 else "hopper" if major == 9 else None


def detect_arch() -> tuple[str | None, str]:
  """The first GPU's architecture as `nvidia-smi` reports it (no CUDA context), and how it was found."""
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return None, "no nvidia-smi on PATH"
  try:
    out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=False)
  except (OSError, subprocess.TimeoutExpired) as exc:
    return None, f"nvidia-smi failed: {exc}"
  first = (out.stdout.split() or ["?"])[0]
  try:
    cc = tuple(int(part) for part in first.split("."))[:2]
  except ValueError:
    return None, f"nvidia-smi gave no compute capability (exit {out.returncode}: {first!r})"
  return arch_of(cc), f"nvidia-smi: sm_{cc[0]}{cc[1] if len(cc) > 1 else 0}"


def resolve_arch(arch: str | None) -> tuple[str | None, str]:
  """`hopper`/`blackwell` as given, `auto` (or empty) detected; with how it was decided."""
  if arch and arch != "auto":
    if arch not in ARCHS:
      raise ValueError(f"unknown GPU architecture {arch!r}; valid choices: {', '.join(ARCHS)}, auto.")
    return arch, "given"
  return detect_arch()


def settings(arch: str | None) -> list[Setting]:
  """The profile's settings for `arch`; for None, only those every architecture shares."""
  return [s for s in PROFILE if (arch in s.archs if arch else set(ARCHS) <= set(s.archs))]


def xla_flag_names(xla_flags: str) -> set[str]:
  """Names of the flags in an XLA_FLAGS string."""
  return {token[2:].split("=", 1)[0] for token in xla_flags.split() if token.startswith("--")}


def environment(arch: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
  """The profile's variables for `arch`, with `environ`'s wherever it has them (the user wins).

  XLA_FLAGS keeps the user's string and appends only the profile's flags it does not name.
  """
  environ = {} if environ is None else environ
  out = {s.name: environ.get(s.name, s.value) for s in settings(arch) if not s.is_xla_flag}
  user_flags = environ.get("XLA_FLAGS", "").strip()
  named = xla_flag_names(user_flags)
  ours = [f"--{s.name}={s.value}" for s in settings(arch) if s.is_xla_flag and not named & {s.name, *s.aliases}]
  xla_flags = " ".join(filter(None, [user_flags, *ours]))
  return {"XLA_FLAGS": xla_flags, **out} if xla_flags else out


def parse_xla_flags(xla_flags: str) -> dict[str, str]:
  """flag name -> value of an XLA_FLAGS string, older spellings under the profile's name; XLA applies the
  last occurrence, so does this."""
  canonical = {alias: s.name for s in PROFILE for alias in s.aliases}
  flags = {}
  for token in xla_flags.split():
    if token.startswith("--"):
      name, _, value = token[2:].partition("=")
      flags[canonical.get(name, name)] = value
  return flags


def in_force(arch: str | None, environ: dict[str, str]) -> list[tuple[Setting, str | None]]:
  """Each setting of `arch` with the value `environ` gives it (None: not set), for `temoe doctor`."""
  flags = parse_xla_flags(environ.get("XLA_FLAGS", ""))
  return [(s, (flags if s.is_xla_flag else environ).get(s.name)) for s in settings(arch)]


def _comment(s: Setting, actual: str | None) -> str:
  label = f"--{s.name}={s.value}" if s.is_xla_flag else f"{s.name}={s.value}"
  yours = "" if actual == s.value else f" (yours wins: {actual})"
  return f"# {label} [{', '.join(s.archs)}]{yours}: {s.reason}"


def render(arch: str | None, fmt: str, explain: bool = False, environ: dict[str, str] | None = None) -> str:
  """`temoe env`'s output: shell exports, a `docker run --env-file` file, or JSON."""
  env = environment(arch, environ)
  actual = in_force(arch, env)
  if fmt == "json":
    doc = {"arch": arch, "env": env}
    if explain:
      doc["settings"] = [dataclasses.asdict(s) | {"in_force": value} for s, value in actual]
    return json.dumps(doc, indent=2)
  lines = []
  for name, value in env.items():
    if explain:
      lines += [_comment(s, v) for s, v in actual if (s.is_xla_flag and name == "XLA_FLAGS") or s.name == name]
    lines.append(f"export {name}={shlex.quote(value)}" if fmt == "shell" else f"{name}={value}")
  return "\n".join(lines)


def dockerfile_block() -> str:
  """The Dockerfile's generated ENV block: the architecture-independent profile.

  XLA_FLAGS starts with the base image's own (`${XLA_FLAGS}`, expanded by Docker at build time):
  flags the profile lacks are kept, and for one that both name XLA applies the profile's, the later.
  """
  env = environment(None)
  flags = env.pop("XLA_FLAGS")
  body = " \\\n    ".join(f'{name}="{value}"' for name, value in env.items())
  return f'{DOCKERFILE_BEGIN}\nENV XLA_FLAGS="${{XLA_FLAGS}} {flags}"\nENV {body}\n{DOCKERFILE_END}'


def write_dockerfile(path: str) -> bool:
  """Rewrites the marked ENV block of the Dockerfile at `path` from the profile; True if it changed."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  start, end = text.find(DOCKERFILE_BEGIN), text.find(DOCKERFILE_END)
  if start < 0 or end < start:
    raise ValueError(f"{path} has no block between {DOCKERFILE_BEGIN!r} and {DOCKERFILE_END!r}")
  new = text[:start] + dockerfile_block() + text[end + len(DOCKERFILE_END):]
  if new != text:
    with open(path, "w", encoding="utf-8") as f:
      f.write(new)
  return new != text


def main(argv: list[str] | None = None) -> int:
  """`temoe env`: prints the profile for a GPU architecture, merged with this environment."""
  parser = oneline.ArgumentParser(prog="temoe env", description=main.__doc__)
  parser.add_argument("--arch", choices=(*ARCHS, "auto"), default="auto")
  parser.add_argument("--format", choices=("shell", "docker-env", "json"), default="shell")
  parser.add_argument("--explain", action="store_true", help="say what each setting does and for which GPUs")
  parser.add_argument("--write-dockerfile", metavar="PATH", help="rewrite PATH's generated ENV block and exit")
  args = parser.parse_args(argv)
  if args.write_dockerfile:
    try:
      changed = write_dockerfile(args.write_dockerfile)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
      why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
      print(f"temoe env: --write-dockerfile {args.write_dockerfile}: {why}; pass temoe's Dockerfile (it holds the "
            "generated ENV block)", file=sys.stderr)
      return 2
    print(f"temoe env: {args.write_dockerfile} {'updated' if changed else 'already matches the profile'}")
    return 0
  arch, how = resolve_arch(args.arch)
  if arch is None:
    print(f"temoe env: no Hopper or Blackwell GPU found ({how}); printing the settings every GPU shares. "
          "Pass --arch hopper|blackwell for the rest.", file=sys.stderr)
  print(render(arch, args.format, args.explain, dict(os.environ)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
