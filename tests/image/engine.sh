#!/usr/bin/env bash
# A container engine for the image test on a Debian 12 host without Docker: podman and buildah from Debian's
# packages (debootstrap too, which makes the stand-in base's root filesystem), runc as the runtime with lowered
# default ulimits (crun, and runc with the hosts' unlimited defaults, fail on hybrid cgroup hosts), and
# `podman system service` answering the Docker API, which the Docker CLI and docker-py then use.
#   tests/image/engine.sh install    apt-get the packages and write /etc/containers/containers.conf (root)
#   tests/image/engine.sh start      start the service; prints `export DOCKER_HOST=...` for the caller to eval
#   tests/image/engine.sh stop       stop the service this script started (by its recorded pid)
# .ci/run calls all three; a developer runs them by hand (as root) to run `make image-test` here.
set -euo pipefail

SOCK=${TEMOE_PODMAN_SOCK:-/run/temoe-podman/podman.sock}
PIDFILE=$(dirname "$SOCK")/service.pid
CONF=/etc/containers/containers.conf

install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends podman buildah runc debootstrap fuse-overlayfs uidmap \
    slirp4netns iptables ca-certificates >/dev/null
  mkdir -p "$(dirname "$CONF")"
  if ! grep -q '^# temoe image test' "$CONF" 2>/dev/null; then
    [ -f "$CONF" ] && cp "$CONF" "$CONF.before-temoe"
    cat >"$CONF" <<'EOF'
# temoe image test (tests/image/engine.sh): runc, and ulimits a container may raise to (the host's own
# unlimited defaults make runc fail here).
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
EOF
  fi
  podman --version
}

start() {
  mkdir -p "$(dirname "$SOCK")"
  if [ -S "$SOCK" ] && [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "export DOCKER_HOST=unix://$SOCK"
    return
  fi
  podman system service --time=0 "unix://$SOCK" >"$(dirname "$SOCK")/service.log" 2>&1 &
  echo $! >"$PIDFILE"
  for _ in $(seq 60); do
    if DOCKER_HOST="unix://$SOCK" docker version >/dev/null 2>&1; then
      echo "export DOCKER_HOST=unix://$SOCK"
      return
    fi
    sleep 1
  done
  echo "temoe: podman system service did not answer on $SOCK (log: $(dirname "$SOCK")/service.log)" >&2
  exit 1
}

stop() {
  if [ -f "$PIDFILE" ]; then
    kill "$(cat "$PIDFILE")" 2>/dev/null || true
    rm -f "$PIDFILE" "$SOCK"
  fi
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
