import asyncio
import functools

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common.testing import bare_server
from primerl_router.replica import Replica
from primerl_router.versions import BroadcasterFollower


def update(replica_id: str, address: str, state: int, version: int, *, removed: bool = False):
    status = wb_pb2.ReplicaStatus(replica_id=replica_id, address=address, state=state, policy_version=version)
    return wb_pb2.WatchReplicasResponse(replica=status, removed=removed, latest_policy_version=version)


def test_updates_match_by_id_then_address_and_late_joiners_get_the_last_state():
    replicas = [Replica("a", "10.0.0.1:1"), Replica("b", "10.0.0.2:1")]
    changes = []
    follower = BroadcasterFollower("wb:1", lambda: replicas, on_change=lambda: changes.append(1))

    follower.apply(update("a", "elsewhere:1", wb_pb2.REPLICA_STATE_UPDATING, 3))
    assert replicas[0].updating and replicas[0].policy_version == 3
    follower.apply(update("wb-name-of-b", "10.0.0.2:1", wb_pb2.REPLICA_STATE_CURRENT, 4))
    assert replicas[1].policy_version == 4 and not replicas[1].updating
    assert len(changes) == 2

    follower.apply(update("c", "10.0.0.3:1", wb_pb2.REPLICA_STATE_UPDATING, 2))
    late = Replica("c", "10.0.0.3:1")
    follower.on_register(late)
    assert late.updating and late.policy_version == 2


def test_adapter_versions_the_broadcaster_pushed_count_for_adapter_requests():
    replicas = [Replica("a", "10.0.0.1:1")]
    follower = BroadcasterFollower("wb:1", lambda: replicas, on_change=lambda: None)
    status = update("a", "", wb_pb2.REPLICA_STATE_CURRENT, 3)
    status.replica.adapter_versions["run-a"] = 7
    follower.apply(status)
    assert replicas[0].policy_version == 3 and replicas[0].adapter_versions == {b"run-a": 7}


def test_removal_and_disconnection_clear_the_updating_flag():
    replicas = [Replica("a", "10.0.0.1:1"), Replica("b", "10.0.0.2:1")]
    follower = BroadcasterFollower("wb:1", lambda: replicas, on_change=lambda: None)
    follower.apply(update("a", "", wb_pb2.REPLICA_STATE_UPDATING, 3))
    follower.apply(update("a", "", wb_pb2.REPLICA_STATE_UPDATING, 3, removed=True))
    assert not replicas[0].updating and replicas[0].policy_version == 3

    follower.apply(update("b", "", wb_pb2.REPLICA_STATE_UPDATING, 5))
    follower._disconnected()
    assert not replicas[1].updating and replicas[1].policy_version == 5


class Broadcaster(wb_pb2_grpc.WeightBroadcasterServiceServicer):
    """A weight broadcaster's WatchReplicas: each subscription gets the next
    script of updates, then the stream ends (as when the broadcaster restarts)."""

    def __init__(self, scripts):
        self.scripts = list(scripts)
        self.num_subscriptions = 0

    async def WatchReplicas(self, request, context):
        self.num_subscriptions += 1
        for item in self.scripts.pop(0) if self.scripts else []:
            yield item
        if not self.scripts:
            await asyncio.Event().wait()  # then stays connected


async def test_follows_the_stream_and_clears_update_state_when_it_breaks():
    replica = Replica("a", "10.0.0.1:1")
    broadcaster = Broadcaster(
        [
            [update("a", "", wb_pb2.REPLICA_STATE_UPDATING, 3)],
            [update("a", "", wb_pb2.REPLICA_STATE_CURRENT, 4)],
        ]
    )
    states = []
    async with bare_server(
        functools.partial(wb_pb2_grpc.add_WeightBroadcasterServiceServicer_to_server, broadcaster)
    ) as address:
        follower = BroadcasterFollower(
            address,
            lambda: [replica],
            on_change=lambda: states.append((replica.policy_version, replica.updating, follower.connected)),
        )
        task = asyncio.create_task(follower.run())
        try:
            for _ in range(200):
                if broadcaster.num_subscriptions == 2 and replica.policy_version == 4:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
    # Updating at 3; the stream broke (updating cleared); reconnected; current at 4.
    assert states == [(3, True, True), (3, False, False), (4, False, True)]
