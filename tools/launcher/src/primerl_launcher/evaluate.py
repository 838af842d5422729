"""`primerl eval CHECKPOINT -c FILE`: a saved checkpoint (a Hugging Face model folder) served
alone by the launch file's [inference] replicas and [router], the [[orchestrator.evals]] of
that file played on it (`python -m primerl_orchestrator.evaluate`, no trainer), a table
printed and the results written as JSON."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from primerl_common.malloc import MALLOC_ENV
from primerl_common.processes import ServiceDied
from primerl_launcher.run import add_service_processes, operator_certificates, write_configs
from primerl_launcher.service_group import ServiceGroup
from primerl_launcher.spec import LaunchConfigError, LaunchFile, ServiceSpec
from primerl_launcher.wiring import (
    address_of,
    get_path,
    set_default,
    set_model,
    set_tls,
    wire,
)

__all__ = ["evaluate_checkpoint", "format_results"]

EXIT_FAILED = 1
# What serves a checkpoint: the rest of the launch file is not started.
_SERVING = ("inference", "router", "kvstore")
_EVALUATOR = "orchestrator-eval"


def _eval_services(launch: LaunchFile) -> tuple[dict[str, ServiceSpec], ServiceSpec]:
    orchestrator = launch.services.get("orchestrator")
    if orchestrator is None or not orchestrator.table.get("evals"):
        raise LaunchConfigError("primerl eval needs [[orchestrator.evals]] in the launch file")
    services = {name: spec for name, spec in launch.services.items() if spec.service in _SERVING}
    if not any(spec.service == "inference" for spec in services.values()):
        raise LaunchConfigError("primerl eval needs an [inference] table (or [launcher] model) to serve the checkpoint")
    if "router" not in services:
        services["router"] = ServiceSpec("router", "router", {}, "[router]")
    return services, orchestrator


def _paths(
    checkpoint: pathlib.Path, run_dir: pathlib.Path, output: pathlib.Path | None
) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    checkpoint = checkpoint.resolve()
    if not (checkpoint / "config.json").is_file():
        raise LaunchConfigError(f"{checkpoint} is not a Hugging Face model folder (no config.json)")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return checkpoint, run_dir, (output or run_dir / "evals.json").resolve()


async def evaluate_checkpoint(
    launch: LaunchFile, checkpoint: pathlib.Path, run_dir: pathlib.Path, *, output: pathlib.Path | None = None
) -> int:
    checkpoint, run_dir, output = _paths(checkpoint, run_dir, output)
    services, orchestrator = _eval_services(launch)
    settings = launch.launcher
    tls = None
    if settings.tls == "mtls":  # as primerl up: certificates in the run directory, called as the operator
        tls = operator_certificates(run_dir, services, settings.host, extra_holders={_EVALUATOR: ["orchestrator"]})
    wire(services, run_dir=run_dir, model=checkpoint, host=settings.host, tls=tls)
    set_model(services, checkpoint, force=True)
    # Replicas start serving the checkpoint's weights as version 0. Nothing is tracked or written
    # but the results.
    table = {key: value for key, value in orchestrator.table.items() if key not in ("tracking", "output")}
    set_default(table, "model.path", str(checkpoint), force=True)
    set_default(table, "peers.router", address_of(services["router"]), force=True)
    set_default(table, "observability.log_json", False)
    # It serves the orchestrator's API to the environment processes it runs (verifiers evals),
    # on a free port, in the wired services' TLS mode.
    set_default(table, "server.host", settings.host)
    evaluator = ServiceSpec(_EVALUATOR, "orchestrator", table, "[orchestrator]")
    if tls is None:
        set_default(table, "tls.mode", get_path(services["router"].table, "tls.mode") or "plaintext")
    else:
        set_tls(evaluator, tls)
    paths = write_configs([*services.values(), evaluator], run_dir / "config")
    env = {**MALLOC_ENV, **os.environ, **settings.env}
    group = ServiceGroup(log_tail_lines=settings.log_tail_lines)
    add_service_processes(group, services, paths, logs=run_dir / "logs", env=env)
    print(f"checkpoint: {checkpoint}\nstarting {', '.join(services)} (logs in {run_dir / 'logs'})")
    try:
        await group.start(list(services), timeout_s=settings.start_timeout_s)
        print("serving; evaluating " + ", ".join(e["name"] for e in table["evals"]))
        code = await _run_evaluator(paths[evaluator.name], output, run_dir / "logs" / "evaluate.log", env, group)
    except (ServiceDied, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        await group.stop([], grace_s=settings.stop_grace_s)
    if code != 0:
        print(f"error: the evaluation exited with {code} (log: {run_dir / 'logs' / 'evaluate.log'})", file=sys.stderr)
        return EXIT_FAILED
    results = json.loads(output.read_text())["evals"]
    print(format_results(results))
    print(f"results: {output}")
    return 0


async def _run_evaluator(
    config: pathlib.Path, output: pathlib.Path, log: pathlib.Path, env: dict[str, str], group: ServiceGroup
) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "primerl_orchestrator.evaluate",
            "-c",
            str(config),
            "--output",
            str(output),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
        watch = asyncio.ensure_future(group.watch())
        done = asyncio.ensure_future(process.wait())
        try:
            await asyncio.wait([watch, done], return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                process.kill()
                await process.wait()
                watch.result()  # raises ServiceDied
            return done.result()
        finally:
            watch.cancel()
            done.cancel()


def format_results(results: Sequence[dict[str, Any]]) -> str:
    """The results as a text table, one line per eval."""
    ks = sorted({key for r in results for key in r if key.startswith("pass@")}, key=lambda k: int(k[5:]))
    header = ["eval", "environment", "tasks x samples", "reward mean", "reward std", *ks, "errors", "time (s)"]
    rows = [
        [
            r["name"],
            r["environment"],
            f"{r['num_tasks']} x {r['num_samples']}",
            f"{r['reward_mean']:.3f}",
            f"{r['reward_std']:.3f}",
            *(f"{r[k]:.3f}" if k in r else "" for k in ks),
            str(r["num_errors"]),
            f"{r['duration_s']:.1f}",
        ]
        for r in results
    ]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]
    ]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
