"""Live progress of a run and its per-step metrics, read through the services' APIs:
the orchestrator's run status, the trainer's finished steps (WatchSteps), each inference
replica's load report (policy version, generated tokens) and, for the final version,
the weight broadcaster. One JSON line per trained step joins the trainer's metrics with
the orchestrator's record of the same step (its metrics file).

The replicas' load reports are summed by role (prefill, decode, both): queue depth, running
requests, prompt tokens computed per second, tokens generated per second and the KV pool hit
rate (prompt tokens loaded from the pool / prompt tokens served). The progress line shows them
when the fleet is disaggregated or uses the pool; every record carries them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import pathlib
import sys
import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.client import call_with_retry, make_channel

__all__ = [
    "Display",
    "GroupLoad",
    "RunFailed",
    "RunMonitor",
    "RunPeers",
    "StallWatch",
    "describe_groups",
    "describe_replica_groups",
    "watch_trainer_steps",
]

_RPC_TIMEOUT_S = 10.0
_THROUGHPUT_WINDOW_S = 10.0
# A trained step waits this long for the orchestrator's record of it before it is written without.
_JOIN_WAIT_S = 10.0
# Groups finishing this long with no batch cut is said (once per stall).
STALL_WARNING_S = 60.0


class RunFailed(RuntimeError):
    """The orchestrator reports the run failed, or the run does not finish in time."""


class Display:
    """A tqdm bar on a terminal; elsewhere (logs, tests) one line per change of step, and one
    every `heartbeat_s` while the step stands still and the rest of the line changes."""

    def __init__(
        self, desc: str, total: int | None, stream: TextIO | None = None, *, heartbeat_s: float = 30.0
    ) -> None:
        self.desc = desc
        self.stream = stream or sys.stderr
        self.heartbeat_s = heartbeat_s
        self._bar = None
        self._last: tuple[int, int | None, str] | None = None
        self._last_at = 0.0
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", file=self.stream, dynamic_ncols=True)

    def update(self, step: int, total: int | None, postfix: str) -> None:
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = step
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.refresh()
        elif self._due(step, total, postfix):
            self._last, self._last_at = (step, total, postfix), time.monotonic()
            print(f"{self.desc} step {step}/{total if total else '?'} | {postfix}", file=self.stream, flush=True)

    def _due(self, step: int, total: int | None, postfix: str) -> bool:
        if self._last is None or self._last[:2] != (step, total):
            return True
        return postfix != self._last[2] and time.monotonic() - self._last_at >= self.heartbeat_s

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def describe_groups(groups: orchestrator_pb2.GroupCounts) -> str:
    """The orchestrator's group counts (GetRunStatus.groups), as on the progress line."""
    text = (
        f"groups {groups.finished} finished, {groups.filtered_equal_rewards} filtered (equal rewards), "
        f"{groups.incomplete} incomplete, {groups.batched} batched"
    )
    return text + (f", {groups.episodes_timed_out} episodes timed out" if groups.episodes_timed_out else "")


def _ended(groups: orchestrator_pb2.GroupCounts) -> int:
    return groups.finished + groups.incomplete


class StallWatch:
    """Why no step comes: fed each GetRunStatus, it says when the group counts belong on the
    progress line (no step yet, or groups ending since the last step), and once per stall, when
    groups have ended for `warn_after_s` without a batch, what kept them out of one."""

    def __init__(self, *, warn_after_s: float = STALL_WARNING_S) -> None:
        self.warn_after_s = warn_after_s
        self._step: int | None = None
        self._since = 0.0
        self._at_step = orchestrator_pb2.GroupCounts()
        self._warned = False
        self.stalled_s = 0.0

    def update(self, status: orchestrator_pb2.GetRunStatusResponse, now: float | None = None) -> str | None:
        """The warning to give now, if any."""
        now = time.monotonic() if now is None else now
        # A step, or a batch made (a status read as the step came may not count its groups yet),
        # ends a stall.
        if status.step != self._step or status.groups.batched != self._at_step.batched:
            self._step, self._since, self._warned = status.step, now, False
            self._at_step.CopyFrom(status.groups)
        ended = _ended(status.groups) - _ended(self._at_step)
        self.stalled_s = now - self._since if ended > 0 else 0.0
        if self._warned or self.stalled_s < self.warn_after_s:
            return None
        self._warned = True
        return self._warning(status.groups)

    def shows_groups(self, status: orchestrator_pb2.GetRunStatusResponse) -> bool:
        return status.step == 0 or _ended(status.groups) > _ended(self._at_step)

    def _warning(self, groups: orchestrator_pb2.GroupCounts) -> str:
        at_step = self._at_step
        finished = groups.finished - at_step.finished
        filtered = groups.filtered_equal_rewards - at_step.filtered_equal_rewards
        incomplete = groups.incomplete - at_step.incomplete
        timed_out = groups.episodes_timed_out - at_step.episodes_timed_out
        reasons = []
        if filtered:
            reasons.append(
                f"{filtered} filtered for equal rewards (every episode of the group got the same reward: "
                "[orchestrator] advantage.filter_zero_advantage = false keeps them, or a larger group_size "
                "or an easier task makes rewards differ)"
            )
        if incomplete:
            reasons.append(f"{incomplete} incomplete (an episode ended without a reward: discarded, failed or dropped)")
        if timed_out:
            reasons.append(f"{timed_out} episodes timed out ([orchestrator] run.episode_timeout_s)")
        if not reasons:
            reasons.append("the kept ones do not fill a batch yet ([orchestrator] run.batch_size rollouts)")
        return (
            f"no batch for {self.stalled_s:.0f}s while {finished + incomplete} groups ended "
            f"({finished} finished): " + "; ".join(reasons)
        )


async def watch_trainer_steps(address: str, steps: dict[int, dict[str, float]], *, after_step: int = 0) -> None:
    """Fills `steps` (step -> metrics) from the trainer's WatchSteps, reconnecting until cancelled."""
    async with make_channel(address, max_attempts=1) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        while True:
            last = max(steps, default=after_step)
            try:
                async for response in stub.WatchSteps(trainer_pb2.WatchStepsRequest(after_step=last)):
                    steps[response.step.step] = dict(response.step.metrics)
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)


@dataclass
class RunPeers:
    orchestrator: str
    trainer: str
    replicas: dict[str, str]
    weight_broadcaster: str | None = None
    # The LoRA adapter the run trains (orchestrator model.lora_adapter): the versions that count
    # are its versions; "" for whole weights.
    lora_adapter: str = ""


_ROLE_NAMES = {
    generation_pb2.REPLICA_ROLE_PREFILL: "prefill",
    generation_pb2.REPLICA_ROLE_DECODE: "decode",
}


@dataclass
class GroupLoad:
    """The replicas of one role, summed from their last load reports."""

    num_replicas: int = 0
    queue_depth: int = 0
    running: int = 0
    computed_prompt_tokens_per_s: float = 0.0
    generated_tokens_per_s: float = 0.0
    prompt_tokens: int = 0  # served since start, computed or cached
    kv_pool_hit_tokens: int = 0

    @property
    def kv_pool_hit_rate(self) -> float:
        return self.kv_pool_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def describe_replica_groups(groups: Mapping[str, GroupLoad]) -> str:
    """The replica groups as on the progress line: `prefill q 3 run 2 prefill 1,200 tok/s |
    decode q 0 run 8 decode 340 tok/s pool hit 92%` (q: requests queued, run: running)."""
    parts = []
    for role, group in groups.items():
        text = f"{role} q {group.queue_depth} run {group.running}"
        if role != "decode":
            text += f" prefill {group.computed_prompt_tokens_per_s:,.0f} tok/s"
        if role != "prefill":
            text += f" decode {group.generated_tokens_per_s:,.0f} tok/s"
        if group.kv_pool_hit_tokens:
            text += f" pool hit {group.kv_pool_hit_rate:.0%}"
        parts.append(text)
    return " | ".join(parts)


@dataclass
class _Throughput:
    samples: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def add(self, total_tokens: int) -> float:
        now = time.monotonic()
        self.samples.append((now, total_tokens))
        while len(self.samples) > 2 and now - self.samples[0][0] > _THROUGHPUT_WINDOW_S:
            self.samples.popleft()
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class RunMonitor:
    """Follows the RL run until the orchestrator has finished, the last step is trained and
    every replica serves the last version; writes metrics_path as it goes."""

    def __init__(
        self,
        peers: RunPeers,
        *,
        metrics_path: pathlib.Path,
        orchestrator_metrics: pathlib.Path | None,
        poll_interval_s: float,
        finish_timeout_s: float,
        stall_warning_s: float = STALL_WARNING_S,
        restarts: Mapping[str, int] | None = None,
        restarting: AbstractSet[str] | None = None,
    ) -> None:
        """`restarts` (restarts so far by service) and `restarting` (services being restarted now)
        are read, live, for the progress line."""
        self.peers = peers
        self.restarts = restarts if restarts is not None else {}
        self.restarting = restarting if restarting is not None else set()
        self.metrics_path = metrics_path
        self.orchestrator_metrics = orchestrator_metrics
        self.poll_interval_s = poll_interval_s
        self.finish_timeout_s = finish_timeout_s
        self.records: list[dict[str, Any]] = []
        self.trainer_steps: dict[int, dict[str, float]] = {}
        # The trainer's completed step (GetStatus): a trainer resumed from a checkpoint has
        # steps that WatchSteps does not replay.
        self.trainer_completed_step = 0
        self.versions: dict[str, int] = dict.fromkeys(peers.replicas, 0)
        self.tokens_per_s = 0.0
        # Each replica's last load report, and the replicas summed by role.
        self.loads: dict[str, generation_pb2.LoadReport] = {}
        self.groups: dict[str, GroupLoad] = {}
        self._group_throughput: dict[tuple[str, str], _Throughput] = collections.defaultdict(_Throughput)
        self._orchestrator_records: dict[int, dict[str, Any]] = {}
        self._orchestrator_offset = 0
        self._step_seen_at: dict[int, float] = {}
        self._written = 0
        self._throughput = _Throughput()
        self._started = time.monotonic()
        self._status = orchestrator_pb2.GetRunStatusResponse()
        self.stall = StallWatch(warn_after_s=stall_warning_s)

    @property
    def status(self) -> orchestrator_pb2.GetRunStatusResponse:
        """The orchestrator's last answer to GetRunStatus."""
        return self._status

    async def run(self, display: Display) -> list[dict[str, Any]]:
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.metrics_path.write_text("")
        async with contextlib.AsyncExitStack() as stack:
            orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(
                await stack.enter_async_context(make_channel(self.peers.orchestrator))
            )
            replicas = {
                name: inference_pb2_grpc.InferenceServiceStub(await stack.enter_async_context(make_channel(address)))
                for name, address in self.peers.replicas.items()
            }
            trainer = trainer_pb2_grpc.TrainerServiceStub(
                await stack.enter_async_context(make_channel(self.peers.trainer))
            )
            watcher = asyncio.ensure_future(watch_trainer_steps(self.peers.trainer, self.trainer_steps))
            stack.callback(watcher.cancel)
            finished_at = None
            while True:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    self._status = await orchestrator.GetRunStatus(
                        orchestrator_pb2.GetRunStatusRequest(), timeout=_RPC_TIMEOUT_S
                    )
                with contextlib.suppress(grpc.aio.AioRpcError):
                    trainer_status = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=_RPC_TIMEOUT_S)
                    self.trainer_completed_step = max(self.trainer_completed_step, trainer_status.step)
                await self._poll_replicas(replicas)
                self._read_orchestrator_metrics()
                self._write_ready(final=False)
                status = self._status
                warning = self.stall.update(status)
                if warning is not None:
                    display.write(f"warning: {warning}")
                display.update(self.trained_step, status.max_steps or None, self.postfix())
                if status.state == orchestrator_pb2.RUN_STATE_FAILED:
                    raise RunFailed(f"the orchestrator reports the run failed: {status.error or 'no reason given'}")
                if status.state == orchestrator_pb2.RUN_STATE_FINISHED:
                    if self.trained_step >= status.max_steps:
                        break
                    finished_at = finished_at or time.monotonic()
                    if time.monotonic() - finished_at > self.finish_timeout_s:
                        raise RunFailed(
                            f"the orchestrator finished, but the trainer reached only step {self.trained_step} "
                            f"of {status.max_steps} within {self.finish_timeout_s:.0f}s"
                        )
                await asyncio.sleep(self.poll_interval_s)
            await self._wait_for_final_version(status.max_steps)
            await self._poll_replicas(replicas)
            self._read_orchestrator_metrics()
            self._write_ready(final=True)
            display.update(self.trained_step, status.max_steps, self.postfix())
        return self.records

    @property
    def trained_step(self) -> int:
        return max(max(self.trainer_steps, default=0), self.trainer_completed_step)

    def postfix(self) -> str:
        status = self._status
        parts = []
        last = self.records[-1] if self.records else None
        reward = last.get("reward_mean") if last else None
        if reward is None and status.environments:
            reward = sum(env.reward_mean for env in status.environments) / len(status.environments)
        if reward is not None:
            parts.append(f"reward {reward:.3f}")
        kl = self.trainer_steps.get(self.trained_step, {}).get("mismatch_kl")
        if kl is not None:
            parts.append(f"mismatch_kl {kl:.2e}")
        parts.append(f"off-policy {status.off_policy_steps_max}/{status.max_off_policy_steps}")
        parts.append(f"dropped {status.num_dropped_off_policy_total}")
        parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        of = f" (adapter {self.peers.lora_adapter})" if self.peers.lora_adapter else ""
        parts.append(f"versions{of} " + " ".join(f"{name}={v}" for name, v in self.versions.items()))
        if self.shows_replica_groups():
            parts.append(describe_replica_groups(self.groups))
        if self.stall.shows_groups(status):
            parts.append(describe_groups(status.groups))
        if self.stall.stalled_s >= self.stall.warn_after_s:
            parts.append(f"no batch for {self.stall.stalled_s:.0f}s")
        if self.restarting:
            parts.append("restarting " + " ".join(sorted(self.restarting)))
        if any(self.restarts.values()):
            parts.append("restarts " + " ".join(f"{name}={n}" for name, n in sorted(self.restarts.items()) if n))
        return " | ".join(parts)

    def shows_replica_groups(self) -> bool:
        """Disaggregated, or on the KV pool: the groups say whether the P:D ratio fits the load."""
        return any(role != "both" for role in self.groups) or any(
            load.num_kv_pool_hit_tokens_total for load in self.loads.values()
        )

    def _sum_groups(self) -> None:
        groups: dict[str, GroupLoad] = {}
        totals: dict[str, list[int]] = {}
        for load in self.loads.values():
            role = _ROLE_NAMES.get(load.role, "both")
            group = groups.setdefault(role, GroupLoad())
            group.num_replicas += 1
            group.queue_depth += load.num_waiting
            group.running += load.num_running
            group.prompt_tokens += load.num_prompt_tokens_total
            group.kv_pool_hit_tokens += load.num_kv_pool_hit_tokens_total
            computed = load.num_prompt_tokens_total - load.num_prefix_cache_hit_tokens_total
            counts = totals.setdefault(role, [0, 0])
            counts[0] += computed
            counts[1] += load.num_generated_tokens_total
        for role, group in groups.items():
            computed, generated = totals[role]
            group.computed_prompt_tokens_per_s = self._group_throughput[role, "computed"].add(computed)
            group.generated_tokens_per_s = self._group_throughput[role, "generated"].add(generated)
        self.groups = dict(sorted(groups.items(), key=lambda item: ("prefill", "decode", "both").index(item[0])))

    async def _poll_replicas(self, replicas: dict[str, inference_pb2_grpc.InferenceServiceStub]) -> None:
        names = list(replicas)
        replies = await asyncio.gather(
            *(replicas[n].GetLoad(inference_pb2.GetLoadRequest(), timeout=_RPC_TIMEOUT_S) for n in names),
            return_exceptions=True,
        )
        total = 0
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, BaseException):
                continue
            adapter = self.peers.lora_adapter
            self.versions[name] = reply.load.adapter_versions.get(adapter, -1) if adapter else reply.load.policy_version
            self.loads[name] = reply.load
            total += reply.load.num_generated_tokens_total
        if names and not any(isinstance(reply, BaseException) for reply in replies):
            self.tokens_per_s = self._throughput.add(total)
            self._sum_groups()

    async def _wait_for_final_version(self, version: int) -> None:
        if self.peers.weight_broadcaster is None or not self.peers.replicas:
            return
        async with make_channel(self.peers.weight_broadcaster) as channel:
            stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(channel)
            request = weight_broadcaster_pb2.WaitForVersionRequest(
                policy_version=version,
                min_replicas=len(self.peers.replicas),
                timeout_ms=int(self.finish_timeout_s * 1000),
                adapter_name=self.peers.lora_adapter,
            )
            # Retried while the broadcaster is away (restarting): a new one is sent the version again.
            reply = await call_with_retry(
                lambda: stub.WaitForVersion(request, timeout=self.finish_timeout_s + _RPC_TIMEOUT_S),
                deadline_s=self.finish_timeout_s,
            )
        if not reply.reached:
            of = f" of LoRA adapter {self.peers.lora_adapter!r}" if self.peers.lora_adapter else ""
            raise RunFailed(
                f"policy version {version}{of} reached only {reply.num_replicas_at_version} of "
                f"{len(self.peers.replicas)} replicas within {self.finish_timeout_s:.0f}s"
            )

    def _read_orchestrator_metrics(self) -> None:
        path = self.orchestrator_metrics
        if path is None or not path.is_file():
            return
        with path.open("rb") as file:
            file.seek(self._orchestrator_offset)
            data = file.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._orchestrator_offset += len(complete)
        for line in complete.decode().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                self._orchestrator_records[int(record["step"])] = record

    def _write_ready(self, *, final: bool) -> None:
        """Writes the trained steps in order, each once its orchestrator record is there."""
        now = time.monotonic()
        for step in sorted(s for s in self.trainer_steps if s > self._written):
            self._step_seen_at.setdefault(step, now)
            joined = step in self._orchestrator_records or self.orchestrator_metrics is None
            if not (final or joined or now - self._step_seen_at[step] > _JOIN_WAIT_S):
                break
            record = self._record(step)
            self.records.append(record)
            with self.metrics_path.open("a") as file:
                file.write(json.dumps(record) + "\n")
            self._written = step

    def _record(self, step: int) -> dict[str, Any]:
        trainer = self.trainer_steps[step]
        orchestrator = self._orchestrator_records.get(step)

        def orchestrator_value(key: str) -> Any:
            value = orchestrator.get(key) if orchestrator else None
            return None if isinstance(value, float) and not math.isfinite(value) else value

        return {
            "step": step,
            "time": time.time(),
            "elapsed_s": time.monotonic() - self._started,
            "reward_mean": orchestrator_value("batch_reward_mean"),
            "mismatch_kl": trainer.get("mismatch_kl"),
            "loss": trainer.get("loss"),
            "entropy": trainer.get("entropy"),
            "off_policy_steps_max": orchestrator_value("off_policy_steps_max"),
            "num_dropped_off_policy": orchestrator_value("num_dropped_off_policy"),
            "tokens_per_s": self.tokens_per_s,
            "replica_policy_versions": dict(self.versions),
            "replica_groups": {role: dataclasses.asdict(group) for role, group in self.groups.items()},
            "replica_load": {
                name: {
                    "role": _ROLE_NAMES.get(load.role, "both"),
                    "prompt_tokens": load.num_prompt_tokens_total,
                    "prefix_cache_hit_tokens": load.num_prefix_cache_hit_tokens_total,
                    "kv_pool_hit_tokens": load.num_kv_pool_hit_tokens_total,
                    "generated_tokens": load.num_generated_tokens_total,
                }
                for name, load in self.loads.items()
            },
            "trainer": trainer,
            "orchestrator": orchestrator,
        }
