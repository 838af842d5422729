"""Builds the inference service's ServiceDefinition from its config: starts the vLLM engine
first, so the server answers only once the engine can serve."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common import security
from primerl_common.server import ServiceDefinition
from primerl_inference import __version__
from primerl_inference.config import InferenceConfig

if TYPE_CHECKING:
    from primerl_inference.engine import InferenceEngine
    from primerl_inference.servicer import InferenceServicer

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


async def build(config: InferenceConfig) -> ServiceDefinition:
    # Importing vLLM takes seconds: deferred to here so that --help and configuration errors
    # answer without it.
    from primerl_inference.engine import InferenceEngine

    return service_definition(await InferenceEngine.start(config), config)


def service_definition(engine: InferenceEngine, config: InferenceConfig) -> ServiceDefinition:
    """The service around a started engine; stopping the service shuts the engine down."""
    from primerl_inference.servicer import InferenceServicer

    async def drain() -> None:
        engine.start_draining()

    async def stop() -> None:
        engine.shutdown()

    definition = ServiceDefinition(
        name="inference",
        version=__version__,
        servicers=[],
        capabilities=engine.capabilities,
        attributes=engine.attributes,
        on_drain=[drain],
        on_stop=[stop],
    )
    servicer = InferenceServicer(definition, engine, watch_interval_ms=config.load_report.watch_interval_ms)
    definition.servicers = [(_add_inference_service, servicer, _SERVICE)]
    definition.permissions = security.method_roles(_SERVICE, ROLES)
    return definition


def _add_inference_service(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    # UpdateWeights again, with no request deserializer: its requests arrive as bytes, and
    # weight data is staged from them without protobuf's copies (servicer.parse_update_request).
    # A later registration of a method replaces the earlier one.
    handler = grpc.stream_unary_rpc_method_handler(
        servicer.UpdateWeights, response_serializer=inference_pb2.UpdateWeightsResponse.SerializeToString
    )
    server.add_registered_method_handlers(_SERVICE.full_name, {"UpdateWeights": handler})
