import grpc
import pytest

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2
from primerl.router.v1 import router_pb2
from primerl_common.errors import InvalidArgument
from primerl_router.request import parse_route_request


def encode(prompt=(), session_key="", **fields) -> bytes:
    generation = generation_pb2.GenerationInput(
        prompt_token_ids=list(prompt),
        sampling=generation_pb2.SamplingParams(max_tokens=8, stop_token_ids=[1, 2]),
        stream=generation_pb2.StreamOptions(every_n_tokens=4),
        **fields,
    )
    routing = router_pb2.RoutingHints(session_key=session_key, role=generation_pb2.REPLICA_ROLE_DECODE)
    return router_pb2.GenerateRequest(input=generation, routing=routing).SerializeToString()


def test_reads_routing_fields_and_the_packed_prompt():
    prompt = [5, 300, 70000, 151000, 0]
    data = encode(prompt, "episode-7", request_id="r1", cache_salt="v3", lora_adapter="a", min_policy_version=3)
    route = parse_route_request(data)
    assert route.session_key == b"episode-7"
    assert route.request_id == b"r1" and route.cache_salt == b"v3" and route.lora_adapter == b"a"
    assert route.min_policy_version == 3
    assert route.role == generation_pb2.REPLICA_ROLE_DECODE
    assert route.num_prompt_tokens == len(prompt)
    # The prompt stays as its wire encoding: the packed field's payload.
    packed = generation_pb2.GenerationInput(prompt_token_ids=prompt).SerializeToString()
    assert packed.endswith(route.prompt)


def test_shared_token_prefix_is_a_shared_byte_prefix():
    a = parse_route_request(encode([1, 200, 3, 40000, 5]))
    b = parse_route_request(encode([1, 200, 3, 40000, 6, 7]))
    assert a.prompt[:-1] == b.prompt[: len(a.prompt) - 1]


def test_inference_request_bytes_route_through_metadata():
    data = inference_pb2.GenerateRequest(
        input=generation_pb2.GenerationInput(prompt_token_ids=[1, 2], min_policy_version=2)
    ).SerializeToString()
    route = parse_route_request(data, [("primerl-session-key", "ep"), ("primerl-min-policy-version", "5")])
    assert route.session_key == b"ep"
    assert route.min_policy_version == 5  # the stricter of body and metadata
    assert parse_route_request(data, [("primerl-min-policy-version", "1")]).min_policy_version == 2


def test_negative_version_and_unknown_fields():
    data = encode([1], min_policy_version=-1) + b"\xa2\x06\x03abc"  # field 100, LEN: unknown, skipped
    assert parse_route_request(data).min_policy_version == -1


def test_unpacked_prompt_reads_like_packed():
    # Field 2 of GenerationInput as one VARINT per token (legal, though no proto3 encoder writes it).
    unpacked_input = b"\x10\x05\x10\xac\x02"  # 5, 300
    data = b"\x0a" + bytes([len(unpacked_input)]) + unpacked_input
    route = parse_route_request(data)
    assert route.num_prompt_tokens == 2
    assert route.prompt == b"\x05\xac\x02"


@pytest.mark.parametrize("data", [b"\x0a\x05\x10", b"\xff", b"\x0a\x02\x12\x09", b"\x0b"])
def test_malformed_bytes_are_invalid_argument(data):
    with pytest.raises(InvalidArgument) as error:
        parse_route_request(data)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_metadata_version_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="primerl-min-policy-version"):
        parse_route_request(encode([1]), [("primerl-min-policy-version", "soon")])
