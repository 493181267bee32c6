#!/bin/bash
# Runs temoe's image on one host with the options its training needs: every GPU, the host's IPC
# namespace (NCCL and the JAX host-offload pool use shared memory), unlimited locked memory (pinned
# host buffers) and a 64 MiB stack. The image's entrypoint adds the env profile for the GPU it finds.
#
#   launch/docker-run.sh [-v HOST:CONTAINER[:ro]] [-e KEY=VALUE] [--name NAME] [--network NAME] [--ulimit NAME=SOFT:HARD] IMAGE [COMMAND ...]
#   launch/docker-run.sh temoe:dev doctor
#   launch/docker-run.sh -v /lustre/runs:/runs temoe:dev train /opt/temoe/configs/deepseek3-smoke.yml \
#       hardware=gpu dtype=bfloat16 weight_dtype=bfloat16 base_output_directory=/runs
#
# `temoe launch docker` reads the TEMOE_DOCKER_FLAGS line below: edit it here, both follow. TEMOE_GPUS=none
# leaves out `--gpus all` (a host without GPUs, e.g. the image test's CPU run; default: all). A --ulimit given here
# comes after the script's own and wins for its name: for a host whose hard limits the engine cannot raise (a
# runtime without CAP_SYS_RESOURCE; podman, once any --ulimit is given, also asks for 1048576 open files and
# processes unless told otherwise).
#
# The container is started without --rm, under --name (default temoe-<time>-<pid>), and removed by this script once
# it has read the container's exit code from the engine (`docker inspect` of the id `--cidfile` recorded): podman's
# Docker API (4.3) answers `docker run --rm` with 0 whatever the container's code, which would hide an exit 75.
#
# Exit codes (temoe.exits): a run that exits 75 (preempted after a checkpoint, a transient fault) is started
# again, at most TEMOE_MAX_RESTARTS times (default 3), and resumes from its last checkpoint; any other code
# ends it. SIGTERM/SIGINT to this script go to the container (docker run passes them on), which checkpoints
# its step within TEMOE_STOP_TIMEOUT seconds (default 300, `docker stop`'s wait) and is not started again.
set -euo pipefail

TEMOE_DOCKER_FLAGS=(--gpus all --ipc host --ulimit memlock=-1:-1 --ulimit stack=67108864:67108864)
max_restarts=${TEMOE_MAX_RESTARTS:-3}
stop_timeout=${TEMOE_STOP_TIMEOUT:-300}
case "${TEMOE_GPUS:-all}" in
  all) ;;
  none)
    flags=()
    for ((i = 0; i < ${#TEMOE_DOCKER_FLAGS[@]}; i += 2)); do
      [ "${TEMOE_DOCKER_FLAGS[i]}" = --gpus ] || flags+=("${TEMOE_DOCKER_FLAGS[@]:i:2}")
    done
    TEMOE_DOCKER_FLAGS=("${flags[@]}") ;;
  *) echo "docker-run.sh: TEMOE_GPUS=${TEMOE_GPUS}: valid: all, none" >&2; exit 2 ;;
esac

options=()
limits=()
name="temoe-$(date +%Y%m%d-%H%M%S)-$$"
while [ $# -gt 0 ]; do
  case "$1" in
    -v|-e|--name|--network|--ulimit) [ $# -ge 2 ] || { echo "docker-run.sh: $1 needs a value" >&2; exit 2; }
      case "$1" in --ulimit) limits+=("$1" "$2") ;; --name) name=$2 ;; *) options+=("$1" "$2") ;; esac; shift 2 ;;
    -*) echo "docker-run.sh: unknown option $1 (valid: -v HOST:CONTAINER[:ro], -e KEY=VALUE, --name NAME, --network NAME, --ulimit NAME=SOFT:HARD)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "usage: launch/docker-run.sh [-v HOST:CONTAINER[:ro]] [-e KEY=VALUE] [--name NAME] [--network NAME] [--ulimit NAME=SOFT:HARD] IMAGE [COMMAND ...]" >&2; exit 2; }
image=$1
shift
restarts=0
stopping=0
state=$(mktemp -d "${TMPDIR:-/tmp}/temoe-docker-run.XXXXXX")  # docker's pid and exit status, per start
trap 'stopping=1; [ ! -s "$state/pid" ] || kill -TERM "$(cat "$state/pid")" 2>/dev/null || true' TERM INT  # under set -e a failed kill (docker already gone) would end the script with 1
trap '[ ! -s "$state/cid" ] || docker rm -f "$(cat "$state/cid")" >/dev/null 2>&1 || true; rm -rf "$state"' EXIT
while :; do
  rm -f "$state/pid" "$state/status" "$state/cid"
  # docker runs in the foreground of a subshell that outlives the stop signals (a no-op trap, which exec resets
  # for docker) and writes docker's exit status to a file: a background child's status can be lost by bash's
  # `wait` when a trap cuts in (exit 255 instead of 75, a few runs in a hundred under load), a foreground one's not.
  (
    trap : TERM INT
    code=0
    sh -c 'echo $$ > "$0"; exec "$@"' "$state/pid" \
      docker run --name "$name" --cidfile "$state/cid" "${options[@]}" "${TEMOE_DOCKER_FLAGS[@]}" "${limits[@]}" --stop-timeout "$stop_timeout" \
      "$image" "$@" || code=$?
    echo "$code" > "$state/status"
  ) &
  runner=$!
  while kill -0 "$runner" 2>/dev/null; do  # short sleeps take the signals
    sleep 1 &
    wait $! || true
  done
  wait "$runner" 2>/dev/null || true
  status=$(cat "$state/status" 2>/dev/null || echo 1)
  if [ -s "$state/cid" ]; then  # the container was created (else docker run's own code: 125-127, nothing to remove)
    cid=$(cat "$state/cid")
    inside=$(docker inspect --format '{{.State.ExitCode}}' "$cid" 2>/dev/null) && [[ "$inside" =~ ^[0-9]+$ ]] && status=$inside
    docker rm -f "$cid" >/dev/null 2>&1 || true
    rm -f "$state/cid"
  fi
  if [ "$status" -ne 75 ] || [ "$stopping" -eq 1 ] || [ "$restarts" -ge "$max_restarts" ]; then
    exit "$status"
  fi
  restarts=$((restarts + 1))
  echo "docker-run.sh: exit 75 (requeue): starting the container again (restart $restarts of $max_restarts)" >&2
done
