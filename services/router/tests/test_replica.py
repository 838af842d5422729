import asyncio

from primerl.common.v1 import generation_pb2
from primerl_router.circuit import CircuitState
from primerl_router.config import CircuitBreakerConfig, HealthConfig
from primerl_router.replica import UNKNOWN_VERSION, Health, HealthTracker, Replica
from primerl_router.request import RouteRequest


def test_health_hysteresis():
    tracker = HealthTracker(unhealthy_threshold=3, healthy_threshold=2)
    assert tracker.state is Health.UNKNOWN
    assert tracker.record(True) and tracker.state is Health.HEALTHY
    assert tracker.record(False) and tracker.state is Health.DEGRADED
    tracker.record(False)
    assert tracker.state is Health.DEGRADED
    tracker.record(False)
    assert tracker.state is Health.UNHEALTHY
    tracker.record(True)
    assert tracker.state is Health.UNHEALTHY  # one pass is not enough to come back
    tracker.record(False)
    tracker.record(True)
    assert tracker.state is Health.UNHEALTHY  # the passes must be consecutive
    tracker.record(True)
    assert tracker.state is Health.HEALTHY


def test_a_degraded_replica_recovers_with_one_pass():
    tracker = HealthTracker(unhealthy_threshold=3, healthy_threshold=5)
    tracker.record(False)
    tracker.record(True)
    assert tracker.state is Health.HEALTHY


def load(**fields) -> generation_pb2.LoadReport:
    return generation_pb2.LoadReport(**fields)


def test_accepts_checks_drain_role_health_version_circuit():
    replica = Replica(
        "a", "x:1", health=HealthConfig(unhealthy_threshold=1), circuit=CircuitBreakerConfig(failure_threshold=1)
    )
    request = RouteRequest()
    assert replica.accepts(request)  # not checked yet: takes traffic at once

    assert not replica.accepts(RouteRequest(min_policy_version=1))  # version unknown
    assert replica.rejection(RouteRequest(min_policy_version=1)) == f"policy version {UNKNOWN_VERSION}"
    replica.apply_load(load(policy_version=2))
    assert replica.accepts(RouteRequest(min_policy_version=2))
    assert not replica.accepts(RouteRequest(min_policy_version=3))

    assert not replica.accepts(RouteRequest(role=generation_pb2.REPLICA_ROLE_PREFILL))
    assert replica.rejection(RouteRequest(role=generation_pb2.REPLICA_ROLE_PREFILL)) == "role REPLICA_ROLE_BOTH"

    replica.draining = True
    assert not replica.accepts(request) and replica.rejection(request) == "draining"
    replica.draining = False
    replica.apply_load(load(policy_version=2, draining=True))  # the replica shuts down by itself
    assert not replica.accepts(request)
    replica.apply_load(load(policy_version=2))

    replica.record_health_check(False)
    assert not replica.accepts(request) and replica.rejection(request) == "unhealthy"
    replica.record_health_check(True)
    replica.record_health_check(True)
    assert replica.accepts(request)

    replica.on_request_start()
    replica.on_request_end(error="UNAVAILABLE", replica_fault=True)
    assert replica.circuit.state is CircuitState.OPEN
    assert not replica.accepts(request) and replica.rejection(request) == "circuit open"
    assert replica.num_errors_total == 1 and replica.num_requests_total == 1


def test_client_errors_do_not_open_the_circuit():
    replica = Replica("a", "x:1", circuit=CircuitBreakerConfig(failure_threshold=1))
    for _ in range(3):
        replica.on_request_start()
        replica.on_request_end(error="CANCELLED")
    assert replica.circuit.state is CircuitState.CLOSED
    assert replica.num_errors_total == 3


def test_outstanding_corrects_the_lagging_report():
    replica = Replica("a", "x:1")
    replica.on_request_start()
    assert replica.outstanding == 1  # no report yet: only what this router sent
    replica.apply_load(load(num_waiting=3, num_running=4))
    assert replica.outstanding == 7
    replica.on_request_start()
    replica.on_request_start()
    assert replica.outstanding == 9  # two sent since the report
    replica.apply_load(load(num_waiting=0, num_running=0))
    assert replica.outstanding == 3  # never below this router's own in-flight count


def test_update_state_from_either_source_and_forgetting_the_stream():
    replica = Replica("a", "x:1")
    replica.apply_load(load(policy_version=4, updating_weights=True))
    assert replica.updating
    replica.apply_load(load(policy_version=4, paused=True))
    assert replica.updating
    replica.apply_load(load(policy_version=5))
    assert not replica.updating
    replica.apply_broadcaster_state(policy_version=5, updating=True)
    assert replica.updating
    replica.apply_broadcaster_state(policy_version=6, updating=False)
    assert replica.policy_version == 6 and not replica.updating
    replica.forget_load()
    assert replica.policy_version == UNKNOWN_VERSION and replica.load is None


def test_a_replica_that_said_it_drains_stays_draining_once_its_stream_ends():
    replica = Replica("a", "x:1")
    replica.apply_load(load(policy_version=3, draining=True))
    assert not replica.accepts(RouteRequest())
    replica.forget_load()  # it ended the stream after the draining report
    assert replica.self_draining and replica.policy_version == UNKNOWN_VERSION
    assert not replica.accepts(RouteRequest())
    replica.apply_load(load(policy_version=0))  # the next process at its address
    assert replica.accepts(RouteRequest()) and replica.policy_version == 0


async def test_wait_idle_returns_when_the_last_request_ends():
    replica = Replica("a", "x:1")
    await replica.wait_idle()  # nothing in flight
    replica.on_request_start()
    replica.on_request_start()
    waiter = asyncio.create_task(replica.wait_idle())
    replica.on_request_end()
    await asyncio.sleep(0.01)
    assert not waiter.done()
    replica.on_request_end()
    await asyncio.wait_for(waiter, 1)
