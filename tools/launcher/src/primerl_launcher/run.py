"""`primerl up`: one launch file -> model -> (warm start) -> the services, started,
awaited and watched -> the RL run followed to its end -> plot, metrics, summary (with
[[runs]]: each run created, fed by its own orchestrator and followed: primerl_launcher.runs); every
process stopped at the end, on Ctrl-C, when one of them cannot start, and when one dies
more often than `[launcher] max_restarts` allows (a service that dies while the run goes on
is started again on the same address, config and state folders)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from primerl.orchestrator.v1 import orchestrator_pb2
from primerl_common import security
from primerl_common.config import TlsConfig
from primerl_common.malloc import MALLOC_ENV
from primerl_common.processes import ServiceDied, ServiceProcess, describe_exit
from primerl_launcher import _toml
from primerl_launcher import register_replicas as registration
from primerl_launcher.certs import run_certificates
from primerl_launcher.checks import check_dtypes, check_outside_peers
from primerl_launcher.progress import Display, RunFailed, RunMonitor, RunPeers, describe_groups
from primerl_launcher.report import format_summary, summary, write_plot
from primerl_launcher.runs import RunsFollower, create_runs, report_runs, run_holders, run_orchestrator_specs
from primerl_launcher.service_group import RestartPolicy, RestartsExhausted, ServiceGroup
from primerl_launcher.spec import TINY_MODELS, LaunchConfigError, LauncherConfig, LaunchFile, ServiceSpec
from primerl_launcher.warm_start import WarmStartFailed, run_warm_start, sft_trainer_spec
from primerl_launcher.wiring import (
    OPERATOR,
    address_of,
    get_path,
    identities,
    served_hosts,
    set_default,
    set_model,
    wire,
)

__all__ = ["Launcher", "keep_state_in_run_dir", "prepare_model", "validate_configs"]

EXIT_FAILED = 1
T = TypeVar("T")


def prepare_model(launcher: LauncherConfig) -> pathlib.Path | None:
    """The model folder: a tiny model made (once, cached) or the folder named."""
    if launcher.model is None:
        return None
    if launcher.model not in TINY_MODELS:
        return pathlib.Path(launcher.model).resolve()
    from primerl_launcher import tiny_model

    family = TINY_MODELS[launcher.model]
    options = dict(launcher.tiny_model)
    seed, dtype = options.pop("seed", 0), options.pop("dtype", "float32")
    fields = {f.name for f in dataclasses.fields(tiny_model.FAMILIES[family])}
    unknown = sorted(set(options) - fields)
    if unknown:
        known = ", ".join(["seed", "dtype", *sorted(fields)])
        raise LaunchConfigError(f"[launcher.tiny_model] {unknown[0]}: unknown key; known: {known}")
    spec = dataclasses.replace(tiny_model.FAMILIES[family], **options) if options else None
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]
    out = launcher.cache_dir / f"{launcher.model}-{dtype}-seed{seed}-{digest}"
    try:
        return tiny_model.make_tiny_model(out, family=family, seed=seed, dtype=dtype, spec=spec).resolve()
    except (TypeError, ValueError) as exc:
        raise LaunchConfigError(f"[launcher.tiny_model]: {exc}") from None


def keep_state_in_run_dir(services: Mapping[str, ServiceSpec], run_dir: pathlib.Path) -> list[str]:
    """The trainer's checkpoints and the orchestrator's checkpoint go under the run directory
    unless the file names a folder: a restarted one resumes from them. Returns warnings about
    restarts that could not resume."""
    warnings = []
    if "trainer" in services:
        set_default(services["trainer"].table, "checkpoint.dir", str(run_dir / "trainer" / "checkpoints"))
        if not get_path(services["trainer"].table, "checkpoint.interval"):
            warnings.append(
                "[trainer] checkpoint.interval is 0: a trainer restarted after a crash starts again from its last "
                "checkpoint (none before a graceful stop) and the steps since are trained again; set it to resume"
            )
    if "orchestrator" in services:
        set_default(
            services["orchestrator"].table, "output.checkpoint_dir", str(run_dir / "orchestrator" / "checkpoint")
        )
    return warnings


def write_configs(specs: Sequence[ServiceSpec], config_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    config_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for spec in specs:
        path = config_dir / f"{spec.name}.toml"
        path.write_text(f"# {spec.name}: {spec.where} of the launch file, as the launcher filled it in\n")
        with path.open("a") as file:
            file.write(_toml.dumps(spec.table))
        paths[spec.name] = path
    return paths


def service_command(spec: ServiceSpec, config: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", spec.module, "-c", str(config)]


def add_service_processes(
    group: ServiceGroup,
    services: Mapping[str, ServiceSpec],
    paths: Mapping[str, pathlib.Path],
    *,
    logs: pathlib.Path,
    env: dict[str, str],
) -> None:
    """One process per service, on its config file `paths[name]`, logging to <logs>/<name>.log."""
    for name, spec in services.items():
        group.add(
            ServiceProcess(
                service_command(spec, paths[name]),
                name=name,
                log_path=logs / f"{name}.log",
                address=address_of(spec),
                env=env,
            )
        )


def operator_certificates(
    run_dir: pathlib.Path,
    services: Mapping[str, ServiceSpec],
    host: str,
    *,
    extra_holders: Mapping[str, list[str]] | None = None,
) -> dict[str, TlsConfig]:
    """A development CA and the run's certificates in <run_dir>/certs (each service's, and
    `extra_holders`'); this process's own channels shown as the operator."""
    holders = {**identities(services), **(extra_holders or {})}
    tls = run_certificates(run_dir / "certs", holders, hosts=served_hosts(services, host))
    # Not exported: the services it starts show their own certificates, never the operator's.
    security.setup_process_tls(tls[OPERATOR], export=False)
    return tls


async def validate_configs(
    specs: Sequence[ServiceSpec], paths: Mapping[str, pathlib.Path], env: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Each service validates its own table (`--print-config`), all at once; one error
    lists every bad field as `[table] field: message`. Each service's config as it will
    run it (defaults and environment applied), by name."""

    async def check(spec: ServiceSpec) -> tuple[dict[str, Any], list[str]]:
        process = await asyncio.create_subprocess_exec(
            *service_command(spec, paths[spec.name]),
            "--print-config",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        stdout, stderr = await process.communicate()
        if process.returncode == 0:
            return json.loads(stdout.decode().strip().splitlines()[-1]), []
        lines = stderr.decode(errors="replace").splitlines()
        fields = [f"  {spec.where} {line.strip()}" for line in lines if line.startswith("  ")]
        if fields:
            return {}, fields
        tail = "\n".join(f"    | {line}" for line in lines[-15:])
        return {}, [f"  {spec.where}: {spec.module} --print-config exited with {process.returncode}:\n{tail}"]

    results = await asyncio.gather(*(check(spec) for spec in specs))
    errors = [line for _, lines in results for line in lines]
    if errors:
        raise LaunchConfigError("invalid configuration:\n" + "\n".join(errors))
    return {spec.name: config for spec, (config, _) in zip(specs, results, strict=True)}


async def register_replicas(broadcaster: str, replicas: Sequence[ServiceSpec], *, timeout_s: float = 30.0) -> None:
    """The broadcaster learns its replicas at run time; it then pushes them every version.
    As `primerl-register-replicas --once` registers them (RegistrationFailed when it cannot)."""
    pairs = [(get_path(spec.table, "replica.id"), address_of(spec)) for spec in replicas]
    stop = threading.Event()

    def register() -> None:
        peer = registration.Broadcaster(broadcaster)
        try:
            registration.register_once([peer], pairs, timeout_s, stop)
        finally:
            peer.channel.close()

    try:
        await asyncio.to_thread(register)
    finally:
        stop.set()  # cancelled: the thread ends after the call in flight


class Launcher:
    def __init__(self, launch: LaunchFile, run_dir: pathlib.Path) -> None:
        self.launch = launch
        self.run_dir = run_dir.resolve()
        self.group = ServiceGroup(log_tail_lines=launch.launcher.log_tail_lines)
        self.env = {**MALLOC_ENV, **os.environ, **launch.launcher.env}
        self.interrupted = False
        self.final_versions: dict[str, int] = {}
        self.groups: orchestrator_pb2.GroupCounts | None = None
        # [[runs]]: their orchestrators' service names, and how each run ended.
        self.run_orchestrators: list[str] = []
        self.runs_summary: dict[str, dict[str, Any]] = {}

    def interrupt(self) -> bool:
        """First call: True (the caller cancels the run, which stops the services gracefully).
        Later calls: every process is killed at once."""
        if self.interrupted:
            self.group.kill()
            return False
        self.interrupted = True
        return True

    async def up(self) -> int:
        started = time.monotonic()
        launch, settings, run_dir = self.launch, self.launch.launcher, self.run_dir
        services = launch.services
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"run directory: {run_dir}")
        model = await asyncio.to_thread(prepare_model, settings)
        if model is not None:
            print(f"model: {model}")
        if launch.deployment is not None:
            print(f"inference: {launch.deployment.describe()}")
        if launch.added:
            print("not in the run file, added on their defaults: " + ", ".join(launch.added))
        tls = await self._identities(services)
        wire(services, run_dir=run_dir, model=model, host=settings.host, tls=tls)
        restart_warnings = keep_state_in_run_dir(services, run_dir)
        if settings.max_restarts:
            for warning in restart_warnings:
                print(f"warning: {warning}", file=sys.stderr)
        if "trainer" in services and get_path(services["trainer"].table, "checkpoint.resume") is not False:
            marker = pathlib.Path(get_path(services["trainer"].table, "checkpoint.dir")) / "latest"
            if marker.is_file():
                print(f"resuming from the trainer's checkpoint {marker.read_text().strip()} in {marker.parent}")
        sft = sft_trainer_spec(launch, run_dir) if launch.warm_start is not None else None
        config_dir = run_dir / "config"
        paths = write_configs([*services.values(), *([sft] if sft else [])], config_dir)
        for peer in await check_outside_peers(services):
            print(f"outside the run, serving: {peer}")
        if settings.check_config:
            checked_at = time.monotonic()
            configs = await validate_configs([*services.values(), *([sft] if sft else [])], paths, self.env)
            print(f"configuration: valid ({', '.join(services)}; checked in {time.monotonic() - checked_at:.1f}s)")
            warning = check_dtypes(services, configs, allowed=settings.allow_dtype_mismatch)
            if warning:
                print(f"warning: {warning}", file=sys.stderr)
        records: list[dict[str, Any]] | None = None
        try:
            if sft is not None:
                model = await run_warm_start(
                    launch,
                    sft,
                    orchestrator_config=paths["orchestrator"],
                    trainer_config=paths[sft.name],
                    run_dir=run_dir,
                    group=self.group,
                    env=self.env,
                )
                set_model(services, model, force=True)
                paths.update(write_configs(list(services.values()), config_dir))
            listing = await self._start(services, paths)
            if launch.runs:
                await self._run_runs(services, paths, listing, tls)
            else:
                records = await self._follow(services, paths)
        except (
            ServiceDied,
            RestartsExhausted,
            RunFailed,
            WarmStartFailed,
            registration.RegistrationFailed,
            TimeoutError,
        ) as exc:
            # Said before the others are stopped: their logs would bury it.
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        finally:
            await self._stop()
        wall_time_s = time.monotonic() - started
        if launch.runs:
            ended = report_runs(self.runs_summary, self.group.restarts, run_dir, wall_time_s=wall_time_s)
            return 0 if ended else EXIT_FAILED
        if records is None:
            return 0
        values = summary(records, wall_time_s=wall_time_s, groups=self.groups) | {
            "replica_policy_versions": self.final_versions,
            "restarts": {name: n for name, n in self.group.restarts.items() if n},
        }
        plot = write_plot(records, run_dir / "metrics.png", title=f"primerl run {run_dir.name}")
        (run_dir / "summary.json").write_text(json.dumps(values, indent=2) + "\n")
        print(format_summary(values))
        if self.final_versions:
            print("policy versions served: " + ", ".join(f"{n} {v}" for n, v in self.final_versions.items()))
        if values["restarts"]:
            print("restarted: " + ", ".join(f"{n} {k}x" for n, k in values["restarts"].items()))
        print(f"metrics: {run_dir / 'metrics.jsonl'}\nplot:    {plot}\nlogs:    {run_dir / 'logs'}")
        return 0

    async def _identities(self, services: Mapping[str, ServiceSpec]) -> dict[str, TlsConfig] | None:
        """Under `[launcher] tls = "mtls"`: a development CA and the run's certificates in
        <run_dir>/certs, and the launcher's own channels (health waits, registration,
        progress) shown as the operator. None in plaintext."""
        settings = self.launch.launcher
        if settings.tls == "plaintext":
            print('plaintext gRPC on loopback, no identities (the local demo; [launcher] tls = "mtls" for mutual TLS)')
            return None
        # The runs' orchestrators show their owners' certificates (role orchestrator).
        holders = run_holders(self.launch.runs, list(identities(services))) if self.launch.runs else None
        tls = await asyncio.to_thread(
            operator_certificates, self.run_dir, services, settings.host, extra_holders=holders
        )
        print(
            f"mutual TLS: development CA and certificates in {self.run_dir / 'certs'}; the launcher calls as {OPERATOR}"
        )
        return tls

    async def _start(
        self, services: Mapping[str, ServiceSpec], paths: Mapping[str, pathlib.Path]
    ) -> dict[str, dict[str, Any]]:
        """Starts the services, waits until each is SERVING, registers the replicas; the listing."""
        add_service_processes(self.group, services, paths, logs=self.run_dir / "logs", env=self.env)
        # All at once: each service waits for its peers (the orchestrator dispatches nothing before
        # the broadcaster reports a replica serving the first version).
        print("starting " + ", ".join(services) + f" (logs in {self.run_dir / 'logs'})")
        await self.group.start(list(services), timeout_s=self.launch.launcher.start_timeout_s)
        await self._register_replicas(services)
        listing = self._write_listing(services, paths)
        print("all services SERVING: " + ", ".join(f"{n} {s['address']}" for n, s in listing.items()))
        return listing

    async def _register_replicas(self, services: Mapping[str, ServiceSpec]) -> None:
        replicas = [spec for spec in services.values() if spec.service == "inference"]
        if "weight_broadcaster" in services and replicas:
            await register_replicas(address_of(services["weight_broadcaster"]), replicas)

    def _write_listing(
        self, services: Mapping[str, ServiceSpec], paths: Mapping[str, pathlib.Path]
    ) -> dict[str, dict[str, Any]]:
        """services.json: each service's address, pid (the current one, after restarts), config and log
        (those of the group: a run's orchestrator dropped with its run is no longer listed)."""
        listing = {
            name: {
                "service": spec.service,
                "address": address_of(spec),
                "pid": self.group.processes[name].pid,
                "restarts": self.group.restarts.get(name, 0),
                "config": str(paths[name]),
                "log": str(self.group.processes[name].log_path),
            }
            for name, spec in services.items()
            if name in self.group.processes
        }
        path = self.run_dir / "services.json"
        partial = path.with_name(".services.json.partial")
        partial.write_text(json.dumps(listing, indent=2) + "\n")
        partial.replace(path)
        return listing

    def _supervise(
        self, services: Mapping[str, ServiceSpec], paths: Mapping[str, pathlib.Path], say: Callable[[str], None]
    ) -> asyncio.Future[None]:
        """Restarts the services that die (see ServiceGroup.supervise); raises RestartsExhausted."""
        settings = self.launch.launcher
        policy = RestartPolicy(settings.max_restarts, settings.restart_backoff_s, settings.restart_backoff_max_s)

        async def serving_again(name: str) -> None:
            self._write_listing(services, paths)
            if services[name].service == "weight_broadcaster":
                # It keeps its replicas in memory: a restarted one knows none.
                await self._register_replicas(services)
                say(f"{name}: replicas registered again")

        return asyncio.ensure_future(
            self.group.supervise(
                policy, start_timeout_s=settings.start_timeout_s, say=say, on_serving_again=serving_again
            )
        )

    async def _follow(
        self, services: Mapping[str, ServiceSpec], paths: Mapping[str, pathlib.Path]
    ) -> list[dict[str, Any]] | None:
        """Until the run is over (None without an orchestrator: until Ctrl-C); the services
        that die meanwhile are restarted; RestartsExhausted when one dies too often."""
        if "orchestrator" not in services:
            print("no [orchestrator]: the services run until Ctrl-C")
            watch = self._supervise(services, paths, lambda message: print(message, file=sys.stderr, flush=True))
            try:
                await watch
            finally:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            return None
        orchestrator = services["orchestrator"]
        metrics = get_path(orchestrator.table, "output.metrics_jsonl")
        peers = RunPeers(
            orchestrator=address_of(orchestrator),
            trainer=get_path(orchestrator.table, "peers.trainer"),
            replicas={name: address_of(spec) for name, spec in services.items() if spec.service == "inference"},
            weight_broadcaster=address_of(services["weight_broadcaster"]) if "weight_broadcaster" in services else None,
            lora_adapter=get_path(orchestrator.table, "model.lora_adapter") or "",
        )
        monitor = RunMonitor(
            peers,
            metrics_path=self.run_dir / "metrics.jsonl",
            orchestrator_metrics=pathlib.Path(metrics) if metrics else None,
            poll_interval_s=self.launch.launcher.poll_interval_s,
            finish_timeout_s=self.launch.launcher.finish_timeout_s,
            restarts=self.group.restarts,
            restarting=self.group.restarting,
        )
        display = Display("RL", None)
        watch = self._supervise(services, paths, display.write)
        follow = asyncio.ensure_future(monitor.run(display))
        try:
            records = await _first_of(watch, follow)
            self.final_versions = dict(monitor.versions)
            self.groups = monitor.status.groups
            return records
        finally:
            display.close()
            finished = follow.done() and not follow.cancelled() and follow.exception() is None
            if not finished and monitor.status.ByteSize():
                # The run did not finish: what the orchestrator had done by then says why.
                status = monitor.status
                print(f"run status at the end: step {status.step}/{status.max_steps}, {describe_groups(status.groups)}")

    async def _run_runs(
        self,
        services: Mapping[str, ServiceSpec],
        paths: Mapping[str, pathlib.Path],
        listing: Mapping[str, Mapping[str, Any]],
        tls: Mapping[str, TlsConfig] | None,
    ) -> None:
        """[[runs]] (primerl_launcher.runs): each run created on the trainer, its orchestrator
        started and supervised beside the services, the runs followed to their end; how each
        ended in `runs_summary`. Raises as `_follow` does."""
        settings, runs = self.launch.launcher, self.launch.runs
        specs, run_paths = await asyncio.to_thread(
            run_orchestrator_specs, runs, listing, run_dir=self.run_dir, host=settings.host, tls=tls
        )
        if settings.check_config:
            await validate_configs(list(specs.values()), run_paths, self.env)
        await create_runs(address_of(services["trainer"]), runs, say=print)
        self.run_orchestrators = list(specs)
        add_service_processes(self.group, specs, run_paths, logs=self.run_dir / "logs", env=self.env)
        print("starting " + ", ".join(specs))
        await self.group.start(list(specs), timeout_s=settings.start_timeout_s)
        services, paths = {**services, **specs}, {**paths, **run_paths}
        self._write_listing(services, paths)

        def say(message: str) -> None:
            print(message, file=sys.stderr, flush=True)

        follower = RunsFollower(
            runs,
            trainer=address_of(services["trainer"]),
            replicas={name: address_of(spec) for name, spec in services.items() if spec.service == "inference"},
            group=self.group,
            poll_interval_s=settings.poll_interval_s,
            finish_timeout_s=settings.finish_timeout_s,
            stop_grace_s=settings.stop_grace_s,
            say=say,
            on_dropped=lambda: self._write_listing(services, paths),
        )
        try:
            await _first_of(self._supervise(services, paths, say), asyncio.ensure_future(follower.run()))
        finally:
            self.runs_summary = follower.summary()

    async def _stop(self) -> None:
        live = [p.name for p in self.group.processes.values() if p.returncode is None]
        if not live:
            return
        print("stopping " + ", ".join(live))
        # The orchestrators stop feeding first; then the others, all at once.
        order = [["orchestrator", *self.run_orchestrators]]
        codes = await self.group.stop(order, grace_s=self.launch.launcher.stop_grace_s)
        unclean = {name: code for name, code in codes.items() if name in live and code}
        if unclean:
            print("not a clean exit: " + ", ".join(f"{name} {describe_exit(code)}" for name, code in unclean.items()))
        else:
            print("all services stopped")


async def _first_of(watch: asyncio.Future[None], follow: asyncio.Future[T]) -> T:
    """`follow`'s result, unless `watch` (the services' supervision, which never returns) raises
    first (RestartsExhausted); both are cancelled on the way out."""
    try:
        done, _ = await asyncio.wait([watch, follow], return_when=asyncio.FIRST_COMPLETED)
        if watch in done:
            watch.result()
        return follow.result()
    finally:
        for task in (watch, follow):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def default_run_dir(launcher: LauncherConfig) -> pathlib.Path:
    if launcher.run_dir is not None:
        return launcher.run_dir
    return pathlib.Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
