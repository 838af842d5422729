"""Experiment trackers: Weights & Biases (offline by default: a local run folder that `wandb
sync` uploads later) and TensorBoard event files, each switched on by [tracking].

They get the config (the orchestrator's and, from tracking.config_dir, the run's other
services'; not other orchestrators' `orchestrator-<run id>.toml`: with many runs on one
deployment a run's tracker shows no other tenant's run), each step's metrics
(`orchestrator/...`, x axis `step`), the trainer's step metrics (`trainer/...`, from its
WatchSteps), eval results (`eval/<name>/...`, x axis `policy_version`) and tables of sample
rollouts. Both writers need the `tracking` extra (wandb, tensorboard); a tracker that is
switched on without them fails the start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_orchestrator.config import OrchestratorConfig, TrackingConfig
from primerl_orchestrator.evals import EvalResult

__all__ = ["SAMPLE_COLUMNS", "Tracker", "flatten", "watch_trainer_steps"]

logger = logging.getLogger(__name__)

SAMPLE_COLUMNS = ("step", "environment", "group_id", "prompt", "completion", "reward", "advantage", "policy_version")


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a nested record, keys joined with '/'."""
    flat: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}/"))
        elif isinstance(value, int | float) and math.isfinite(value):  # bool is an int
            flat[name] = float(value)
    return flat


class _Wandb:
    def __init__(self, config: TrackingConfig, directory: pathlib.Path, run_config: dict[str, Any]) -> None:
        import wandb

        settings = config.wandb
        directory.mkdir(parents=True, exist_ok=True)
        # wandb keeps artifacts (tables) and its settings under the home folder, which a service
        # may not be able to write: kept beside the run unless the environment says otherwise (not in
        # `.wandb`: wandb would take that folder for its run folder).
        for variable, folder in (
            ("WANDB_DATA_DIR", "data"),
            ("WANDB_CACHE_DIR", "cache"),
            ("WANDB_CONFIG_DIR", "config"),
        ):
            os.environ.setdefault(variable, str(directory / "wandb-home" / folder))
        self._wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name,
            group=settings.group,
            tags=settings.tags or None,
            dir=str(directory),
            config=run_config,
            settings=wandb.Settings(
                mode=settings.mode,
                console="off",
                save_code=False,
                disable_git=True,
                x_disable_stats=True,
                silent=True,
            ),
        )
        self.run.define_metric("step")
        self.run.define_metric("policy_version")
        for prefix in ("orchestrator", "trainer", "samples"):
            self.run.define_metric(f"{prefix}/*", step_metric="step")
        self.run.define_metric("eval/*", step_metric="policy_version")

    @property
    def run_dir(self) -> pathlib.Path:
        return pathlib.Path(self.run.dir).parent

    def scalars(self, values: dict[str, float], *, axis: str, position: int) -> None:
        self.run.log({axis: position, **values})

    def table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, axis: str, position: int
    ) -> None:
        self.run.log({axis: position, name: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])})

    def close(self) -> None:
        self.run.finish()


class _TensorBoard:
    def __init__(self, log_dir: pathlib.Path, run_config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=10)
        for name, value in run_config.items():
            self.writer.add_text(f"config/{name}", _markdown_code(value), 0)

    def scalars(self, values: dict[str, float], *, axis: str, position: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, position)
        self.writer.flush()

    def table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, axis: str, position: int
    ) -> None:
        def cell(value: Any) -> str:
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            return text.replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), position)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _markdown_code(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, indent=2, default=str)
    # Indented: a code block in TensorBoard's markdown.
    return "\n".join("    " + line for line in text.splitlines())


class Tracker:
    """Every tracker switched on, behind one interface; with none, each call does nothing."""

    def __init__(self, config: OrchestratorConfig) -> None:
        self._config = config.tracking
        self._writers: list[_Wandb | _TensorBoard] = []
        self.wandb: _Wandb | None = None
        if not self._config.enabled:
            return
        base = config.output.metrics_jsonl.parent if config.output.metrics_jsonl is not None else None
        run_config = {"orchestrator": config.model_dump(mode="json"), **self._service_configs()}
        if self._config.wandb.enabled:
            directory = self._config.wandb.dir or base
            assert directory is not None, "checked by the config"
            self.wandb = _Wandb(self._config, directory, run_config)
            self._writers.append(self.wandb)
            logger.info("W&B run (%s) in %s", self._config.wandb.mode, self.wandb.run_dir)
        if self._config.tensorboard.enabled:
            log_dir = self._config.tensorboard.log_dir or (base / "tensorboard" if base is not None else None)
            assert log_dir is not None, "checked by the config"
            self._writers.append(_TensorBoard(log_dir, run_config))
            logger.info("TensorBoard event files in %s", log_dir)

    def _service_configs(self) -> dict[str, str]:
        directory = self._config.config_dir
        if directory is None or not directory.is_dir():
            return {}
        return {
            path.stem: path.read_text()
            for path in sorted(directory.glob("*.toml"))
            if path.stem != "orchestrator" and not path.stem.startswith("orchestrator-")
        }

    @property
    def enabled(self) -> bool:
        return bool(self._writers)

    def log_step(self, step: int, record: Mapping[str, Any]) -> None:
        values = flatten({k: v for k, v in record.items() if k not in ("step", "time", "evals")}, "orchestrator/")
        for writer in self._writers:
            writer.scalars(values, axis="step", position=step)

    def log_trainer_step(self, step: int, metrics: Mapping[str, float]) -> None:
        values = flatten(metrics, "trainer/")
        for writer in self._writers:
            writer.scalars(values, axis="step", position=step)

    def log_eval(self, result: EvalResult) -> None:
        metrics = {k: v for k, v in result.metrics().items() if k != "policy_version"}
        values = flatten(metrics, f"eval/{result.name}/")
        rows = [
            (result.policy_version, result.environment, s.task_id, s.prompt, s.completion, s.reward, s.policy_version)
            for s in result.samples
        ]
        columns = ("eval_policy_version", "environment", "task_id", "prompt", "completion", "reward", "policy_version")
        for writer in self._writers:
            writer.scalars(values, axis="policy_version", position=result.policy_version)
            if rows:
                writer.table(
                    f"eval/{result.name}/samples", columns, rows, axis="policy_version", position=result.policy_version
                )

    def wants_samples(self, step: int) -> bool:
        return self.enabled and self._config.num_sample_rows > 0 and step % self._config.sample_interval_steps == 0

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Rows of SAMPLE_COLUMNS (the first num_sample_rows)."""
        table = [tuple(row[c] for c in SAMPLE_COLUMNS) for row in rows[: self._config.num_sample_rows]]
        for writer in self._writers:
            writer.table("samples/rollouts", SAMPLE_COLUMNS, table, axis="step", position=step)

    def close(self) -> None:
        for writer in self._writers:
            try:
                writer.close()
            except Exception:
                logger.exception("closing a tracker failed")
        self._writers = []


async def watch_trainer_steps(address: str, tracker: Tracker, *, after_step: int = 0, run_id: str = "") -> None:
    """Logs the trainer's step metrics (WatchSteps; those of run `run_id` on a trainer with
    runs) until cancelled, reconnecting."""
    last = after_step
    async with make_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        while True:
            request = trainer_pb2.WatchStepsRequest(after_step=last, run_id=run_id)
            try:
                async for response in stub.WatchSteps(request):
                    step = response.step.step
                    if step > last:
                        tracker.log_trainer_step(step, dict(response.step.metrics))
                        last = step
            except grpc.aio.AioRpcError as exc:
                logger.debug("trainer WatchSteps: %s; again", exc.code().name)
            await asyncio.sleep(1.0)
