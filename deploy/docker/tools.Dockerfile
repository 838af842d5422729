# primerl-tools: the deployment commands of primerl-launcher (tools/launcher), which no
# service image ships: `primerl-register-replicas` (the compose one-shot
# `register-replica`, the Kubernetes `register` sidecar) and `primerl-make-tiny-model`
# (the compose one-shot `model`). Built FROM the trainer image, which already has what
# they need (grpc and the stubs; torch, transformers and tokenizers for the tiny model):
# it adds two small layers, the launcher's own third-party wheels and its wheel.
# Build from the repository root:
#   deploy/docker/build_images.sh tools
# by hand, once the wheelhouse and primerl-trainer exist:
#   docker build -f deploy/docker/tools.Dockerfile -t primerl-tools .
ARG TRAINER_IMAGE=primerl-trainer:latest

# The launcher's third-party dependencies beyond the trainer image's (matplotlib, tqdm).
FROM ${TRAINER_IMAGE} AS layer-deps
USER root
COPY .cache/wheelhouse/tools/ /wheels/tools/
RUN install -D -m 0644 /wheels/tools/requirements.txt /layer/opt/venv/share/primerl/tools-requirements.txt \
 && if [ -s /wheels/tools/requirements.txt ]; then \
      pip install --no-index --no-deps --no-warn-script-location --root /layer \
        --find-links /wheels/tools -r /wheels/tools/requirements.txt; \
    fi

FROM ${TRAINER_IMAGE} AS layer-app
USER root
COPY .cache/wheelhouse/primerl/primerl_launcher-*.whl /wheels/primerl/
RUN pip install --no-index --no-deps --no-warn-script-location --root /layer \
      /wheels/primerl/primerl_launcher-*.whl

FROM ${TRAINER_IMAGE}
COPY --from=layer-deps /layer/ /
COPY --from=layer-app /layer/ /
# Fails the build when a command cannot start or a package is missing.
RUN primerl-register-replicas --help > /dev/null \
 && primerl-make-tiny-model --help > /dev/null \
 && python -m pip check
ARG VERSION=0.0.0
LABEL org.opencontainers.image.title="primerl-tools" \
      org.opencontainers.image.description="primerl deployment tools: replica registration, the tiny-model maker" \
      org.opencontainers.image.version="${VERSION}"
# No service here: the command is the deployment's (compose entrypoint, Kubernetes command).
HEALTHCHECK NONE
ENTRYPOINT []
CMD ["primerl-register-replicas", "--help"]
