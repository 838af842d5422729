"""The trainer's Prometheus metrics (rank 0; served on observability.metrics_port)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "forget_run",
    "observe_publish",
    "observe_refused_batch",
    "observe_run_publish",
    "observe_run_step",
    "observe_runs",
    "observe_step",
    "queued_batches",
]

_steps = Counter("primerl_trainer_steps", "Optimizer steps taken.")
_tokens = Counter("primerl_trainer_tokens", "Tokens trained on.")
_loss_tokens = Counter("primerl_trainer_loss_tokens", "Tokens that counted in the loss.")
_step = Gauge("primerl_trainer_step", "Optimizer steps completed.")
_loss = Gauge("primerl_trainer_loss", "Loss of the last step.")
_step_seconds = Histogram(
    "primerl_trainer_step_seconds",
    "Train step (forward, backward, optimizer), without publishing or checkpointing.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
_published_version = Gauge("primerl_trainer_published_policy_version", "Latest policy version published.")
_publishes = Counter("primerl_trainer_publishes", "Publishes to the weight broadcaster, by outcome.", ("outcome",))
_publish_seconds = Histogram(
    "primerl_trainer_publish_seconds",
    "Gathering and streaming one policy version.",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
_refused = Counter("primerl_trainer_refused_batches", "PushBatch streams refused, by gRPC status.", ("code",))
queued_batches = Gauge("primerl_trainer_queued_batches", "Batches waiting in the queue.")
# A trainer with runs: the counters and histograms above sum over its runs, these are per run.
_run_step = Gauge("primerl_trainer_run_step", "Optimizer steps a run completed.", ("run",))
_run_loss = Gauge("primerl_trainer_run_loss", "Loss of a run's last step.", ("run",))
_run_published = Gauge(
    "primerl_trainer_run_published_version", "Latest version of a run's adapter published.", ("run",)
)
_runs = Gauge("primerl_trainer_runs", "Runs the trainer holds, by state.", ("state",))


def observe_step(step: int, metrics: dict[str, float]) -> None:
    _count_step(metrics)
    _step.set(step)
    _loss.set(metrics.get("loss", float("nan")))


def observe_run_step(run_id: str, step: int, metrics: dict[str, float]) -> None:
    _count_step(metrics)
    _run_step.labels(run_id).set(step)
    _run_loss.labels(run_id).set(metrics.get("loss", float("nan")))


def _count_step(metrics: dict[str, float]) -> None:
    _steps.inc()
    _tokens.inc(metrics.get("num_tokens", 0.0))
    _loss_tokens.inc(metrics.get("num_loss_tokens", 0.0))
    _step_seconds.observe(metrics.get("step_time_s", 0.0))


def observe_publish(policy_version: int, *, ok: bool, seconds: float | None = None) -> None:
    _publishes.labels("ok" if ok else "failed").inc()
    if ok:
        _published_version.set(policy_version)
    if seconds is not None:
        _publish_seconds.observe(seconds)


def observe_run_publish(run_id: str, policy_version: int, *, ok: bool, seconds: float | None = None) -> None:
    _publishes.labels("ok" if ok else "failed").inc()
    if ok:
        _run_published.labels(run_id).set(policy_version)
    if seconds is not None:
        _publish_seconds.observe(seconds)


def observe_runs(states: list[str]) -> None:
    """The runs held now, by state (one entry per run)."""
    for state in ("active", "paused", "failed"):
        _runs.labels(state).set(states.count(state))


def forget_run(run_id: str) -> None:
    """A deleted run's series go away."""
    for gauge in (_run_step, _run_loss, _run_published):
        with contextlib.suppress(KeyError):
            gauge.remove(run_id)


def observe_refused_batch(code: str) -> None:
    _refused.labels(code).inc()
