#!/bin/bash
# Runs temoe's image on one host with the options its training needs: every GPU, the host's IPC
# namespace (NCCL and the JAX host-offload pool use shared memory), unlimited locked memory (pinned
# host buffers) and a 64 MiB stack. The image's entrypoint adds the env profile for the GPU it finds.
#
#   launch/docker-run.sh [-v HOST:CONTAINER[:ro]] [-e KEY=VALUE] [--name NAME] IMAGE [COMMAND ...]
#   launch/docker-run.sh temoe:dev doctor
#   launch/docker-run.sh -v /lustre/runs:/runs temoe:dev train /opt/temoe/configs/deepseek3-smoke.yml \
#       hardware=gpu dtype=bfloat16 weight_dtype=bfloat16 base_output_directory=/runs
#
# `temoe launch docker` reads the TEMOE_DOCKER_FLAGS line below: edit it here, both follow.
set -euo pipefail

TEMOE_DOCKER_FLAGS=(--gpus all --ipc host --ulimit memlock=-1:-1 --ulimit stack=67108864:67108864)

options=()
while [ $# -gt 0 ]; do
  case "$1" in
    -v|-e|--name) [ $# -ge 2 ] || { echo "docker-run.sh: $1 needs a value" >&2; exit 2; }; options+=("$1" "$2"); shift 2 ;;
    -*) echo "docker-run.sh: unknown option $1 (valid: -v HOST:CONTAINER[:ro], -e KEY=VALUE, --name NAME)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "usage: launch/docker-run.sh [-v HOST:CONTAINER[:ro]] [-e KEY=VALUE] [--name NAME] IMAGE [COMMAND ...]" >&2; exit 2; }
image=$1
shift
exec docker run --rm "${options[@]}" "${TEMOE_DOCKER_FLAGS[@]}" "$image" "$@"
