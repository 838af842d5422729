"""The inference service's Prometheus metrics (served on observability.metrics_port).

Token counters and engine gauges are fed by `load.EngineStats` once per engine step, not
per token or per request."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "finished_requests",
    "generated_tokens",
    "kv_cache_usage",
    "policy_version",
    "prefix_cache_hit_tokens",
    "prompt_tokens",
    "running_requests",
    "weight_update_pause_seconds",
    "weight_update_seconds",
]

# A tiny model on CPU swaps in ~0.1 s; a large one over the network takes minutes.
_UPDATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

prompt_tokens = Counter("primerl_inference_prompt_tokens", "Prompt tokens of requests the engine prefilled.")
prefix_cache_hit_tokens = Counter(
    "primerl_inference_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache."
)
generated_tokens = Counter("primerl_inference_generated_tokens", "Tokens the engine generated.")
finished_requests = Counter("primerl_inference_finished_requests", "Requests that ended, by reason.", ("reason",))
running_requests = Gauge("primerl_inference_running_requests", "Requests in the engine's running batch.")
kv_cache_usage = Gauge("primerl_inference_kv_cache_usage", "Fraction of the KV cache in use.")
policy_version = Gauge("primerl_inference_policy_version", "Policy version of the served weights.")
weight_update_seconds = Histogram(
    "primerl_inference_weight_update_seconds", "UpdateWeights, first message to weights live.", buckets=_UPDATE_BUCKETS
)
weight_update_pause_seconds = Histogram(
    "primerl_inference_weight_update_pause_seconds",
    "Time scheduling was paused for a weight swap.",
    buckets=_UPDATE_BUCKETS,
)
