"""The broadcaster keeping real inference replicas (primerl-inference, a tiny float32 dense
model, one process each) on the latest version: push, restart, failure, exact logprobs, and a
replica that was down a long while pushed within a probe interval of coming back."""

import asyncio
import pathlib

import pytest

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_common.processes import free_port
from primerl_common.testing import eventually
from primerl_launcher.tiny_model import make_tiny_model
from services.weight_broadcaster.tests.helpers import publish, replica_states, running_broadcaster, wait_for

from .replicas import START_TIMEOUT_S, TOLERANCE, logprobs, max_difference, perturbed, replica, served_version

pytestmark = pytest.mark.slow


async def test_replicas_follow_published_versions(tmp_path: pathlib.Path):
    model = make_tiny_model(tmp_path / "tiny-dense", kind="dense", dtype="float32")
    version_1 = perturbed(model, tmp_path / "v1", seed=1)
    version_2 = perturbed(model, tmp_path / "v2", seed=2)
    a, b = replica(model, free_port()), replica(model, free_port())
    started = [a, b]  # everything started, stopped at the end whatever happens
    try:
        await asyncio.gather(a.start(START_TIMEOUT_S), b.start(START_TIMEOUT_S))
        # Failed pushes back off up to an hour (no push here fails: the replicas are up); probes
        # of a replica that is down must not.
        async with running_broadcaster(probe_interval_s=0.5, retry_max_s=3600.0) as stub:
            for process, name in ((a, "a"), (b, "b")):
                await stub.RegisterReplica(pb2.RegisterReplicaRequest(replica_id=name, address=process.address))
            original = await logprobs(a)

            # Version 1 reaches both replicas.
            await publish(stub, 1, version_1)
            await wait_for(stub, 1, 2, timeout_s=120)
            assert [await served_version(a), await served_version(b)] == [1, 1]
            updated = await logprobs(a)
            assert max_difference(updated, original) > 0.5
            assert max_difference(await logprobs(b), updated) <= TOLERANCE

            # b is killed, and is down while version 2 is pushed: a moves on, b is FAILED. While it is
            # down it is probed every probe interval: sixteen failures within seconds (with a push's
            # backoff they would take hours). It restarts on its checkpoint (version 0) and is brought
            # to version 2 unasked, pushed once a probe finds it back (a push's backoff would be about
            # an hour by then: the limits only guard a hang).
            b.kill()
            await b.wait()
            await publish(stub, 2, version_2)
            await wait_for(stub, 2, 1)
            assert await served_version(a) == 2
            await eventually(lambda: _state_is(stub, "b", pb2.REPLICA_STATE_FAILED))
            await eventually(lambda: _failed_at_least(stub, "b", 16), timeout_s=60)
            # With b comes a reference engine started on version 2's weights (they start together).
            b = replica(model, b.port)
            reference = replica(tmp_path / "v2", free_port(), initial_policy_version=2)
            started += [b, reference]
            await asyncio.gather(b.start(START_TIMEOUT_S), reference.start(START_TIMEOUT_S))
            await wait_for(stub, 2, 2, timeout_s=120)
            assert await served_version(b) == 2

        # Both serve exactly what an engine started on version 2's weights serves.
        expected = await logprobs(reference)
        assert max_difference(await logprobs(a), expected) <= TOLERANCE
        assert max_difference(await logprobs(b), expected) <= TOLERANCE
        assert max_difference(expected, updated) > 0.5
    finally:
        await asyncio.gather(*(process.stop() for process in started))


async def _state_is(stub, replica_id: str, state: int) -> bool:
    return (await replica_states(stub))[replica_id][0] == state


async def _failed_at_least(stub, replica_id: str, num_failures: int) -> bool:
    status = (await stub.GetStatus(pb2.GetStatusRequest())).replicas
    return any(r.replica_id == replica_id and r.num_consecutive_failures >= num_failures for r in status)
