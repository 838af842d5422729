#!/usr/bin/env bash
# Builds the service images: primerl-<service>:<package version> and :latest.
#
# Usage: deploy/docker/build_images.sh [service ...]     (default: all six)
#   service: orchestrator trainer inference router weight_broadcaster kvstore
#            (weight-broadcaster is accepted too)
# Env:
#   BASE_IMAGE  image the Dockerfiles build on (default primerl-base:bookworm, made
#               by make_base_image.sh when missing; python:3.11-slim needs a registry)
#   DOCKER      docker client (default docker); extra `docker build` flags in
#               DOCKER_BUILD_ARGS (e.g. "--no-cache" or "--progress=plain")
#   PYTHON etc. see build_wheelhouse.sh
# Steps: base image (if missing), wheelhouse (only what is missing or outdated),
# then one `docker build` per service, from the repository root; prints timings.
# A failed image does not stop the others; the exit status is 1 if any failed.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
ALL_SERVICES=(orchestrator trainer inference router weight_broadcaster kvstore)
TORCH_SERVICES=(orchestrator trainer inference weight_broadcaster)
PLAIN_SERVICES=(router kvstore)
BASE_IMAGE="${BASE_IMAGE:-primerl-base:bookworm}"
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

# The shared parts of the Dockerfiles must stay identical, or the big layers
# are built and stored once per image.
shared_part() { sed -n '/^# ---- shared/,/^# ---- service-specific/p' "services/$1/Dockerfile"; }
check_shared() {
  local first="$1"; shift
  for svc in "$@"; do
    if ! diff -u <(shared_part "$first") <(shared_part "$svc") >/dev/null; then
      echo "build_images.sh: the shared part of services/$svc/Dockerfile differs from services/$first/Dockerfile:" >&2
      diff -u <(shared_part "$first") <(shared_part "$svc") >&2 || true
      exit 1
    fi
  done
}
check_shared "${TORCH_SERVICES[@]}"
check_shared "${PLAIN_SERVICES[@]}"

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

failed=()
for svc in "${services[@]}"; do
  image="primerl-${svc//_/-}"
  version="$(version_of "$svc")"
  echo "==> building $image:$version (services/$svc/Dockerfile, base $BASE_IMAGE)"
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
