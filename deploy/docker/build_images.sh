#!/usr/bin/env bash
# Builds the service images: primerl-<service>:<package version> and :latest.
#
# Usage: deploy/docker/build_images.sh [service ...]     (default: all six)
#   service: orchestrator trainer inference router weight_broadcaster kvstore
#            (weight-broadcaster is accepted too)
# Env:
#   BASE_IMAGE  image the shared runtime builds on (default primerl-base:bookworm, made
#               by make_base_image.sh when missing; python:3.11-slim needs a registry)
#   DOCKER      docker client (default: one with BuildKit, see below); extra `docker build`
#               flags in DOCKER_BUILD_ARGS (e.g. "--no-cache" or "--progress=plain");
#               DOCKER_BUILDKIT=0 forces the legacy builder
#   PYTHON etc. see build_wheelhouse.sh
# Steps, from the repository root: base image (if missing), wheelhouse (only what
# is missing or outdated), the shared images of deploy/docker/Dockerfile
# (primerl-runtime, primerl-runtime-torch, primerl-common-layer), then one
# `docker build` per service; prints timings.
# A failed service image does not stop the others; the exit status is 1 if any failed.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
ALL_SERVICES=(orchestrator trainer inference router weight_broadcaster kvstore)
BASE_IMAGE="${BASE_IMAGE:-primerl-base:bookworm}"
DOCKER_SET="${DOCKER:-}"
DOCKER="${DOCKER:-docker}"
read -r -a EXTRA_ARGS <<< "${DOCKER_BUILD_ARGS:-}"

now() { date +%s%3N; }  # milliseconds
elapsed() { local ms=$(($(now) - $1)); printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100)); }
timings=()

services=()
for arg in "$@"; do
  svc="${arg//-/_}"
  if [[ ! " ${ALL_SERVICES[*]} " == *" $svc "* ]]; then
    echo "build_images.sh: unknown service '$arg' (one of: ${ALL_SERVICES[*]})" >&2
    exit 2
  fi
  services+=("$svc")
done
[[ ${#services[@]} -eq 0 ]] && services=("${ALL_SERVICES[@]}")

# BuildKit builds only the stages a target needs, several at once, and sends
# the daemon only the context files that changed (the legacy builder sends all
# ~700 MB of wheels for every image). Use it where the client has it: the
# buildx plugin, or a client older than 23, which has BuildKit built in
# (Debian bookworm's docker.io is 20.10; a newer client without buildx falls
# back to the legacy builder).
if [[ -z "${DOCKER_BUILDKIT:-}" ]]; then
  if "$DOCKER" buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=1
  elif [[ -z "${DOCKER_SET:-}" ]]; then
    for candidate in $(type -ap docker); do
      major="$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)"
      if [[ "$major" =~ ^[0-9]+$ ]] && ((major < 23)); then
        DOCKER="$candidate"
        export DOCKER_BUILDKIT=1
        break
      fi
    done
  fi
fi
echo "docker client: $DOCKER ($("$DOCKER" version --format '{{.Client.Version}}' 2>/dev/null || true)), BuildKit: ${DOCKER_BUILDKIT:-0}"

uses_torch() { grep -q '^ARG RUNTIME_IMAGE=primerl-runtime-torch' "services/$1/Dockerfile"; }

total_start=$(now)
step_start=$(now)
if [[ "$BASE_IMAGE" == primerl-base:* ]]; then
  BASE_IMAGE="$BASE_IMAGE" DOCKER="$DOCKER" deploy/docker/make_base_image.sh
  timings+=("$(printf '%-34s %ss' "base image" "$(elapsed "$step_start")")")
fi

step_start=$(now)
deploy/docker/build_wheelhouse.sh
timings+=("$(printf '%-34s %ss' "wheelhouse" "$(elapsed "$step_start")")")

version_of() {
  python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
    "services/$1/pyproject.toml"
}

# The shared images (deploy/docker/Dockerfile) the service Dockerfiles build FROM.
shared_targets=(runtime common)
for svc in "${services[@]}"; do
  if uses_torch "$svc"; then shared_targets+=(runtime-torch); break; fi
done
for target in "${shared_targets[@]}"; do
  image="primerl-$target"
  [[ "$target" == common ]] && image="primerl-common-layer"
  echo "==> building $image:latest (deploy/docker/Dockerfile --target $target, base $BASE_IMAGE)"
  step_start=$(now)
  "$DOCKER" build --force-rm "${EXTRA_ARGS[@]}" \
    --file deploy/docker/Dockerfile --target "$target" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --tag "$image:latest" \
    .
  timings+=("$(printf '%-34s %ss' "$image:latest" "$(elapsed "$step_start")")")
done

failed=()
for svc in "${services[@]}"; do
  image="primerl-${svc//_/-}"
  version="$(version_of "$svc")"
  echo "==> building $image:$version (services/$svc/Dockerfile)"
  step_start=$(now)
  status=""
  if ! "$DOCKER" build --force-rm "${EXTRA_ARGS[@]}" \
    --file "services/$svc/Dockerfile" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --build-arg "VERSION=$version" \
    --tag "$image:$version" --tag "$image:latest" \
    .; then
    status=" FAILED"
    failed+=("$svc")
  fi
  timings+=("$(printf '%-34s %ss%s' "$image:$version" "$(elapsed "$step_start")" "$status")")
done

echo
echo "timings:"
printf '  %s\n' "${timings[@]}"
printf '  %-34s %ss\n' "total" "$(elapsed "$total_start")"
"$DOCKER" image ls --filter "reference=primerl-*:latest" --format 'table {{.Repository}}:{{.Tag}}\t{{.ID}}\t{{.Size}}'
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "build_images.sh: failed: ${failed[*]}" >&2
  exit 1
fi
