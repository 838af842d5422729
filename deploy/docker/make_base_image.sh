#!/usr/bin/env bash
# Builds the local base image (default primerl-base:bookworm) without any registry:
# a minimal Debian bookworm root filesystem made by debootstrap (--variant=minbase)
# with python3 (3.11), venv/ensurepip and CA certificates, imported with `docker import`.
#
# Usage: deploy/docker/make_base_image.sh [--force]
# Env:   BASE_IMAGE (tag, default primerl-base:bookworm), DEBIAN_MIRROR,
#        DEBIAN_SECURITY_MIRROR, DEBIAN_SUITE (default bookworm), DOCKER (default docker).
# Needs root (debootstrap) and installs debootstrap with apt-get when it is missing.
# Idempotent: does nothing when the image already exists (unless --force).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BASE_IMAGE="${BASE_IMAGE:-primerl-base:bookworm}"
DEBIAN_SUITE="${DEBIAN_SUITE:-bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
DOCKER="${DOCKER:-docker}"
WORK_DIR="${REPO_ROOT}/.cache/docker-base"
ROOTFS="${WORK_DIR}/rootfs"
# What Python needs to create a venv and run pip over TLS; passwd for useradd,
# tzdata for zoneinfo, libnuma1 for vLLM's CPU kernels (the inference Dockerfile
# installs it itself on bases that lack it). minbase brings only Essential packages and apt.
PACKAGES="python3,python3-venv,ca-certificates,passwd,tzdata,libnuma1"

force=0
[[ "${1:-}" == "--force" ]] && force=1

if [[ $force -eq 0 ]] && "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "base image $BASE_IMAGE exists: skipping (use --force to rebuild)"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "make_base_image.sh: debootstrap needs root" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  echo "installing debootstrap"
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
fi

start=$(date +%s)
rm -rf "$ROOTFS"
mkdir -p "$WORK_DIR"
echo "debootstrap $DEBIAN_SUITE ($DEBIAN_MIRROR) into $ROOTFS"
debootstrap --variant=minbase --include="$PACKAGES" "$DEBIAN_SUITE" "$ROOTFS" "$DEBIAN_MIRROR"

# Security and point-release updates: debootstrap installs only from the release itself.
cat > "$ROOTFS/etc/apt/sources.list" <<SOURCES
deb $DEBIAN_MIRROR $DEBIAN_SUITE main
deb $DEBIAN_MIRROR $DEBIAN_SUITE-updates main
deb $DEBIAN_SECURITY_MIRROR $DEBIAN_SUITE-security main
SOURCES
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
mount -t proc proc "$ROOTFS/proc"
trap 'umount "$ROOTFS/proc" 2>/dev/null || true' EXIT
chroot "$ROOTFS" /bin/sh -ec '
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get upgrade -y -q
  apt-get clean
'
# Lazily when busy: a process outside the chroot (dockerd started meanwhile) can hold it.
umount "$ROOTFS/proc" 2>/dev/null || umount --lazy "$ROOTFS/proc"
trap - EXIT

# Slim down: package caches and lists, docs (copyright notices stay), man pages,
# translations; the same things the official slim images leave out.
(
  cd "$ROOTFS"
  rm -rf var/lib/apt/lists/* var/cache/apt/*.bin var/cache/debconf/*-old var/log/* \
    usr/share/man/* usr/share/info/* usr/share/locale/* usr/share/lintian tmp/* \
    etc/resolv.conf etc/hostname
  find usr/share/doc -mindepth 1 -not -name copyright -not -type d -delete
  find usr/share/doc -mindepth 1 -type d -empty -delete
  find usr/lib/python3* -name __pycache__ -type d -prune -exec rm -rf {} +
  : > etc/machine-id
)
# Keep the slimming in effect for packages users install later.
cat > "$ROOTFS/etc/dpkg/dpkg.cfg.d/01-primerl-slim" <<'DPKG'
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
DPKG

echo "importing as $BASE_IMAGE"
tar --numeric-owner --xattrs -C "$ROOTFS" -c . | "$DOCKER" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --message "primerl base: debootstrap $DEBIAN_SUITE minbase + $PACKAGES" \
  - "$BASE_IMAGE" >/dev/null
rm -rf "$ROOTFS"
"$DOCKER" image ls "$BASE_IMAGE"
echo "base image $BASE_IMAGE built in $(($(date +%s) - start))s"
