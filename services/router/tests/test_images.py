"""Requests with images go only to replicas whose GetServiceInfo lists `generate.images`: a
replica of a release before images would drop the field and sample without them. Through a
real router to real replica servers."""

import contextlib
import functools

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from primerl.common.v1 import generation_pb2, service_info_pb2
from primerl.inference.v1 import inference_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.images import CAPABILITY_IMAGES, ROUTER_CAPABILITY_IMAGES
from primerl_common.testing import bare_server, in_process_service
from primerl_router.config import RouterConfig
from primerl_router.request import parse_route_request
from primerl_router.server import build

PNG = generation_pb2.ImageData(data=b"\x89PNG not decoded by the router", mime_type="image/png")


def request(num_images: int, key: str = "episode") -> bytes:
    generation = generation_pb2.GenerationInput(request_id=key, prompt_token_ids=[1, 2, 3], images=[PNG] * num_images)
    return router_pb2.GenerateRequest(
        input=generation, routing=router_pb2.RoutingHints(session_key=key)
    ).SerializeToString()


def test_the_router_counts_the_images_of_a_request_without_decoding_them():
    assert parse_route_request(request(0)).num_images == 0
    assert parse_route_request(request(3)).num_images == 3
    # The prompt is read as before, whatever follows it.
    assert parse_route_request(request(2)).num_prompt_tokens == 3


class Replica:
    """An inference replica that lists `capabilities` and answers each Generate with its name."""

    def __init__(self, name: str, capabilities: list[str]) -> None:
        self.name, self.capabilities, self.served = name, capabilities, []
        self.health = health.aio.HealthServicer()

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        self.served.append(request)
        output = generation_pb2.GenerationOutput(replica_id=self.name, finished=True)
        await context.write(inference_pb2.GenerateResponse(output=output).SerializeToString())

    async def service_info(self, request, context) -> inference_pb2.GetServiceInfoResponse:
        info = service_info_pb2.ServiceInfo(service_name="inference", capabilities=self.capabilities)
        return inference_pb2.GetServiceInfoResponse(info=info)

    def register(self, server: grpc.aio.Server) -> None:
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(self.generate),
            "GetServiceInfo": grpc.unary_unary_rpc_method_handler(
                self.service_info,
                request_deserializer=inference_pb2.GetServiceInfoRequest.FromString,
                response_serializer=inference_pb2.GetServiceInfoResponse.SerializeToString,
            ),
        }
        server.add_registered_method_handlers("primerl.inference.v1.InferenceService", handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)


@contextlib.asynccontextmanager
async def router_over(*replicas: Replica):
    async with contextlib.AsyncExitStack() as stack:
        addresses = [await stack.enter_async_context(bare_server(replica.register)) for replica in replicas]
        for replica in replicas:
            await replica.health.set("primerl.inference.v1.InferenceService", health_pb2.HealthCheckResponse.SERVING)
        config = RouterConfig(
            server={"host": "127.0.0.1", "port": 0},
            policy={"name": "round_robin"},
            routing={"no_replica_wait_s": 2.0},
            replicas=[
                {"replica_id": replica.name, "address": address}
                for replica, address in zip(replicas, addresses, strict=True)
            ],
        )
        router = await stack.enter_async_context(in_process_service(await build(config), config))
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(router.address))
        generate = channel.unary_stream(
            "/primerl.router.v1.RouterService/Generate",
            response_deserializer=inference_pb2.GenerateResponse.FromString,
        )
        yield router, functools.partial(served_by, generate)


async def served_by(generate, request_bytes: bytes) -> str:
    [response] = [response async for response in generate(request_bytes)]
    return response.output.replica_id


async def test_requests_with_images_go_only_to_replicas_that_take_them():
    text, vision = Replica("text", ["generate.prompt_logprobs"]), Replica("vision", [CAPABILITY_IMAGES])
    async with router_over(text, vision) as (router, send):
        assert [await send(request(1, f"image-{i}")) for i in range(6)] == ["vision"] * 6
        assert {await send(request(0, f"text-{i}")) for i in range(6)} == {"text", "vision"}
        stub = router_pb2_grpc.RouterServiceStub(router.channel)
        info = await stub.GetServiceInfo(router_pb2.GetServiceInfoRequest())
        assert ROUTER_CAPABILITY_IMAGES in info.info.capabilities
    assert all(parse_route_request(served).num_images == 0 for served in text.served)


async def test_images_with_no_replica_that_takes_them_fail_naming_the_capability_and_text_still_flows():
    async with router_over(Replica("text", []), Replica("old", [])) as (_, send):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await send(request(2))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert CAPABILITY_IMAGES in error.value.details()
        assert "text: no capability generate.images" in error.value.details()
        assert await send(request(0)) in {"text", "old"}
