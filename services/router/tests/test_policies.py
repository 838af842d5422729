import collections

import pytest
from pydantic import ValidationError

from primerl.common.v1 import generation_pb2
from primerl.router.v1 import router_pb2
from primerl_router.policies import RoutingPolicy, make_policy, policy_class, policy_names
from primerl_router.policies.cache_aware import prefix_block_hashes
from primerl_router.replica import Replica
from primerl_router.request import RouteRequest, parse_route_request


def replicas(count: int) -> list[Replica]:
    return [Replica(f"r{i}", f"127.0.0.1:{9000 + i}") for i in range(count)]


def policy(name: str, members: list[Replica], **options) -> RoutingPolicy:
    chosen = make_policy(name, options)
    chosen.on_membership_change(members)
    return chosen


def route(chosen: RoutingPolicy, request: RouteRequest, candidates: list[Replica]) -> Replica:
    replica = chosen.choose(request, candidates)
    chosen.on_routed(request, replica)
    return replica


def test_registry_finds_every_policy_module():
    assert policy_names() == ["cache_aware", "consistent_hash", "least_loaded", "round_robin"]
    for name in policy_names():
        assert policy_class(name).name == name
    with pytest.raises(ValueError, match="known: cache_aware, consistent_hash"):
        policy_class("random")


def test_round_robin_cycles():
    members = replicas(3)
    chosen = policy("round_robin", members)
    picks = [route(chosen, RouteRequest(), members).replica_id for _ in range(6)]
    assert collections.Counter(picks) == {"r0": 2, "r1": 2, "r2": 2}
    assert picks[:3] != picks[0:1] * 3


def test_consistent_hash_is_sticky_and_even():
    members = replicas(4)
    chosen = policy("consistent_hash", members)
    owners = {}
    for episode in range(2000):
        request = RouteRequest(session_key=f"episode-{episode}".encode())
        owners[episode] = route(chosen, request, members)
        assert route(chosen, request, members) is owners[episode]  # every turn, same replica
    counts = collections.Counter(replica.replica_id for replica in owners.values())
    assert min(counts.values()) > 2000 / 4 * 0.75, counts  # 160 virtual nodes: within 25% of even


def test_consistent_hash_falls_back_to_the_next_replica_and_comes_back():
    members = replicas(4)
    chosen = policy("consistent_hash", members)
    request = RouteRequest(session_key=b"episode-42")
    owner = route(chosen, request, members)
    others = [replica for replica in members if replica is not owner]
    fallback = route(chosen, request, others)
    assert fallback is not owner
    assert route(chosen, request, others) is fallback  # the fallback is stable too
    assert route(chosen, request, members) is owner  # and the key returns once its replica can take it


def test_consistent_hash_moves_only_the_keys_of_a_removed_replica():
    members = replicas(4)
    chosen = policy("consistent_hash", members)
    keys = [RouteRequest(session_key=f"k{i}".encode()) for i in range(1000)]
    before = {r.session_key: route(chosen, r, members) for r in keys}
    chosen.on_membership_change(members[:3])
    after = {r.session_key: route(chosen, r, members[:3]) for r in keys}
    moved = [key for key in before if before[key] is not after[key]]
    assert all(before[key] is members[3] for key in moved)


def test_consistent_hash_bounds_a_replica_load_and_its_keys_come_back():
    members = replicas(2)
    chosen = policy("consistent_hash", members, balance_factor=1.25)
    strict = policy("consistent_hash", members)  # the default: no bound
    request = RouteRequest(session_key=b"episode-7")
    owner = route(chosen, request, members)
    other = next(replica for replica in members if replica is not owner)
    for _ in range(3):
        owner.on_request_start()
    # With this request 4 outstanding; a replica may have ceil(1.25 * 4 / 2) = 3.
    assert route(chosen, request, members) is other
    assert route(strict, request, members) is owner
    owner.on_request_end()
    owner.on_request_end()
    assert route(chosen, request, members) is owner
    with pytest.raises(ValidationError, match="balance_factor"):
        make_policy("consistent_hash", {"balance_factor": 0.5})


def test_consistent_hash_without_key_takes_the_least_loaded():
    members = replicas(2)
    chosen = policy("consistent_hash", members)
    members[0].on_request_start()
    assert route(chosen, RouteRequest(), members) is members[1]


def test_least_loaded_uses_reports_and_shares_ties():
    members = replicas(3)
    chosen = policy("least_loaded", members)
    members[0].apply_load(generation_pb2.LoadReport(num_waiting=5))
    members[1].apply_load(generation_pb2.LoadReport(num_running=2))
    members[2].apply_load(generation_pb2.LoadReport(num_running=2))
    picks = collections.Counter(route(chosen, RouteRequest(), members).replica_id for _ in range(4))
    assert picks == {"r1": 2, "r2": 2}
    members[1].on_request_start()  # sent since its report
    assert route(chosen, RouteRequest(), members) is members[2]


def prompt_request(tokens: list[int], **fields) -> RouteRequest:
    generation = generation_pb2.GenerationInput(prompt_token_ids=tokens)
    request = parse_route_request(router_pb2.GenerateRequest(input=generation).SerializeToString())
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def test_block_hashes_chain_over_prefix_salt_and_adapter():
    a = prefix_block_hashes(prompt_request(list(range(100))), 16)
    b = prefix_block_hashes(prompt_request([*range(50), *range(1000, 1050)]), 16)
    assert len(a) == 100 // 16
    assert a[:3] == b[:3] and a[3] != b[3]  # tokens 0..49 shared: the first 3 full blocks
    salted = prefix_block_hashes(prompt_request(list(range(100)), cache_salt=b"v2"), 16)
    assert salted[0] != a[0]
    adapter = prefix_block_hashes(prompt_request(list(range(100)), lora_adapter=b"x"), 16)
    assert adapter[0] != a[0]


def test_cache_aware_follows_the_prefix_and_trades_it_against_load():
    members = replicas(2)
    chosen = policy("cache_aware", members, block_bytes=16, load_cost_tokens=64)
    system = list(range(100))
    first = route(chosen, prompt_request([*system, 1, 2, 3]), members)
    # Same 100-token prefix: the replica that served it, by the cached blocks.
    assert route(chosen, prompt_request([*system, 4, 5, 6]), members) is first
    assert chosen.cached_blocks(prompt_request([*system, 7]), first) == 6
    # A different prompt goes where it is cheapest: the other, idle replica.
    for _ in range(2):
        first.on_request_start()
    other = route(chosen, prompt_request(list(range(500, 600))), members)
    assert other is not first
    # Once the cached replica is loaded enough, prefilling elsewhere is cheaper.
    for _ in range(3):
        first.on_request_start()
    assert route(chosen, prompt_request([*system, 9]), members) is not first


def test_cache_aware_forgets_reset_and_removed_replicas_and_bounds_memory():
    members = replicas(2)
    chosen = policy("cache_aware", members, block_bytes=8, max_blocks_per_replica=4)
    short = prompt_request(list(range(32)))  # 4 blocks
    target = route(chosen, short, members)
    assert chosen.cached_blocks(short, target) == 4
    route(chosen, prompt_request(list(range(64))), [target])  # 8 blocks: the oldest 4 make room
    assert chosen.cached_blocks(short, target) == 0

    route(chosen, short, [target])
    chosen.on_prefix_cache_reset(target)
    assert chosen.cached_blocks(short, target) == 0

    route(chosen, short, [target])
    chosen.on_membership_change([m for m in members if m is not target])
    assert chosen.cached_blocks(short, target) == 0
