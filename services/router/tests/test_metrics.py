"""The per-group metrics: the replicas' load reports summed by the role each reports; token
counters grow by what each replica's totals grew (a restarted replica counts from zero)."""

from prometheus_client import REGISTRY

from primerl.common.v1 import generation_pb2
from primerl_router.metrics import ReplicaMetrics

PREFILL, DECODE = generation_pb2.REPLICA_ROLE_PREFILL, generation_pb2.REPLICA_ROLE_DECODE


def value(name: str, role: str) -> float:
    return REGISTRY.get_sample_value(name, {"role": role}) or 0.0


def report(role: int, waiting: int, running: int, prompt: int, cached: int, pool: int, generated: int):
    return generation_pb2.LoadReport(
        role=role,
        num_waiting=waiting,
        num_running=running,
        num_prompt_tokens_total=prompt,
        num_prefix_cache_hit_tokens_total=cached,
        num_kv_pool_hit_tokens_total=pool,
        num_generated_tokens_total=generated,
    )


def test_group_metrics_sum_the_replicas_of_each_role():
    names = [
        f"primerl_router_group_{name}_total"
        for name in ("prompt_tokens", "computed_prompt_tokens", "kv_pool_hit_tokens", "generated_tokens")
    ]
    before = {(n, r): value(n, r) for n in names for r in ("prefill", "decode")}
    prefill_a, prefill_b, decode = (ReplicaMetrics(f"group-test-{n}") for n in ("p0", "p1", "d0"))
    queued = value("primerl_router_group_queue_depth", "prefill")

    prefill_a.apply_load(report(PREFILL, 3, 1, prompt=1000, cached=0, pool=0, generated=2))
    prefill_b.apply_load(report(PREFILL, 2, 2, prompt=500, cached=100, pool=0, generated=1))
    decode.apply_load(report(DECODE, 0, 4, prompt=1500, cached=1400, pool=1300, generated=300))
    assert value("primerl_router_group_queue_depth", "prefill") == queued + 5
    assert value("primerl_router_group_running", "decode") >= 4

    def grown(name: str, role: str) -> float:
        return value(name, role) - before[name, role]

    assert grown("primerl_router_group_prompt_tokens_total", "prefill") == 1500
    assert grown("primerl_router_group_computed_prompt_tokens_total", "prefill") == 1400
    assert grown("primerl_router_group_computed_prompt_tokens_total", "decode") == 100
    assert grown("primerl_router_group_kv_pool_hit_tokens_total", "decode") == 1300
    # Totals grow: only the growth counts; a smaller total is a restarted replica, counted from zero.
    decode.apply_load(report(DECODE, 0, 4, prompt=1600, cached=1450, pool=1350, generated=400))
    assert grown("primerl_router_group_generated_tokens_total", "decode") == 400
    decode.apply_load(report(DECODE, 0, 1, prompt=10, cached=0, pool=0, generated=5))
    assert grown("primerl_router_group_generated_tokens_total", "decode") == 405

    # A replica whose reports stop, or that leaves, is no longer in its group's gauges.
    prefill_a.forget_load()
    assert value("primerl_router_group_queue_depth", "prefill") == queued + 2
    for metrics in (prefill_b, decode):
        metrics.remove()
    assert value("primerl_router_group_queue_depth", "prefill") == queued
