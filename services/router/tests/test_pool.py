import asyncio

import pytest

from primerl.common.v1 import generation_pb2
from primerl_common.errors import FailedPrecondition, NotFound, Unavailable
from primerl_common.security import LOCAL, OPERATOR, TENANT, Caller, PermissionDenied
from primerl_router.policies import make_policy
from primerl_router.pool import ReplicaPool
from primerl_router.replica import Replica
from primerl_router.request import RouteRequest


def make_pool(count: int, *, policy: str = "round_robin", avoid_updating: bool = True) -> ReplicaPool:
    pool = ReplicaPool(make_policy(policy, {}), avoid_updating=avoid_updating)
    for index in range(count):
        replica = Replica(f"r{index}", f"127.0.0.1:{9000 + index}")
        replica.apply_load(generation_pb2.LoadReport(policy_version=1))
        pool.add(replica)
    return pool


def test_picks_only_eligible_replicas_and_honours_exclusions():
    pool = make_pool(3)
    pool.get("r0").draining = True
    pool.get("r1").apply_load(generation_pb2.LoadReport(policy_version=0))
    picks = {pool.try_pick(RouteRequest(min_policy_version=1)).replica_id for _ in range(5)}
    assert picks == {"r2"}
    assert pool.try_pick(RouteRequest(min_policy_version=1), [pool.get("r2")]) is None


def test_updating_replicas_are_avoided_while_others_can_serve():
    pool = make_pool(2)
    pool.get("r0").apply_broadcaster_state(policy_version=1, updating=True)
    assert {pool.try_pick(RouteRequest()).replica_id for _ in range(4)} == {"r1"}
    pool.get("r1").draining = True
    assert pool.try_pick(RouteRequest()).replica_id == "r0"  # the only one left: better late than never

    relaxed = make_pool(2, avoid_updating=False)
    relaxed.get("r0").apply_broadcaster_state(policy_version=1, updating=True)
    assert {relaxed.try_pick(RouteRequest()).replica_id for _ in range(4)} == {"r0", "r1"}


async def test_pick_waits_for_a_replica_to_reach_the_version():
    pool = make_pool(1)
    request = RouteRequest(min_policy_version=2)

    async def update_later():
        await asyncio.sleep(0.05)
        pool.get("r0").apply_load(generation_pb2.LoadReport(policy_version=2))
        pool.notify()

    updater = asyncio.create_task(update_later())
    replica = await asyncio.wait_for(pool.pick(request, wait_s=2), 1)
    assert replica.replica_id == "r0" and replica.policy_version == 2
    await updater


async def test_no_replica_errors_say_why():
    pool = make_pool(2)
    with pytest.raises(FailedPrecondition, match=r"policy version >= 5 .*r0: policy version 1"):
        await pool.pick(RouteRequest(min_policy_version=5), wait_s=0.05)
    for replica in pool:
        replica.draining = True
    with pytest.raises(Unavailable, match="r0: draining, r1: draining"):
        await pool.pick(RouteRequest(), wait_s=0)
    with pytest.raises(Unavailable, match="none"):
        await make_pool(0).pick(RouteRequest())


def test_membership_reaches_the_policy_and_unknown_ids_are_not_found():
    pool = make_pool(2, policy="consistent_hash")
    request = RouteRequest(session_key=b"episode")
    owner = pool.try_pick(request)
    pool.remove(owner.replica_id)
    assert owner.replica_id not in pool and len(pool) == 1
    assert pool.try_pick(request) is not owner
    with pytest.raises(NotFound):
        pool.get(owner.replica_id)


async def test_requests_naming_an_adapter_go_where_it_is_at_their_version():
    pool = make_pool(3)
    pool.get("r0").apply_load(generation_pb2.LoadReport(policy_version=1, adapter_versions={"run-a": 3}))
    # The broadcaster pushed a newer one to r1 before r1's next load report says so.
    pool.get("r1").apply_load(generation_pb2.LoadReport(policy_version=1, adapter_versions={"run-a": 2}))
    pool.get("r1").apply_broadcaster_state(policy_version=1, updating=False, adapter_versions={"run-a": 4})
    # r2 holds no adapter: it serves the base model (policy version 1) only.
    assert {pool.try_pick(RouteRequest(lora_adapter=b"run-a")).replica_id for _ in range(6)} == {"r0", "r1"}
    # The adapter's version counts, not the base weights'.
    assert pool.try_pick(RouteRequest(lora_adapter=b"run-a", min_policy_version=4)).replica_id == "r1"
    assert {pool.try_pick(RouteRequest(min_policy_version=1)).replica_id for _ in range(6)} == {"r0", "r1", "r2"}

    with pytest.raises(FailedPrecondition, match=r"adapter 'run-a' at policy version >= 5 .*r0: policy version 3"):
        await pool.pick(RouteRequest(lora_adapter=b"run-a", min_policy_version=5))
    with pytest.raises(FailedPrecondition, match=r"no replica holds LoRA adapter 'run-b'.*r2: no adapter 'run-b'"):
        await pool.pick(RouteRequest(lora_adapter=b"run-b"))
    # A replica's load stream ending forgets what it held.
    pool.get("r1").forget_load()
    assert pool.try_pick(RouteRequest(lora_adapter=b"run-a", min_policy_version=4)) is None


def test_an_owned_adapter_is_for_its_owner_and_operators_only():
    pool = make_pool(2)
    # r0 says who owns run-a; r1's report names no owner for it: r0's still counts.
    pool.get("r0").apply_load(
        generation_pb2.LoadReport(adapter_versions={"run-a": 1, "shared": 1}, adapter_owners={"run-a": "alice"})
    )
    pool.get("r1").apply_load(generation_pb2.LoadReport(adapter_versions={"run-a": 1, "shared": 1}))
    alice, bob = Caller("alice", frozenset({TENANT})), Caller("bob", frozenset({TENANT}))
    operator = Caller("launcher", frozenset({OPERATOR}))
    run_a = RouteRequest(lora_adapter=b"run-a")
    with pytest.raises(PermissionDenied, match=r"adapter 'run-a' is not bob \[roles tenant\]'s") as refused:
        pool.check_adapter_owner(run_a, bob)
    assert refused.value.reason == "NOT_ADAPTER_OWNER"
    for caller in (alice, operator, LOCAL):
        pool.check_adapter_owner(run_a, caller)
    # An adapter without owner, and the base model, are anyone's.
    pool.check_adapter_owner(RouteRequest(lora_adapter=b"shared"), bob)
    pool.check_adapter_owner(RouteRequest(), bob)

    # The owner outlives r0's load stream (the broadcaster may still say run-a is there) and a
    # report that does not list run-a; a report that lists it without owner speaks for it.
    pool.get("r0").forget_load()
    pool.get("r0").apply_broadcaster_state(policy_version=1, updating=False, adapter_versions={"run-a": 2})
    with pytest.raises(PermissionDenied):
        pool.check_adapter_owner(run_a, bob)
    pool.get("r0").apply_load(generation_pb2.LoadReport(adapter_versions={"shared": 1}))
    with pytest.raises(PermissionDenied):
        pool.check_adapter_owner(run_a, bob)
    pool.get("r0").apply_load(generation_pb2.LoadReport(adapter_versions={"run-a": 1}))
    pool.check_adapter_owner(run_a, bob)

    # An adapter the broadcaster has just pushed is its owner's from then, before any load report.
    pool.get("r1").apply_broadcaster_state(
        policy_version=1, updating=False, adapter_versions={"run-c": 1}, adapter_owners={"run-c": "alice"}
    )
    with pytest.raises(PermissionDenied):
        pool.check_adapter_owner(RouteRequest(lora_adapter=b"run-c"), bob)
    pool.check_adapter_owner(RouteRequest(lora_adapter=b"run-c"), alice)


def test_an_adapter_whose_replicas_disagree_on_its_owner_is_for_operators_only():
    pool = make_pool(2)
    pool.get("r0").apply_load(
        generation_pb2.LoadReport(adapter_versions={"run-a": 1}, adapter_owners={"run-a": "alice"})
    )
    pool.get("r1").apply_load(generation_pb2.LoadReport(adapter_versions={"run-a": 1}, adapter_owners={"run-a": "eve"}))
    for name in ("alice", "eve"):
        with pytest.raises(PermissionDenied):
            pool.check_adapter_owner(RouteRequest(lora_adapter=b"run-a"), Caller(name, frozenset({TENANT})))
    pool.check_adapter_owner(RouteRequest(lora_adapter=b"run-a"), Caller("launcher", frozenset({OPERATOR})))
