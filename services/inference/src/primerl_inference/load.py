"""What the engine is doing: queue lengths, KV cache use and token counters.

vLLM hands its per-step statistics to stat loggers; `EngineStats` is one, registered
through AsyncLLM's `stat_loggers` argument, that keeps the latest scheduler numbers and
running totals for load reports, and feeds the Prometheus metrics.
"""

from __future__ import annotations

import dataclasses

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from primerl_inference import metrics

__all__ = ["EngineStats", "LoadReport"]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    policy_version: int
    updating_weights: bool
    paused: bool
    draining: bool
    role: str
    num_prompt_tokens_total: int
    num_generated_tokens_total: int
    num_prefix_cache_hit_tokens_total: int
    num_kv_pool_hit_tokens_total: int


class EngineStats(StatLoggerBase):
    """Latest scheduler state and token totals, fed by the AsyncLLM output handler."""

    def __init__(self, vllm_config: VllmConfig | None = None, engine_index: int = 0) -> None:
        self.num_running = 0
        self.kv_cache_usage = 0.0
        self.num_prompt_tokens_total = 0
        self.num_generated_tokens_total = 0
        self.num_prefix_cache_hit_tokens_total = 0
        self.num_kv_pool_hit_tokens_total = 0

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            metrics.running_requests.set(self.num_running)
            metrics.kv_cache_usage.set(self.kv_cache_usage)
        if iteration_stats is not None:
            prompt = iteration_stats.prompt_token_stats
            self.num_prompt_tokens_total += prompt.total
            self.num_prefix_cache_hit_tokens_total += prompt.cached_tokens
            self.num_kv_pool_hit_tokens_total += prompt.external_kv_transfer
            self.num_generated_tokens_total += iteration_stats.num_generation_tokens
            metrics.prompt_tokens.inc(prompt.total)
            metrics.prefix_cache_hit_tokens.inc(prompt.cached_tokens)
            metrics.generated_tokens.inc(iteration_stats.num_generation_tokens)
            for finished in iteration_stats.finished_requests:
                metrics.finished_requests.labels(str(finished.finish_reason)).inc()

    def log_engine_initialized(self) -> None:
        pass

    def factory(self, vllm_config: VllmConfig, engine_index: int) -> EngineStats:
        """For AsyncLLM's `stat_loggers`, which takes factories: hands out this instance."""
        return self
