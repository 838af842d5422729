"""`[[runs]]` in `primerl up`: many LoRA runs on one trainer, each with its own orchestrator.

Once every service is SERVING, the launcher creates each run on the trainer (trainer.v1
CreateRun, as the operator, for the run's owner; a run that exists already, restored from its
checkpoints by a trainer started again on the same run directory, is taken as it is), then starts
one orchestrator per run (`orchestrator-<id>`, supervised and restarted like every service; under
mTLS it shows a certificate named after the run's owner, role orchestrator, which is what lets it
feed the run and generate with the run's adapter). It then follows the runs until each is trained
to its orchestrator's run.max_steps and served at that version by every replica. A run deleted
through the trainer's API meanwhile is dropped from the follow and its orchestrator stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import pathlib
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.config import TlsConfig
from primerl_common.processes import free_ports
from primerl_launcher.progress import RunFailed
from primerl_launcher.run_orchestrator import run_orchestrator_config
from primerl_launcher.service_group import ServiceGroup
from primerl_launcher.spec import LaunchConfigError, RunLaunch, ServiceSpec
from primerl_launcher.wiring import PROCESS_ENVIRONMENT, set_default, set_environment_tls

__all__ = [
    "RunsFollower",
    "create_runs",
    "format_runs_summary",
    "report_runs",
    "run_holders",
    "run_orchestrator_specs",
    "service_name",
]

# The trainer's errors a follower waits out: a trainer or replica being restarted.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_STATE_NAMES = {
    trainer_pb2.RUN_STATE_ACTIVE: "active",
    trainer_pb2.RUN_STATE_PAUSED: "paused",
    trainer_pb2.RUN_STATE_FAILED: "failed",
}


def service_name(run: RunLaunch) -> str:
    """The name of the run's orchestrator among the launcher's services."""
    return f"orchestrator-{run.id}"


def run_holders(runs: Sequence[RunLaunch], taken: Sequence[str]) -> dict[str, list[str]]:
    """The certificates the runs' orchestrators show under mTLS: one per owner, role
    orchestrator (several runs of one owner share it). An owner may not take the name of a
    certificate the run has already (`taken`: its services', the operator's, ...)."""
    holders: dict[str, list[str]] = {}
    for run in runs:
        assert run.owner is not None  # required under mTLS (spec._run)
        if run.owner in taken:
            raise LaunchConfigError(
                f"{run.where} owner: {run.owner!r} is the name of a certificate of the run's own "
                f"({', '.join(sorted(taken))}): name the tenant otherwise"
            )
        holders[run.owner] = ["orchestrator"]
    return holders


def run_orchestrator_specs(
    runs: Sequence[RunLaunch],
    listing: Mapping[str, Mapping[str, Any]],
    *,
    run_dir: pathlib.Path,
    host: str,
    tls: Mapping[str, TlsConfig] | None,
) -> tuple[dict[str, ServiceSpec], dict[str, pathlib.Path]]:
    """Each run's orchestrator, wired to the running services of `listing` (services.json) by
    run_orchestrator_config on a free port as the launcher's own orchestrator is wired (its peers,
    the kvstore's among them where the replicas pool their KV cache; tracking.config_dir the
    launcher's <run_dir>/config): its config in <run_dir>/config/orchestrator-<id>.toml, its
    outputs and checkpoint in <run_dir>/runs/<id> (a restarted one resumes from them), its
    certificate under mTLS (`tls`, by name) the owner's. The specs and the config paths, by name."""
    specs, paths = {}, {}
    (run_dir / "config").mkdir(parents=True, exist_ok=True)
    for run, port in zip(runs, free_ports(len(runs)), strict=True):
        name, out_dir = service_name(run), run_dir / "runs" / run.id
        table = copy.deepcopy(run.orchestrator)
        set_default(table, "server.host", host)
        set_default(table, "output.checkpoint_dir", str(out_dir / "checkpoint"))
        if tls is not None:
            set_environment_tls(table, tls[PROCESS_ENVIRONMENT])
        paths[name] = run_orchestrator_config(
            run_dir / "config" / f"{name}.toml",
            listing,
            table,
            run_id=run.id,
            port=port,
            out_dir=out_dir,
            config_dir=run_dir / "config",
            tls=tls[run.owner] if tls is not None and run.owner is not None else None,
        )
        specs[name] = ServiceSpec(
            name, "orchestrator", tomllib.loads(paths[name].read_text()), f"{run.where} orchestrator"
        )
    return specs, paths


async def create_runs(
    trainer: str, runs: Sequence[RunLaunch], *, say: Callable[[str], None]
) -> dict[str, trainer_pb2.Run]:
    """CreateRun of each run on the trainer at `trainer` (this process's identity: the operator
    under mTLS), for its owner. A run the trainer has already (restored from its checkpoints) is
    taken as it is (GetRun), said, unless it belongs to another owner than the file names."""
    created = {}
    async with make_channel(trainer) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        for run in runs:
            request = trainer_pb2.CreateRunRequest(run_id=run.id, spec=run.spec, owner=run.owner or "")
            try:
                created[run.id] = (await stub.CreateRun(request)).run
                say(f"run {run.id}: created for {created[run.id].owner} ({_describe_spec(run.spec)})")
                continue
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise RunFailed(f"{run.where}: CreateRun of {run.id!r} failed: {exc.details()}") from None
            existing = (await stub.GetRun(trainer_pb2.GetRunRequest(run_id=run.id))).run
            if run.owner is not None and existing.owner != run.owner:
                raise LaunchConfigError(
                    f"{run.where} owner: run {run.id!r} exists already on the trainer, owned by {existing.owner!r}"
                )
            say(f"run {run.id}: exists already (restored from its checkpoints) at step {existing.step}; going on")
            created[run.id] = existing
    return created


def _describe_spec(spec: trainer_pb2.RunSpec) -> str:
    fields = [f"{descriptor.name} {value}" for descriptor, value in spec.ListFields()]
    return ", ".join(fields) or "the trainer's settings"


@dataclass
class _Followed:
    """What the follower knows of one run."""

    launch: RunLaunch
    run: trainer_pb2.Run | None = None
    # The version of the run's adapter each replica serves (-1: none), as last reported.
    served: dict[str, int] = field(default_factory=dict)
    outcome: str | None = None  # None while it trains; "finished" or "deleted"
    said: tuple[int, str, int] | None = None
    said_at: float = 0.0

    @property
    def step(self) -> int:
        return self.run.step if self.run is not None else 0

    @property
    def all_pushed(self) -> bool:
        """Whether its orchestrator has pushed the batch of its last step."""
        return self.run is not None and self.run.next_step > self.launch.max_steps


class RunsFollower:
    """Follows the runs through the trainer (GetRun) and the replicas (GetLoad) until every run
    is finished (trained to its max_steps and served at that version by every replica) or deleted.
    Raises RunFailed when a run fails, TimeoutError when the runs are not finished
    `finish_timeout_s` after the last of their orchestrators pushed its last batch."""

    def __init__(
        self,
        runs: Sequence[RunLaunch],
        *,
        trainer: str,
        replicas: Mapping[str, str],
        group: ServiceGroup,
        poll_interval_s: float,
        finish_timeout_s: float,
        stop_grace_s: float,
        say: Callable[[str], None],
        on_dropped: Callable[[], None] = lambda: None,
        heartbeat_s: float = 30.0,
    ) -> None:
        self.followed = {run.id: _Followed(run) for run in runs}
        self.trainer, self.replicas = trainer, dict(replicas)
        self.group = group
        self.poll_interval_s, self.finish_timeout_s, self.stop_grace_s = poll_interval_s, finish_timeout_s, stop_grace_s
        self.say, self.on_dropped, self.heartbeat_s = say, on_dropped, heartbeat_s
        self._deadline: float | None = None

    async def run(self) -> None:
        channels = {name: make_channel(address) for name, address in {"trainer": self.trainer, **self.replicas}.items()}
        trainer = trainer_pb2_grpc.TrainerServiceStub(channels["trainer"])
        replicas = {name: inference_pb2_grpc.InferenceServiceStub(channels[name]) for name in self.replicas}
        try:
            while not all(followed.outcome for followed in self.followed.values()):
                await self._poll(trainer, replicas)
                self._check_deadline()
                await asyncio.sleep(self.poll_interval_s)
        finally:
            for channel in channels.values():
                await channel.close()

    async def _poll(
        self,
        trainer: trainer_pb2_grpc.TrainerServiceStub,
        replicas: Mapping[str, inference_pb2_grpc.InferenceServiceStub],
    ) -> None:
        loads = await _adapter_versions(replicas)
        # Finished runs too: one deleted later is dropped (its orchestrator stopped) all the same.
        for followed in self.followed.values():
            if followed.outcome == "deleted":
                continue
            try:
                followed.run = (await trainer.GetRun(trainer_pb2.GetRunRequest(run_id=followed.launch.id))).run
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    await self._drop(followed)
                    continue
                if exc.code() in _TRANSIENT:
                    return
                raise
            if followed.outcome is None:
                self._update(followed, loads)

    def _update(self, followed: _Followed, loads: Mapping[str, Mapping[str, int]]) -> None:
        run, launch = followed.run, followed.launch
        assert run is not None
        if run.state == trainer_pb2.RUN_STATE_FAILED:
            raise RunFailed(f"run {launch.id} failed at step {run.step}: {run.error}")
        followed.served = {replica: versions.get(launch.id, -1) for replica, versions in loads.items()}
        self._say_progress(followed)
        everywhere = len(followed.served) == len(self.replicas)
        if run.step >= launch.max_steps and everywhere and set(followed.served.values()) <= {run.step}:
            followed.outcome = "finished"
            self.say(f"run {launch.id}: finished, step {run.step}, served at version {run.step} by every replica")

    def _say_progress(self, followed: _Followed) -> None:
        """A line when the run's step (or state, or its orchestrator's restarts) changes; one
        every `heartbeat_s` while it stands still."""
        name = service_name(followed.launch)
        run = followed.run
        assert run is not None
        state = _STATE_NAMES.get(run.state, "unknown")
        if name in self.group.restarting:
            state += ", orchestrator restarting"
        restarts = self.group.restarts.get(name, 0)
        now = time.monotonic()
        if followed.said == (run.step, state, restarts) and now - followed.said_at < self.heartbeat_s:
            return
        followed.said, followed.said_at = (run.step, state, restarts), now
        self.say(
            f"run {followed.launch.id} step {run.step}/{followed.launch.max_steps} | {state} | "
            f"orchestrator restarts {restarts}"
        )

    async def _drop(self, followed: _Followed) -> None:
        followed.outcome, followed.served = "deleted", {}  # its adapter is being removed everywhere
        name = service_name(followed.launch)
        self.say(
            f"run {followed.launch.id}: deleted through the trainer's API at step {followed.step}; "
            f"dropped from the follow, {name} stopped"
        )
        if name in self.group.processes:
            await self.group.discard(name, grace_s=self.stop_grace_s)
        self.on_dropped()

    def _check_deadline(self) -> None:
        training = [followed for followed in self.followed.values() if followed.outcome is None]
        if self._deadline is None and training and all(followed.all_pushed for followed in training):
            self._deadline = time.monotonic() + self.finish_timeout_s
        if self._deadline is not None and training and time.monotonic() > self._deadline:
            progress = ", ".join(
                f"{f.launch.id} step {f.step}/{f.launch.max_steps} served {f.served}" for f in training
            )
            raise TimeoutError(
                f"runs not trained and served by every replica {self.finish_timeout_s:.0f}s after their "
                f"orchestrators' last batch ([launcher] finish_timeout_s): {progress}"
            )

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per run: its outcome, owner, final step, the adapter version each replica serves,
        its orchestrator's restarts."""
        return {
            run_id: {
                "outcome": followed.outcome or "unfinished",
                "owner": followed.run.owner if followed.run is not None else followed.launch.owner,
                "step": followed.step,
                "max_steps": followed.launch.max_steps,
                "served_versions": followed.served,
                "orchestrator_restarts": self.group.restarts.get(service_name(followed.launch), 0),
            }
            for run_id, followed in self.followed.items()
        }


async def _adapter_versions(
    replicas: Mapping[str, inference_pb2_grpc.InferenceServiceStub],
) -> dict[str, dict[str, int]]:
    """Each replica's adapter versions by adapter name (inference.v1 GetLoad); a replica that
    does not answer now (being restarted) is left out."""

    async def load_of(stub: inference_pb2_grpc.InferenceServiceStub) -> dict[str, int] | None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            load = (await stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=10.0)).load
            return dict(load.adapter_versions)
        return None

    loads = await asyncio.gather(*(load_of(stub) for stub in replicas.values()))
    return {name: load for name, load in zip(replicas, loads, strict=True) if load is not None}


def format_runs_summary(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per run, as `primerl up` ends."""
    lines = ["runs:"]
    for run_id, run in runs.items():
        served = sorted(set(run["served_versions"].values())) or ["-"]
        lines.append(
            f"  {run_id} ({run['owner'] or 'no owner'}): {run['outcome']}, step {run['step']}/{run['max_steps']}, "
            f"adapter version served {'/'.join(str(version) for version in served)}, "
            f"orchestrator restarts {run['orchestrator_restarts']}"
        )
    return "\n".join(lines)


def report_runs(
    runs: Mapping[str, Mapping[str, Any]], restarts: Mapping[str, int], run_dir: pathlib.Path, *, wall_time_s: float
) -> bool:
    """How each run ended (RunsFollower.summary), printed and written to <run_dir>/summary.json
    with the services' restarts. Whether every run finished (or was deleted through the API)."""
    values = {
        "runs": runs,
        "wall_time_s": round(wall_time_s, 1),
        "restarts": {name: count for name, count in restarts.items() if count},
    }
    (run_dir / "summary.json").write_text(json.dumps(values, indent=2) + "\n")
    print(format_runs_summary(runs))
    print(f"summary: {run_dir / 'summary.json'}\nlogs:    {run_dir / 'logs'}")
    return bool(runs) and all(run["outcome"] in ("finished", "deleted") for run in runs.values())
