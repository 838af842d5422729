"""Warm start: SFT before RL. The orchestrator's environment writes the data (its tasks
with their correct answers), then the trainer runs as an SFT job ([trainer] with
[warm_start.trainer] laid over it) that exits after its last step and leaves its final
weights as a Hugging Face folder, on which the RL services then start."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys

from primerl_common.processes import ServiceProcess
from primerl_launcher.progress import Display, watch_trainer_steps
from primerl_launcher.service_group import ServiceGroup
from primerl_launcher.spec import LaunchFile, ServiceSpec, deep_merge
from primerl_launcher.wiring import address_of, get_path, set_default

__all__ = ["WarmStartFailed", "run_warm_start", "sft_trainer_spec"]

SFT_NAME = "trainer-sft"


class WarmStartFailed(RuntimeError):
    pass


def sft_trainer_spec(launch: LaunchFile, run_dir: pathlib.Path) -> ServiceSpec:
    """The SFT job's table; call after wiring (it keeps the trainer's port and model)."""
    assert launch.warm_start is not None
    overrides = launch.warm_start.trainer
    table = deep_merge(launch.services["trainer"].table, overrides)
    # It publishes nowhere, and does not write into (or resume from) the RL trainer's checkpoints.
    table.get("publish", {}).pop("weight_broadcaster", None)
    if "dir" not in overrides.get("checkpoint", {}):
        table.get("checkpoint", {}).pop("dir", None)
    out = run_dir / "warm_start"
    set_default(table, "mode", "sft", force=True)
    set_default(table, "sft.dataset", str(out / "sft.jsonl"), force=True)
    set_default(table, "sft.exit_when_done", True, force=True)
    set_default(table, "export.hf_dir", str(out / "model"))
    return ServiceSpec(SFT_NAME, "trainer", table, "[trainer] + [warm_start.trainer]")


async def run_warm_start(
    launch: LaunchFile,
    spec: ServiceSpec,
    *,
    orchestrator_config: pathlib.Path,
    trainer_config: pathlib.Path,
    run_dir: pathlib.Path,
    group: ServiceGroup,
    env: dict[str, str],
) -> pathlib.Path:
    """Runs both steps; returns the exported model folder."""
    warm_start = launch.warm_start
    assert warm_start is not None
    environments = launch.services["orchestrator"].table.get("environments") or [{}]
    environment = warm_start.environment or environments[0].get("name")
    dataset = pathlib.Path(get_path(spec.table, "sft.dataset"))
    dataset.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir / "logs" / "sft_export.log"
    print(f"warm start: {warm_start.num_samples} SFT samples from environment {environment!r} -> {dataset}")
    export = ServiceProcess(
        [
            sys.executable,
            "-m",
            "primerl_orchestrator.sft_export",
            "-c",
            str(orchestrator_config),
            "--environment",
            str(environment),
            "--num-samples",
            str(warm_start.num_samples),
            "--output",
            str(dataset),
        ],
        name="sft_export",
        log_path=log,
        env=env,
    )
    group.add(export)
    export.launch()
    code = await export.wait()
    del group.processes[export.name]
    if code != 0:
        raise WarmStartFailed(str(export.died(launch.launcher.log_tail_lines)))

    hf_dir = pathlib.Path(get_path(spec.table, "export.hf_dir"))
    trainer = group.add(
        ServiceProcess(
            [sys.executable, "-m", spec.module, "-c", str(trainer_config)],
            name=SFT_NAME,
            log_path=run_dir / "logs" / f"{SFT_NAME}.log",
            address=address_of(spec),
            env=env,
        )
    )
    print(f"warm start: SFT on {dataset} ({trainer.log_path}), final weights -> {hf_dir}")
    trainer.launch()
    steps: dict[int, dict[str, float]] = {}
    watcher = asyncio.ensure_future(watch_trainer_steps(address_of(spec), steps))
    total = get_path(spec.table, "sft.max_steps")
    display = Display("SFT", total)
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + warm_start.timeout_s
    try:
        while trainer.returncode is None:
            if loop.time() > give_up_at:
                raise WarmStartFailed(f"the SFT job did not finish within {warm_start.timeout_s:.0f}s")
            step = max(steps, default=0)
            loss = steps.get(step, {}).get("loss")
            display.update(step, total, f"loss {loss:.4f}" if loss is not None else "starting")
            await asyncio.sleep(launch.launcher.poll_interval_s)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        display.close()
    del group.processes[SFT_NAME]
    if trainer.returncode != 0:
        raise WarmStartFailed(str(trainer.died(launch.launcher.log_tail_lines)))
    if not (hf_dir / "config.json").is_file():
        tail = trainer.log_tail(launch.launcher.log_tail_lines)
        raise WarmStartFailed(f"the SFT job exited 0 but wrote no model to {hf_dir} (log {trainer.log_path}):\n{tail}")
    print(f"warm start: the SFT job finished; RL starts on {hf_dir}")
    return hf_dir
