#!/usr/bin/env bash
# Runs temoe's image on this host's GPUs: launch/docker-run.sh IMAGE <config.yml> [key=value ...]
# Overrides reach MaxText as separate arguments, never through a shell.
set -euo pipefail
image=${1:?usage: launch/docker-run.sh IMAGE <config.yml> [key=value ...]}; shift
exec docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
  -v "$PWD/runs:/runs" "$image" train "$@" base_output_directory=/runs
