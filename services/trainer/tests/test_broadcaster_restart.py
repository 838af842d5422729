"""A weight broadcaster that restarted (its versions were in RAM) gets the latest version again
from the trainer without a new step, and one that was away gets a failed publish as soon as it is
back, not after the retry's backoff; a resumed trainer republishing a version the broadcaster
kept is no error."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import pathlib

import grpc
import pytest

from primerl.trainer.v1 import trainer_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.errors import ErrorInterceptor, FailedPrecondition
from primerl_common.testing import bare_server, eventually
from primerl_trainer.batch import MicroBatch

from .serving import push, serving, trainer_config, watch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class FakeBroadcaster(weight_broadcaster_pb2_grpc.WeightBroadcasterServiceServicer):
    """Keeps the latest version number and refuses older ones as the real one does."""

    def __init__(self) -> None:
        self.latest = -1
        self.available = True
        self.published: list[int] = []

    def serving(self) -> contextlib.AbstractAsyncContextManager[str]:
        """Served on a free port (its address), its errors mapped as the real one maps them."""
        register = functools.partial(weight_broadcaster_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, self)
        return bare_server(register, interceptors=[ErrorInterceptor()])

    async def PublishWeights(self, request_iterator, context):
        requests = aiter(request_iterator)
        version = (await anext(requests)).begin.policy_version
        async for _ in requests:
            pass
        if not self.available:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        if version <= self.latest:
            raise FailedPrecondition(
                f"policy version {version} is not newer than the latest published {self.latest}",
                reason="POLICY_VERSION_NOT_NEWER",
                metadata={"latest_policy_version": str(self.latest)},
            )
        self.latest = version
        self.published.append(version)
        return pb2.PublishWeightsResponse(policy_version=version)

    async def GetStatus(self, request, context):
        if not self.available:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return pb2.GetStatusResponse(latest_policy_version=self.latest)


async def status_when(stub, predicate, timeout_s: float = 30.0) -> trainer_pb2.GetStatusResponse:
    async with asyncio.timeout(timeout_s):
        while not predicate(status := await stub.GetStatus(trainer_pb2.GetStatusRequest())):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return status


async def test_the_latest_version_is_published_again_to_a_broadcaster_that_lost_it(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]], tmp_path: pathlib.Path
) -> None:
    broadcaster = FakeBroadcaster()
    async with broadcaster.serving() as address:
        # A failed publish would be retried after 30 s: the watch makes it sooner.
        config = trainer_config(
            dense_dir,
            publish={"weight_broadcaster": address, "check_interval_s": 0.1, "initial_backoff_s": 30.0},
            checkpoint={"dir": str(tmp_path / "checkpoints")},
        )
        async with serving(config) as stub:
            await push(stub, 1, rl_batches[0])
            await watch(stub, after_step=0, count=1)
            assert broadcaster.published == [1]
            broadcaster.latest = -1  # it restarted: nothing published survived
            await eventually(lambda: broadcaster.published == [1, 1])
            status = await stub.GetStatus(trainer_pb2.GetStatusRequest())
            assert (status.published_policy_version, status.last_publish_error) == (1, "")

            # Away while step 2 is published; back well before the retry's backoff is over.
            broadcaster.available = False
            await push(stub, 2, rl_batches[1])
            await watch(stub, after_step=1, count=1)
            status = await stub.GetStatus(trainer_pb2.GetStatusRequest())
            assert status.published_policy_version == 1 and "UNAVAILABLE" in status.last_publish_error
            broadcaster.available = True
            await eventually(lambda: broadcaster.published == [1, 1, 2], timeout_s=10)
        # Stopped gracefully (saved at step 2) and resumed: the resumed trainer publishes step 2
        # again, which the broadcaster holds already: no error.
        async with serving(config) as stub:
            status = await status_when(stub, lambda status: status.published_policy_version == 2)
            assert (status.step, status.last_publish_error) == (2, "")
            assert broadcaster.published == [1, 1, 2]


async def test_a_step_is_checkpointed_before_its_version_is_published(
    dense_dir: pathlib.Path, rl_batches: list[list[MicroBatch]], tmp_path: pathlib.Path
) -> None:
    """Killed after a publish and before its checkpoint, a trainer would train the step again
    while the replicas serve the first attempt's weights under that version."""
    checkpoints = tmp_path / "checkpoints"
    latest_at_publish: list[str | None] = []

    class Recording(FakeBroadcaster):
        async def PublishWeights(self, request_iterator, context):
            marker = checkpoints / "latest"
            latest_at_publish.append(marker.read_text().strip() if marker.is_file() else None)
            return await super().PublishWeights(request_iterator, context)

    broadcaster = Recording()
    async with broadcaster.serving() as address:
        config = trainer_config(
            dense_dir, publish={"weight_broadcaster": address}, checkpoint={"dir": str(checkpoints), "interval": 1}
        )
        async with serving(config) as stub:
            for step in (1, 2):
                await push(stub, step, rl_batches[step - 1])
                await watch(stub, after_step=step - 1, count=1)
    assert broadcaster.published == [1, 2]
    # One call a version: this stand-in lists no `publish.striped`, so publish.streams (4) fall back to one.
    assert latest_at_publish == ["step_00000001", "step_00000002"]
