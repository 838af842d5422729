"""The orchestrator served in this process, through its real stub; its peers (trainer and router)
are bare servers standing in for them. What GetRunStatus says of the run's groups (why steps
come or not), and FinishEpisode on an episode that never generated a turn."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2_grpc
from primerl_common.errors import error_details, field_violations
from primerl_common.testing import bare_server, eventually, in_process_service
from primerl_launcher.tiny_model import save_tokenizer
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.server import build

from .stand_ins import StandInRouter, StandInTrainer, finish, play_group, start_group, turn


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(path)
    return path


@contextlib.asynccontextmanager
async def orchestrator(
    model_dir: pathlib.Path,
    trainer: trainer_pb2_grpc.TrainerServiceServicer,
    output: dict[str, Any] | None = None,
    *,
    router: router_pb2_grpc.RouterServiceServicer | None = None,
    max_model_len: int = 64,
    **run: Any,
) -> AsyncIterator[orchestrator_pb2_grpc.OrchestratorServiceStub]:
    """A served orchestrator (environment "guess", groups of 2) with `trainer` and `router` (a
    StandInRouter by default) as its peers, once its run is running at policy version 0."""
    async with (
        bare_server(functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer)) as trainer_at,
        bare_server(
            functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, router or StandInRouter())
        ) as router_at,
    ):
        config = OrchestratorConfig(
            server={"host": "127.0.0.1", "port": 0},
            peers={"router": router_at, "trainer": trainer_at, "poll_interval_s": 0.05},
            model={"path": model_dir, "max_model_len": max_model_len},
            environments=[{"name": "guess", "group_size": 2}],
            run={"batch_size": 2, "max_steps": 3, **run},
            output=output or {},
        )
        async with in_process_service(await build(config), config) as served:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(served.channel)

            async def running() -> bool:
                status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
                return status.state == orchestrator_pb2.RUN_STATE_RUNNING and status.policy_version == 0

            await eventually(running, timeout_s=30, what="the run is running at policy version 0")
            yield stub


async def groups(stub: orchestrator_pb2_grpc.OrchestratorServiceStub) -> orchestrator_pb2.GroupCounts:
    return (await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())).groups


async def refusal(call) -> tuple[grpc.StatusCode, str]:
    """The status code and ErrorInfo reason a call fails with."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    reasons = [d.reason for d in error_details(info.value) if isinstance(d, error_details_pb2.ErrorInfo)]
    return info.value.code(), reasons[0] if reasons else ""


async def test_groups_with_equal_rewards_are_filtered_and_no_step_comes_until_one_differs(model_dir, tmp_path):
    trainer = StandInTrainer()
    metrics = tmp_path / "metrics.jsonl"
    async with orchestrator(model_dir, trainer, output={"metrics_jsonl": metrics}) as stub:
        for index in range(3):
            await play_group(stub, f"equal-{index}", [0.5, 0.5])
        status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
        assert (status.groups.finished, status.groups.filtered_equal_rewards, status.groups.batched) == (3, 3, 0)
        assert (status.groups.incomplete, status.groups.episodes_timed_out) == (0, 0)
        assert status.step == 0 and trainer.pushed == []

        await play_group(stub, "informative", [1.0, 0.0])
        await eventually(lambda: trainer.pushed == [1], timeout_s=30, what="the trainer got the batch of step 1")
        counts = await groups(stub)
        assert (counts.finished, counts.filtered_equal_rewards, counts.batched) == (4, 3, 1)
    # The step's metrics count the same since the step before (here: since the start).
    [record] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert {key: value for key, value in record.items() if "groups" in key or "timed_out" in key} == {
        "num_groups_finished": 4,
        "num_groups_filtered_equal_rewards": 3,
        "num_groups_incomplete": 0,
        "num_episodes_timed_out": 0,
        "num_groups_batched": 1,
    }


async def test_a_reward_before_any_turn_is_refused_and_the_episode_stays_open(model_dir):
    async with orchestrator(model_dir, StandInTrainer()) as stub:
        first, second = await start_group(stub, "no-turn")
        assert await refusal(finish(stub, first, 1.0)) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_TURN_GENERATED")
        # Still open: it can generate, then finish with its reward.
        await turn(stub, first)
        assert (await finish(stub, first, 1.0)).num_samples == 1
        # Abandoning an episode that generated nothing is accepted: its group is incomplete.
        assert (await finish(stub, second, discard=True)).group_complete
        counts = await groups(stub)
        assert (counts.finished, counts.incomplete) == (0, 1)


async def test_an_episode_abandoned_to_the_timeout_leaves_its_group_incomplete(model_dir):
    async with orchestrator(model_dir, StandInTrainer(), episode_timeout_s=0.5) as stub:
        episode_id, _ = await start_group(stub, "abandoned")

        async def timed_out() -> bool:
            return (await groups(stub)).episodes_timed_out == 2

        await eventually(timed_out, timeout_s=30, what="both episodes timed out")
        counts = await groups(stub)
        assert (counts.finished, counts.incomplete) == (0, 1)
        assert await refusal(turn(stub, episode_id)) == (grpc.StatusCode.FAILED_PRECONDITION, "EPISODE_DROPPED")


def png(width: int, height: int) -> bytes:
    from PIL import Image

    encoded = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(encoded, format="PNG")
    return encoded.getvalue()


def parts_turn(
    episode_id: str, *parts: orchestrator_pb2.ContentPart, content: str = ""
) -> orchestrator_pb2.GenerateRequest:
    message = orchestrator_pb2.ChatMessage(role="user", content=content, parts=parts)
    return orchestrator_pb2.GenerateRequest(
        episode_id=episode_id, messages=orchestrator_pb2.ChatMessages(messages=[message])
    )


def text(value: str) -> orchestrator_pb2.ContentPart:
    return orchestrator_pb2.ContentPart(text=value)


def image(data: bytes = b"", mime_type: str = "image/png", uri: str = "") -> orchestrator_pb2.ContentPart:
    part = orchestrator_pb2.ImagePart(uri=uri) if uri else orchestrator_pb2.ImagePart(data=data)
    part.mime_type = mime_type
    return orchestrator_pb2.ContentPart(image=part)


async def test_a_text_model_checks_images_then_refuses_them_while_the_episode_goes_on(model_dir):
    async with orchestrator(model_dir, StandInTrainer()) as stub:
        episode_id, other = await start_group(stub, "parts")
        bad = {
            "messages.messages[0].content": parts_turn(episode_id, text("hi"), content="hi"),
            "messages.messages[0].parts[1].image.data": parts_turn(episode_id, text("a"), image(b"\x89PNG cut")),
            "messages.messages[0].parts[0].image.mime_type": parts_turn(episode_id, image(png(4, 4), "image/tiff")),
            # 20 megapixels: refused from the header, before the pixels are decoded.
            "messages.messages[0].parts[0].image.data": parts_turn(episode_id, image(png(5000, 4000))),
            "messages.messages[0].parts[0]": parts_turn(episode_id, orchestrator_pb2.ContentPart()),
        }
        for field, request in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Generate(request, timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in field_violations(error.value), (field, error.value.details())
        # A well-formed image: the model reads text only, so the turn is refused whole.
        for part in (image(png(32, 24)), image(uri="file:///images/a.png")):
            assert await refusal(stub.Generate(parts_turn(episode_id, text("what is this? "), part), timeout=10)) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "CAPABILITY_MISSING",
            )
        # Text parts are the message's text (the same prompt as `content`); the episode took none of
        # the refused turns.
        response = await stub.Generate(parts_turn(episode_id, text("h"), text("i")), timeout=10)
        as_content = await stub.Generate(parts_turn(other, content="hi"), timeout=10)
        assert (response.turn, response.num_prompt_tokens) == (0, as_content.num_prompt_tokens)
