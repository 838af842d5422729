#!/usr/bin/env bash
# Builds the service images and the tools image: primerl-<service>:<package version>
# and :latest, primerl-tools:<primerl-launcher version> and :latest.
#
# Usage: deploy/docker/build_images.sh [image ...]     (default: all six services and tools)
#   image: orchestrator trainer inference router weight_broadcaster kvstore tools
#          (weight-broadcaster is accepted too; tools builds the trainer image first when
#          it is missing, since primerl-tools is built FROM it)
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
# `docker build` per service (deploy/docker/service.Dockerfile, --target <service>, with
# the build arguments below), then primerl-tools (deploy/docker/tools.Dockerfile);
# prints timings.
# A failed image does not stop the others (primerl-tools is skipped when the trainer
# image failed); the exit status is 1 if any failed.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
ALL_SERVICES=(orchestrator trainer inference router weight_broadcaster kvstore)
# What differs between the service images besides the stage of service.Dockerfile; the
# runtime (with torch or not) comes from the wheelhouse's lock (deploy/docker/locks/<service>.txt).
declare -A DESCRIPTION=(
  [orchestrator]="primerl orchestrator: the RL loop, from tasks to trainer batches"
  [trainer]="primerl trainer: PyTorch training of the policy"
  [inference]="primerl inference: one vLLM engine (CPU build) behind gRPC"
  [router]="primerl router: fronts the inference replicas"
  [weight_broadcaster]="primerl weight_broadcaster: pushes new policy versions to inference"
  [kvstore]="primerl kvstore: pooled KV-cache store in DRAM and disk"
)
# vLLM's CPU kernels link libnuma (primerl-base has it; python:3.11-slim does not).
declare -A SYSTEM_PACKAGES=([inference]="libnuma1")
# Imported at build time, so that an image that cannot start fails to build.
declare -A IMPORTS=([inference]="torch vllm")
BASE_IMAGE="${BASE_IMAGE:-primerl-base:bookworm}"
DOCKER_SET="${DOCKER:-}"
DOCKER="${DOCKER:-docker}"
read -r -a EXTRA_ARGS <<< "${DOCKER_BUILD_ARGS:-}"

now() { date +%s%3N; }  # milliseconds
elapsed() { local ms=$(($(now) - $1)); printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100)); }
timings=()

services=()
tools=0
for arg in "$@"; do
  svc="${arg//-/_}"
  if [[ "$svc" == tools ]]; then
    tools=1
    continue
  fi
  if [[ ! " ${ALL_SERVICES[*]} " == *" $svc "* ]]; then
    echo "build_images.sh: unknown image '$arg' (one of: ${ALL_SERVICES[*]} tools)" >&2
    exit 2
  fi
  services+=("$svc")
done
if [[ $# -eq 0 ]]; then
  services=("${ALL_SERVICES[@]}")
  tools=1
fi

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

total_start=$(now)
step_start=$(now)
if [[ "$BASE_IMAGE" == primerl-base:* ]]; then
  BASE_IMAGE="$BASE_IMAGE" DOCKER="$DOCKER" deploy/docker/make_base_image.sh
  timings+=("$(printf '%-34s %ss' "base image" "$(elapsed "$step_start")")")
fi

step_start=$(now)
deploy/docker/build_wheelhouse.sh
timings+=("$(printf '%-34s %ss' "wheelhouse" "$(elapsed "$step_start")")")

# primerl-tools is built FROM the trainer image: build that first when it is missing.
if [[ $tools -eq 1 && ! " ${services[*]} " == *" trainer "* ]] \
  && ! "$DOCKER" image inspect primerl-trainer:latest >/dev/null 2>&1; then
  services+=(trainer)
fi

version_of() {
  python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
    "$1/pyproject.toml"
}
# The runtime image a service builds on, as the wheelhouse locked it (torch or not).
runtime_of() {
  local runtime
  runtime="$(sed -n 's/^# runtime: //p' "deploy/docker/locks/$1.txt")"
  if [[ -z "$runtime" ]]; then
    echo "build_images.sh: deploy/docker/locks/$1.txt names no runtime (run build_wheelhouse.sh)" >&2
    return 1
  fi
  echo "$runtime"
}

declare -A RUNTIME=()
for svc in "${services[@]}"; do
  RUNTIME[$svc]="$(runtime_of "$svc")"
done

# The shared images (deploy/docker/Dockerfile) the service images build FROM.
shared_targets=(runtime common)
if [[ " ${RUNTIME[*]} " == *" primerl-runtime-torch "* ]]; then shared_targets+=(runtime-torch); fi
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
  version="$(version_of "services/$svc")"
  echo "==> building $image:$version (deploy/docker/service.Dockerfile --target $svc)"
  step_start=$(now)
  status=""
  if ! "$DOCKER" build --force-rm "${EXTRA_ARGS[@]}" \
    --file deploy/docker/service.Dockerfile --target "$svc" \
    --build-arg "SERVICE=$svc" \
    --build-arg "RUNTIME_IMAGE=${RUNTIME[$svc]}:latest" \
    --build-arg "SYSTEM_PACKAGES=${SYSTEM_PACKAGES[$svc]:-}" \
    --build-arg "IMPORTS=${IMPORTS[$svc]:-}" \
    --build-arg "DESCRIPTION=${DESCRIPTION[$svc]}" \
    --build-arg "VERSION=$version" \
    --tag "$image:$version" --tag "$image:latest" \
    .; then
    status=" FAILED"
    failed+=("$svc")
  fi
  timings+=("$(printf '%-34s %ss%s' "$image:$version" "$(elapsed "$step_start")" "$status")")
done

if [[ $tools -eq 1 ]]; then
  version="$(version_of tools/launcher)"
  step_start=$(now)
  status=""
  if [[ " ${failed[*]} " == *" trainer "* ]]; then
    status=" SKIPPED (no trainer image)"
    failed+=(tools)
  else
    echo "==> building primerl-tools:$version (deploy/docker/tools.Dockerfile, FROM primerl-trainer:latest)"
    if ! "$DOCKER" build --force-rm "${EXTRA_ARGS[@]}" \
      --file deploy/docker/tools.Dockerfile \
      --build-arg "VERSION=$version" \
      --tag "primerl-tools:$version" --tag "primerl-tools:latest" \
      .; then
      status=" FAILED"
      failed+=(tools)
    fi
  fi
  timings+=("$(printf '%-34s %ss%s' "primerl-tools:$version" "$(elapsed "$step_start")" "$status")")
fi

echo
echo "timings:"
printf '  %s\n' "${timings[@]}"
printf '  %-34s %ss\n' "total" "$(elapsed "$total_start")"
"$DOCKER" image ls --filter "reference=primerl-*:latest" --format 'table {{.Repository}}:{{.Tag}}\t{{.ID}}\t{{.Size}}'
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "build_images.sh: failed: ${failed[*]}" >&2
  exit 1
fi
