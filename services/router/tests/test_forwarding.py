"""Generate through a real router to a real replica server that answers at once; the adapter
owner check on the forwarding path, with callers named by real certificates."""

import types

import grpc
import pytest
from cryptography import x509

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2
from primerl.router.v1 import router_pb2
from primerl_common.security import PermissionDenied
from primerl_common.security.certificates import Holder, make_authority, make_certificate
from primerl_common.testing import bare_server, in_process_service
from primerl_router.config import RouterConfig, RoutingConfig
from primerl_router.forwarding import Forwarder
from primerl_router.policies import make_policy
from primerl_router.pool import ReplicaPool
from primerl_router.replica import Replica
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


class CallContext:
    """A client's call as the forwarder sees it: made over mTLS with the certificate `pem`."""

    def __init__(self, pem: bytes) -> None:
        self.pem, self.written = pem, []

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"transport_security_type": [b"ssl"], "x509_pem_cert": [self.pem]}

    def peer_identities(self) -> list[bytes]:
        names = x509.load_pem_x509_certificate(self.pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
        return [str(name.value).encode() for name in names.value]

    def peer_identity_key(self) -> str:
        return "x509_subject_alternative_name"

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> float:
        return 10.0

    async def write(self, message: bytes) -> None:
        self.written.append(message)

    async def abort(self, code, details="", trailers=()) -> None:
        raise AssertionError(f"aborted: {code} {details}")


class ReplicaCall:
    def __init__(self) -> None:
        self.messages = [RESPONSES[-1], grpc.aio.EOF]

    async def read(self):
        return self.messages.pop(0)

    def cancel(self) -> None:
        pass


class RecordingUpstream:
    def __init__(self) -> None:
        self.requests = []

    def generate(self, request: bytes, **_) -> ReplicaCall:
        self.requests.append(request)
        return ReplicaCall()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    directory = tmp_path_factory.mktemp("certs")
    authority = make_authority(directory)
    holders = ["alice:tenant", "bob:tenant", "launcher:operator"]
    return {
        holder.partition(":")[0]: make_certificate(authority, directory, Holder.parse(holder))[0].read_bytes()
        for holder in holders
    }


def adapter_request(adapter: str) -> bytes:
    generation = generation_pb2.GenerationInput(request_id="a", prompt_token_ids=[1, 2, 3], lora_adapter=adapter)
    return router_pb2.GenerateRequest(input=generation).SerializeToString()


@pytest.mark.parametrize("disaggregate", [False, True])
async def test_an_owned_adapter_is_served_to_its_owner_and_operators_only(certificates, disaggregate):
    pool = ReplicaPool(make_policy("round_robin", {}))
    replica = Replica("r0", "127.0.0.1:1")
    replica.apply_load(
        generation_pb2.LoadReport(adapter_versions={"run-a": 1, "shared": 1}, adapter_owners={"run-a": "alice"})
    )
    pool.add(replica)
    upstream = RecordingUpstream()
    fleet = types.SimpleNamespace(pool=pool, upstream=lambda _: upstream)
    forwarder = Forwarder(fleet, RoutingConfig(no_replica_wait_s=0, disaggregate=disaggregate))

    with pytest.raises(PermissionDenied, match="adapter 'run-a' is not bob") as refused:
        await forwarder.generate(adapter_request("run-a"), CallContext(certificates["bob"]))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED and refused.value.reason == "NOT_ADAPTER_OWNER"
    assert upstream.requests == [] and replica.num_requests_total == 0  # no replica was picked or called

    if disaggregate:
        return  # the halves' own path is services/inference/tests/test_kv_handoff.py's
    for caller, adapter in [("alice", "run-a"), ("launcher", "run-a"), ("bob", "shared")]:
        context = CallContext(certificates[caller])
        await forwarder.generate(adapter_request(adapter), context)
        assert context.written == RESPONSES[-1:]
    assert len(upstream.requests) == 3
