#!/usr/bin/env bash
# Makes this machine ready for the container images and deploy/compose.yaml:
#   1. Docker Engine: installs Debian's docker.io with apt-get when dockerd is missing;
#   2. Compose: installs Debian's docker-compose (v1.29) when neither `docker compose`
#      nor `docker-compose` answers;
#   3. starts dockerd in the background when no engine answers, and waits for it
#      (log: $DOCKERD_LOG, default /var/log/primerl-dockerd.log);
#   4. builds the base image (primerl-base:bookworm, make_base_image.sh) when missing.
# Idempotent: each step is skipped when already done; a second run takes a second.
#
# Usage: deploy/docker/ensure_docker.sh [--no-base-image]
# Env:   BASE_IMAGE (default primerl-base:bookworm; a primerl-base:* tag is built
#        here, any other is left to docker), DOCKERD_LOG, DOCKER_WAIT_S (default 60).
# Needs root (or sudo) for apt-get, dockerd and debootstrap.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BASE_IMAGE="${BASE_IMAGE:-primerl-base:bookworm}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/primerl-dockerd.log}"
DOCKER_WAIT_S="${DOCKER_WAIT_S:-60}"
build_base=1
[[ "${1:-}" == "--no-base-image" ]] && build_base=0

say() { echo "ensure_docker: $*"; }
as_root() {
  if [[ $(id -u) -eq 0 ]]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else say "needs root for: $*" >&2; exit 1
  fi
}

apt_updated=0
apt_install() {
  if [[ $apt_updated -eq 0 ]]; then
    as_root apt-get update -q
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

has_compose() { docker compose version >/dev/null 2>&1 || docker-compose version >/dev/null 2>&1; }
engine_up() { docker info >/dev/null 2>&1; }

# 1, 2: packages. A docker client alone (some images ship one) is not an engine.
packages=()
command -v dockerd >/dev/null 2>&1 || packages+=(docker.io)
has_compose || packages+=(docker-compose)
if [[ ${#packages[@]} -gt 0 ]]; then
  say "installing ${packages[*]}"
  apt_install "${packages[@]}"
fi

# 3: the engine. apt may have started it through the init system; otherwise
# dockerd runs in the background, detached from this shell.
if ! engine_up; then
  if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    as_root systemctl start docker || true
  fi
fi
if ! engine_up; then
  pid_file=/var/run/docker.pid
  if [[ -f $pid_file ]] && ! kill -0 "$(cat "$pid_file")" 2>/dev/null; then
    as_root rm -f "$pid_file"   # left by a dockerd that did not stop cleanly: it would refuse to start
  fi
  say "starting dockerd (log: $DOCKERD_LOG)"
  as_root sh -c "nohup setsid dockerd >>'$DOCKERD_LOG' 2>&1 </dev/null &"
  for ((i = 0; i < DOCKER_WAIT_S; i++)); do
    engine_up && break
    sleep 1
  done
  if ! engine_up; then
    say "dockerd did not answer within ${DOCKER_WAIT_S}s; last lines of $DOCKERD_LOG:" >&2
    tail -n 20 "$DOCKERD_LOG" >&2 || true
    exit 1
  fi
fi
say "engine $(docker version --format '{{.Server.Version}}'), compose $(docker compose version --short 2>/dev/null || docker-compose version --short)"

# 4: the base image the service images build on.
if [[ $build_base -eq 1 && "$BASE_IMAGE" == primerl-base:* ]]; then
  as_root env BASE_IMAGE="$BASE_IMAGE" "$REPO_ROOT/deploy/docker/make_base_image.sh"
fi
