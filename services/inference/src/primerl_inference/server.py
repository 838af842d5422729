"""Builds the inference service's ServiceDefinition from its config: starts the vLLM engine
first, so the server answers only once the engine can serve.

A dead engine is a dead service: when vLLM's engine process dies, health turns NOT_SERVING at
once, calls get UNAVAILABLE naming the dead engine (liveness.py), and the process stops as on
SIGTERM and exits non-zero (`engine_died`, read by __main__), for the launcher, systemd or
Kubernetes to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2

from primerl.inference.v1 import inference_pb2
from primerl_common import security
from primerl_common.server import ServiceDefinition
from primerl_inference import __version__
from primerl_inference.config import InferenceConfig
from primerl_inference.update_requests import add_inference_service

if TYPE_CHECKING:
    from primerl_inference.engine import InferenceEngine

_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
# Who may call what (primerl_common.security): generation comes through the router, weights
# from the weight broadcaster; operators pause, reset and manage adapters; anyone
# authenticated reads the load and the adapters.
ROLES = {
    "Generate": {security.ROUTER},
    "UpdateWeights": {security.WEIGHT_BROADCASTER},
    "PauseGeneration": {security.OPERATOR},
    "ResumeGeneration": {security.OPERATOR},
    "ResetPrefixCache": {security.ROUTER, security.OPERATOR},
    "GetLoad": security.ANY,
    "WatchLoad": security.ANY,
    "LoadAdapter": {security.WEIGHT_BROADCASTER, security.OPERATOR},
    "UnloadAdapter": {security.WEIGHT_BROADCASTER, security.OPERATOR},
    "ListAdapters": security.ANY,
}

logger = logging.getLogger(__name__)

# Set when the engine died under this process's service: it exits non-zero.
engine_died = threading.Event()


async def build(config: InferenceConfig) -> ServiceDefinition:
    # Importing vLLM takes seconds: deferred to here so that --help and configuration errors
    # answer without it.
    from primerl_inference.engine import InferenceEngine

    return service_definition(await InferenceEngine.start(config), config)


def service_definition(engine: InferenceEngine, config: InferenceConfig) -> ServiceDefinition:
    """The service around a started engine; stopping the service shuts the engine down."""
    from primerl_inference.servicer import InferenceServicer

    watch: asyncio.Task[None] | None = None

    async def set_serving(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *definition.service_names]:
            await definition.health.set(name, status)

    async def watch_engine() -> None:
        reason = await engine.liveness.until_dead()
        logger.error("%s: NOT_SERVING, stopping the process to be restarted", reason)
        engine_died.set()
        await set_serving(False)
        _stop_this_process()

    async def start() -> None:
        nonlocal watch
        watch = asyncio.create_task(watch_engine(), name="inference engine watch")

    async def drain() -> None:
        engine.start_draining()

    async def stop() -> None:
        if watch is not None:
            watch.cancel()
        engine.shutdown()

    definition = ServiceDefinition(
        name="inference",
        version=__version__,
        servicers=[],
        capabilities=engine.capabilities,
        attributes=engine.attributes,
        on_start=[start],
        on_drain=[drain],
        on_stop=[stop],
        # The broadcaster's pushes, sealed on server.sealed_port where it is set.
        sealed_methods=[f"/{_SERVICE.full_name}/UpdateWeights"],
    )
    engine.on_serving_changed = set_serving
    servicer = InferenceServicer(definition, engine, watch_interval_ms=config.load_report.watch_interval_ms)
    definition.servicers = [(add_inference_service, servicer, _SERVICE)]
    definition.permissions = security.method_roles(_SERVICE, ROLES)
    return definition


def _stop_this_process() -> None:
    """SIGTERM to this process: the server's graceful stop (GrpcService) runs, then main exits
    non-zero. Not where the service is embedded in another program (nothing here handles
    SIGTERM then): that program sees NOT_SERVING and decides."""
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
        logger.warning("nothing in this process handles SIGTERM: not stopping it")
        return
    os.kill(os.getpid(), signal.SIGTERM)
