"""Model turns through a router that restarts: a turn that got no output is tried again until
the router is back (or the retry budget is spent); other failures are not retried."""

from __future__ import annotations

import asyncio
import contextlib
import functools

import grpc
import pytest

from primerl.common.v1 import generation_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.processes import free_port
from primerl_common.testing import bare_server
from primerl_orchestrator.generation import GenerationError, GenerationRequest, RouterGeneration

REQUEST = GenerationRequest(
    request_id="episode-0",
    episode_id="episode",
    prompt_token_ids=[1, 2, 3],
    sampling=generation_pb2.SamplingParams(max_tokens=2),
    cache_salt="0",
    min_policy_version=0,
    return_routed_experts=False,
)


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    """Answers each turn with two tokens of version 7, after `num_unavailable` UNAVAILABLE answers."""

    def __init__(self, *, num_unavailable: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.num_unavailable = num_unavailable
        self.code = code
        self.num_calls = 0

    async def Generate(self, request, context):
        self.num_calls += 1
        if self.num_unavailable > 0:
            self.num_unavailable -= 1
            await context.abort(self.code, "no replica")
        yield router_pb2.GenerateResponse(
            output=generation_pb2.GenerationOutput(
                token_ids=[5, 6],
                logprobs=[-0.1, -0.2],
                policy_versions=[7, 7],
                finished=True,
                finish_reason=generation_pb2.FINISH_REASON_STOP,
            )
        )


def serving(router: FakeRouter, port: int) -> contextlib.AbstractAsyncContextManager[str]:
    return bare_server(functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, router), port=port)


async def test_a_turn_waits_for_a_restarting_router():
    port = free_port()
    generation = RouterGeneration(f"127.0.0.1:{port}", timeout_s=30, retry_s=20)
    router = FakeRouter(num_unavailable=2)
    turn = asyncio.create_task(generation.generate(REQUEST))
    try:
        await asyncio.sleep(1.0)  # nothing listens meanwhile: the router is restarting
        async with serving(router, port):
            result = await turn
        assert (result.token_ids, result.policy_versions) == ([5, 6], [7, 7])
        assert router.num_calls == 3  # and two UNAVAILABLE answers once it was up
    finally:
        turn.cancel()
        await generation.close()


async def test_retries_end_with_the_budget_and_other_codes_are_not_retried():
    port = free_port()
    router = FakeRouter(num_unavailable=1000)
    generation = RouterGeneration(f"127.0.0.1:{port}", timeout_s=30, retry_s=1.0)
    try:
        async with serving(router, port):
            with pytest.raises(GenerationError) as error:
                await generation.generate(REQUEST)
            assert error.value.code == grpc.StatusCode.UNAVAILABLE
            assert router.num_calls >= 2

            router.num_calls, router.code = 0, grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(GenerationError) as error:
                await generation.generate(REQUEST)
            assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION and router.num_calls == 1
    finally:
        await generation.close()
