"""The image's ENTRYPOINT: finds the GPU architecture, adds the profile's settings the environment
lacks, and execs the command.

The Dockerfile bakes the architecture-independent settings as ENV; what depends on the GPU
(e.g. CUDA_DEVICE_MAX_CONNECTIONS) can only be chosen on the host that runs the container, so it is
added here, before anything starts CUDA. The architecture comes from TEMOE_ARCH if set
(hopper|blackwell|auto), else from `nvidia-smi`. Anything the user set wins (`temoe.deploy.env.environment`).
A command that starts with a temoe subcommand (`train`, `doctor`, ...) runs as `temoe <command>`.
"""

from __future__ import annotations

import os
import sys

from temoe import cli
from temoe.deploy import env

DEFAULT_COMMAND = ["temoe", "train", "/opt/temoe/configs/deepseek3-smoke.yml", "hardware=gpu", "dtype=bfloat16",
                   "weight_dtype=bfloat16", "te_gmm_quantization=te_fp8_current", "base_output_directory=/tmp/runs"]
"""Run when the container gets no command (the Dockerfile's CMD says the same): the smoke model with
TE's FP8 grouped GEMMs, which run on Hopper and Blackwell whatever the image's cuBLAS."""

TEMOE_COMMANDS = ("train", *cli.SUBCOMMANDS)
"""`temoe` subcommands, accepted without the `temoe` in front (`docker run IMAGE train ...`)."""


def command(argv: list[str]) -> list[str]:
  """The command to exec for the container's arguments."""
  if not argv:
    return list(DEFAULT_COMMAND)
  return ["temoe", *argv] if argv[0] in TEMOE_COMMANDS else list(argv)


def main(argv: list[str] | None = None) -> int:
  """Applies the profile for this host's GPU and replaces this process with the command."""
  argv = sys.argv[1:] if argv is None else argv
  try:
    arch, how = env.resolve_arch(os.environ.get("TEMOE_ARCH", "auto"))
  except ValueError as exc:
    print(f"temoe entrypoint: TEMOE_ARCH: {exc}", file=sys.stderr)
    return 2
  profile = env.environment(arch, dict(os.environ))
  added = [name for name in profile if name not in os.environ and name != "XLA_FLAGS"]
  flags = env.xla_flag_names(profile.get("XLA_FLAGS", "")) - env.xla_flag_names(os.environ.get("XLA_FLAGS", ""))
  added += [f"{len(flags)} XLA flag(s)"] if flags else []
  print(f"temoe entrypoint: GPU architecture {arch or 'not Hopper/Blackwell: shared settings only'} ({how}); "
        f"added {', '.join(added) or 'nothing'}; TEMOE_ARCH=hopper|blackwell overrides.", file=sys.stderr)
  cmd = command(argv)
  try:
    os.execvpe(cmd[0], cmd, {**os.environ, **profile})
  except OSError as exc:
    print(f"temoe entrypoint: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
    return 127
  return 0  # not reached: exec replaced this process


if __name__ == "__main__":
  sys.exit(main())
