"""Generate through a real router to a real replica server that answers at once."""

import grpc
import pytest

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2
from primerl.router.v1 import router_pb2
from primerl_common.testing import bare_server, in_process_service
from primerl_router.config import RouterConfig
from primerl_router.server import build

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
RESPONSES = [
    inference_pb2.GenerateResponse(
        output=generation_pb2.GenerationOutput(offset=offset, token_ids=[7, 8], finished=offset == 2)
    ).SerializeToString()
    for offset in (0, 2)
]


async def through_router(generate, request: bytes, metadata=()) -> list[bytes]:
    """Generate of `request` through a real router to one replica server whose Generate is `generate`."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(generate)}
    async with bare_server(
        lambda server: server.add_registered_method_handlers("primerl.inference.v1.InferenceService", handlers)
    ) as replica:
        config = RouterConfig(
            server={"host": "127.0.0.1", "port": 0}, replicas=[{"replica_id": "r0", "address": replica}]
        )
        # A plain channel: the caller's metadata (a traceparent) goes as it is.
        async with (
            in_process_service(await build(config), config) as router,
            grpc.aio.insecure_channel(router.address) as channel,
        ):
            generate_raw = channel.unary_stream("/primerl.router.v1.RouterService/Generate")  # bytes both ways
            return [message async for message in generate_raw(request, metadata=metadata)]


REQUEST = router_pb2.GenerateRequest(
    input=generation_pb2.GenerationInput(request_id="a", prompt_token_ids=[1, 2, 3]),
    routing=router_pb2.RoutingHints(session_key="episode-1"),
).SerializeToString()


async def test_request_bytes_responses_and_the_callers_trace_context_pass_through():
    received = []

    async def generate(request: bytes, context: grpc.aio.ServicerContext) -> None:
        received.append((request, dict(context.invocation_metadata())))
        for message in RESPONSES:
            await context.write(message)

    metadata = (("traceparent", TRACEPARENT), ("tracestate", "vendor=1"), ("x-other", "not forwarded"))
    responses = await through_router(generate, REQUEST, metadata)
    assert responses == RESPONSES
    [(forwarded, replica_metadata)] = received
    assert forwarded == REQUEST
    assert replica_metadata["traceparent"] == TRACEPARENT and replica_metadata["tracestate"] == "vendor=1"
    assert "x-other" not in replica_metadata


async def test_a_replica_refusing_the_request_reaches_the_client_with_its_code_details_and_trailers():
    async def generate(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: at most 2", (("primerl-reason", "OUT_OF_RANGE"),)
        )

    with pytest.raises(grpc.aio.AioRpcError) as error:
        await through_router(generate, REQUEST)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "sampling.temperature: at most 2"
    assert ("primerl-reason", "OUT_OF_RANGE") in tuple(error.value.trailing_metadata())
